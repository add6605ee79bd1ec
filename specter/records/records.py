"""The record schema (one row per generated sequence) and a resumable, validated CSV writer.

A record is keyed by (method, model, memory, dataset, prompt_index, repeat). Rows are appended
one line at a time, flushed and fsynced, so an interrupted run keeps every finished record and a
rerun skips them. Columns that do not apply to a method stay empty, never a made-up number.

A row counts as finished only when it is complete and valid: every column present, the key and
`new_tokens`/`output_digest` filled, every number parseable, and the line terminated. Anything
else — a line torn by a crash or a full disk, a hand-edited value, a duplicated key — is set
aside on load: appended to `records.rejected.csv` (with its line number and the reason), removed
from `records.csv` by an atomic rewrite, reported as a warning, and measured again. A row is
never silently dropped, and a new row is never appended onto a torn one. All of this is the
row store's (specter/records/rowstore.py), which batch.csv, routes.csv and trace.csv share.
"""

from __future__ import annotations

import csv
import hashlib
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from specter.records.rowstore import Rejected, RowStore, RowStoreError, Schema, parse, read_frame

KEY_COLUMNS = ("method", "model", "memory", "dataset", "prompt_index", "repeat")
COLUMNS = (
    *KEY_COLUMNS,
    # what ran
    "hardware", "K", "schedule", "prefetch", "resident_experts", "draft_quant", "decode_path", "batch_size",
    "prefix_tokens", "new_tokens",
    # latency (metrics.CommitClock)
    "tpot_ms", "ttft_ms", "e2e_ms",
    # speculation (speculative.engine.acceptance_stats)
    "accepted_tokens", "drafted_tokens", "accepted_fraction", "acceptance_alpha", "mean_accepted_len",
    # expert I/O (metrics.io_stats) and prediction
    "h2d_bytes", "demand_hits", "demand_misses", "hit_rate", "copy_wait_ms", "overlap_fraction",
    "prefetch_precision", "prefetch_recall", "dropped_prefetches", "oracle_h2d_bytes",
    # load efficiency (predict.oracle.load_columns; retention: speculative windows only): the cache's residency
    # policy, expert loads per window and MoE layer, experts resident at a window's start that it used (and of
    # those, reloaded within it), H2D bytes over the Belady bound at the method's slots, the bound per token
    "residency", "loads_per_window_layer", "retention_hits", "retention_reloads", "loads_over_belady",
    "belady_loads_per_token",
    # routing regime (metrics.window_routing over the target's RouteLog): distinct experts per window and
    # MoE layer, and that over independent routing's E·(1 − (1 − k/E)^n)
    "window_experts", "window_experts_vs_independent",
    # lossy methods: quality against target-only decoding
    "expert_budget", "budget_mode", "first_divergence", "token_match_fraction", "target_nll",
    # engines and memory (the device layout: offload.runtime.Runtime.record_fields)
    "peak_memory_bytes", "staging_buffers", "footprint_bytes", "budget_bytes", "slot_bytes", "staging_bytes",
    "draft_bytes",
    # correctness and provenance
    "lossless_check", "prompt_sha256", "output_digest", "seed",
    # the emulated link as it ran (offload.calibrate.RATIO_COLUMNS)
    "load_ratio", "effective_load_ratio", "layer_step_ms", "expert_load_ms", "load_ratio_off",
    # when it ran (unix seconds) and its place in a cell's round of interleaved methods (empty outside a cell)
    "started_at", "finished_at", "slot",
)
TEXT_COLUMNS = frozenset({"method", "model", "memory", "dataset", "hardware", "schedule", "prefetch", "residency", "draft_quant",
                          "decode_path", "budget_mode", "lossless_check", "prompt_sha256", "output_digest"})
NUMERIC_COLUMNS = tuple(c for c in COLUMNS if c not in TEXT_COLUMNS)
REQUIRED_COLUMNS = (*KEY_COLUMNS, "new_tokens", "output_digest")  # empty in none of a finished record
REJECTED_NAME = "records.rejected.csv"
_SHA256 = re.compile(r"[0-9a-f]{64}")


class RecordsError(RowStoreError):
    """records.csv cannot be used as it is (another schema, unwritable); the message says what to do."""


def token_digest(token_ids: Iterable[int]) -> str:
    """sha256 of the generated token ids (decimal, comma separated)."""
    return hashlib.sha256(",".join(str(int(t)) for t in token_ids).encode()).hexdigest()


def text_digest(text: str) -> str:
    """sha256 of a prompt's text (UTF-8): the record's `prompt_sha256`."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def record_key(row: dict[str, Any]) -> tuple[str, ...]:
    return tuple(str(row[c]) for c in KEY_COLUMNS)


# Physical bounds of a measurement: a value outside them is a hand edit or a bug, never a result.
NON_NEGATIVE = ("K", "resident_experts", "batch_size", "prefix_tokens", "tpot_ms", "ttft_ms", "e2e_ms",
                "accepted_tokens", "drafted_tokens", "mean_accepted_len", "h2d_bytes", "demand_hits", "demand_misses",
                "copy_wait_ms", "dropped_prefetches", "oracle_h2d_bytes", "loads_per_window_layer", "retention_hits",
                "retention_reloads", "loads_over_belady", "belady_loads_per_token", "expert_budget", "first_divergence",
                "target_nll", "peak_memory_bytes", "staging_buffers", "footprint_bytes", "budget_bytes", "slot_bytes",
                "staging_bytes", "draft_bytes", "seed", "load_ratio", "effective_load_ratio", "layer_step_ms",
                "expert_load_ms", "window_experts", "window_experts_vs_independent", "started_at", "finished_at", "slot")
FRACTIONS = ("accepted_fraction", "acceptance_alpha", "hit_rate", "overlap_fraction", "prefetch_precision",
             "prefetch_recall", "token_match_fraction")
# (part, whole): a count can never exceed the total it is a part of
PARTS = (("accepted_tokens", "drafted_tokens"), ("started_at", "finished_at"), ("retention_reloads", "retention_hits"))


def _number(values: dict[str, str], column: str) -> float | None:
    text = values.get(column, "")
    try:
        return float(text) if text.strip() else None
    except ValueError:
        return None


def _physical(values: dict[str, str]) -> str | None:
    """Why a record's numbers cannot be a measurement (negative times, fractions past 1, ...), or None."""
    for c in NON_NEGATIVE:
        v = _number(values, c)
        if v is not None and v < 0:
            return f"{c}={values[c]} is negative"
    for c in FRACTIONS:
        v = _number(values, c)
        if v is not None and not 0 <= v <= 1:
            return f"{c}={values[c]} is not in [0, 1]"
    for part, whole in PARTS:
        p, w = _number(values, part), _number(values, whole)
        if p is not None and w is not None and p > w:
            return f"{part}={values[part]} exceeds {whole}={values[whole]}"
    return None


def _record_rules(values: dict[str, str]) -> str | None:
    new_tokens, digest = values.get("new_tokens", ""), values.get("output_digest", "")
    if not new_tokens.isdigit() or int(new_tokens) < 1:
        return f"new_tokens={new_tokens!r} is not a positive integer"
    impossible = _physical(values)
    if impossible:
        return impossible
    if not _SHA256.fullmatch(digest):
        return f"output_digest={digest!r} is not a sha256"
    if values.get("prompt_sha256") and not _SHA256.fullmatch(values["prompt_sha256"]):
        return f"prompt_sha256={values['prompt_sha256']!r} is not a sha256"
    return None


SCHEMA = Schema("records", COLUMNS, KEY_COLUMNS, text=TEXT_COLUMNS, integers=frozenset({"prompt_index", "repeat", "slot"}),
                required=REQUIRED_COLUMNS, check=_record_rules, noun="record")


def parse_records(text: str) -> tuple[list[str], list[tuple[int, str, dict[str, str]]], list[Rejected]]:
    """(header, finished rows as (line, raw line, values), rejected lines) of a records.csv's text.

    One record per physical line. The first occurrence of a key wins; later ones are rejected.
    A header other than this version's gives no rows.
    """
    try:
        table = parse(text.encode("utf-8"), SCHEMA, exact=False)
    except RowStoreError:
        return next(csv.reader([text.split("\n", 1)[0]]), []), [], []
    return table.header, table.rows, table.rejected


class RecordWriter:
    """Appends records to `records.csv`; knows which keys are already finished.

    Opening validates the file: rejected lines are moved to `records.rejected.csv` (see the module
    docstring) and listed in `self.rejected`.
    """

    def __init__(self, path: Path, warn: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.rejected_path = self.path.with_name(REJECTED_NAME)
        try:
            self.store = RowStore(self.path, SCHEMA, warn)
        except RowStoreError as err:
            raise RecordsError(str(err)) from None
        self.rejected = self.store.rejected
        self.done = self.store.keys
        self.prompt_digests: dict[tuple[str, ...], str] = {  # key -> prompt_sha256 of finished records
            record_key(v): v.get("prompt_sha256", "") for v in self.store.rows}

    def is_done(self, key: tuple[str, ...]) -> bool:
        return key in self.done

    @property
    def finished(self) -> int:
        return len(self.done)

    def append(self, row: dict[str, Any]) -> None:
        """Append one finished record: validated, one line, flushed and fsynced.

        A write that fails part-way (a full disk) is cut back to the previous end of file, so no
        torn line is left for the next record to be glued onto.
        """
        key = record_key(row)
        if key in self.done:  # finished records are never overwritten
            raise ValueError(f"record {key} already exists in {self.path}")
        try:
            self.store.append(row, what="a record")
        except ValueError as err:
            if isinstance(err, RowStoreError):
                raise RecordsError(str(err)) from None
            raise
        self.prompt_digests[key] = row.get("prompt_sha256") or ""


def read_records(path: Path, warn: Callable[[str], None] | None = None):
    """The finished records of a records.csv as a DataFrame (validated; rejected lines excluded and
    reported as warnings without modifying the file)."""
    try:
        return read_frame(Path(path), SCHEMA, warn, exact=True)
    except RowStoreError as err:
        raise RecordsError(str(err)) from None
