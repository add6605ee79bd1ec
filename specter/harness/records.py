"""The record schema (one row per generated sequence) and a resumable, validated CSV writer.

A record is keyed by (method, model, memory, dataset, prompt_index, repeat). Rows are appended
one line at a time, flushed and fsynced, so an interrupted run keeps every finished record and a
rerun skips them. Columns that do not apply to a method stay empty, never a made-up number.

A row counts as finished only when it is complete and valid: every column present, the key and
`new_tokens`/`output_digest` filled, every number parseable, and the line terminated. Anything
else — a line torn by a crash or a full disk, a hand-edited value, a duplicated key — is set
aside on load: appended to `records.rejected.csv` (with its line number and the reason), removed
from `records.csv` by an atomic rewrite, reported as a warning, and measured again. A row is
never silently dropped, and a new row is never appended onto a torn one.
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specter.harness.config import ConfigError
from specter.paths import atomic_write_text

KEY_COLUMNS = ("method", "model", "memory", "dataset", "prompt_index", "repeat")
COLUMNS = (
    *KEY_COLUMNS,
    # what ran
    "hardware", "K", "schedule", "prefetch", "resident_experts", "draft_quant", "batch_size",
    "prefix_tokens", "new_tokens",
    # latency (metrics.CommitClock)
    "tpot_ms", "ttft_ms", "e2e_ms",
    # speculation (speculative.engine.acceptance_stats)
    "accepted_tokens", "drafted_tokens", "accepted_fraction", "acceptance_alpha", "mean_accepted_len",
    # expert I/O (metrics.io_stats) and prediction
    "h2d_bytes", "demand_hits", "demand_misses", "copy_wait_ms", "overlap_fraction",
    "prefetch_precision", "prefetch_recall", "dropped_prefetches", "oracle_h2d_bytes",
    # lossy methods: quality against target-only decoding
    "expert_budget", "budget_mode", "first_divergence", "token_match_fraction", "target_nll",
    # engines and memory
    "peak_memory_bytes",
    # correctness and provenance
    "lossless_check", "prompt_sha256", "output_digest", "seed",
    # the emulated link as it ran (offload.calibrate.RATIO_COLUMNS)
    "load_ratio", "effective_load_ratio", "layer_step_ms", "expert_load_ms", "load_ratio_off",
)
TEXT_COLUMNS = frozenset({"method", "model", "memory", "dataset", "hardware", "schedule", "prefetch", "draft_quant",
                          "budget_mode", "lossless_check", "prompt_sha256", "output_digest"})
NUMERIC_COLUMNS = tuple(c for c in COLUMNS if c not in TEXT_COLUMNS)
REQUIRED_COLUMNS = (*KEY_COLUMNS, "new_tokens", "output_digest")  # empty in none of a finished record
REJECTED_NAME = "records.rejected.csv"
_SHA256 = re.compile(r"[0-9a-f]{64}")


class RecordsError(ConfigError):
    """records.csv cannot be used as it is (another schema, unwritable); the message says what to do."""


@dataclass(frozen=True)
class Rejected:
    """A line of records.csv that is not a finished record."""

    line: int  # 1-based line number in records.csv
    reason: str
    text: str  # the line as it was


def token_digest(token_ids: Iterable[int]) -> str:
    """sha256 of the generated token ids (decimal, comma separated)."""
    return hashlib.sha256(",".join(str(int(t)) for t in token_ids).encode()).hexdigest()


def text_digest(text: str) -> str:
    """sha256 of a prompt's text (UTF-8): the record's `prompt_sha256`."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def record_key(row: dict[str, Any]) -> tuple[str, ...]:
    return tuple(str(row[c]) for c in KEY_COLUMNS)


def row_problem(values: dict[str, str]) -> str | None:
    """Why a row (column -> text as in the CSV) is not a finished record, or None when it is one."""
    empty = [c for c in REQUIRED_COLUMNS if not values.get(c, "").strip()]
    if empty:
        return f"required column(s) empty: {', '.join(empty)}"
    for c in ("prompt_index", "repeat"):
        if not values[c].isdigit():
            return f"{c}={values[c]!r} is not a non-negative integer"
    for c in NUMERIC_COLUMNS:
        v = values.get(c, "")
        if v == "":
            continue
        try:
            float(v)
        except ValueError:
            return f"{c}={v!r} is not a number"
    if not values["new_tokens"].isdigit() or int(values["new_tokens"]) < 1:
        return f"new_tokens={values['new_tokens']!r} is not a positive integer"
    if not _SHA256.fullmatch(values["output_digest"]):
        return f"output_digest={values['output_digest']!r} is not a sha256"
    if values.get("prompt_sha256") and not _SHA256.fullmatch(values["prompt_sha256"]):
        return f"prompt_sha256={values['prompt_sha256']!r} is not a sha256"
    return None


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return str(v).replace("\r", " ").replace("\n", " ")  # one physical line per record


def _format_row(values: list[str]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(values)
    return buf.getvalue()


def parse_records(text: str) -> tuple[list[str], list[tuple[int, str, dict[str, str]]], list[Rejected]]:
    """(header, finished rows as (line, raw line, values), rejected lines) of a records.csv's text.

    One record per physical line. The first occurrence of a key wins; later ones are rejected.
    """
    lines = text.split("\n")
    terminated = text.endswith("\n")
    if terminated:
        lines = lines[:-1]
    if not lines:
        return [], [], []
    header = next(csv.reader([lines[0]]), [])
    good: list[tuple[int, str, dict[str, str]]] = []
    rejected: list[Rejected] = []
    seen: dict[tuple[str, ...], int] = {}
    for i, raw in enumerate(lines[1:], start=2):
        if not raw.strip():
            if raw:
                rejected.append(Rejected(i, "blank line", raw))
            continue
        if i == len(lines) and not terminated:
            rejected.append(Rejected(i, "torn last line (no line end: the write was interrupted)", raw))
            continue
        try:
            fields = next(csv.reader([raw]))
        except csv.Error as err:
            rejected.append(Rejected(i, f"not a CSV row ({err})", raw))
            continue
        if len(fields) != len(header):
            rejected.append(Rejected(i, f"{len(fields)} columns instead of {len(header)}", raw))
            continue
        values = dict(zip(header, fields))
        problem = row_problem(values)
        if problem:
            rejected.append(Rejected(i, problem, raw))
            continue
        key = record_key(values)
        if key in seen:
            rejected.append(Rejected(i, f"duplicate of the record on line {seen[key]}", raw))
            continue
        seen[key] = i
        good.append((i, raw, values))
    return header, good, rejected


class RecordWriter:
    """Appends records to `records.csv`; knows which keys are already finished.

    Opening validates the file: rejected lines are moved to `records.rejected.csv` (see the module
    docstring) and listed in `self.rejected`.
    """

    def __init__(self, path: Path, warn: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.rejected_path = self.path.with_name(REJECTED_NAME)
        self.done: set[tuple[str, ...]] = set()
        self.rejected: list[Rejected] = []
        self.prompt_digests: dict[tuple[str, ...], str] = {}  # key -> prompt_sha256 of finished records
        warn = warn or (lambda msg: print(f"specter: warning: {msg}", file=sys.stderr, flush=True))
        try:
            text = self.path.read_text(encoding="utf-8") if self.path.exists() else ""
        except (OSError, UnicodeDecodeError) as err:
            raise RecordsError(f"cannot read {self.path} ({err})") from None
        header_line = _format_row(list(COLUMNS))
        if not text.strip():
            self._write_atomic(header_line)
            return
        header, good, rejected = parse_records(text)
        if tuple(header) != COLUMNS:
            raise RecordsError(
                f"{self.path} has columns {header}, not this version's schema; use a new output_dir"
            )
        if rejected:
            self._set_aside(rejected, header_line)
            self._write_atomic(header_line + "".join(raw + "\n" for _, raw, _ in good))
            for r in rejected:
                warn(f"{self.path} line {r.line}: {r.reason}; moved to {self.rejected_path.name} "
                     "(that record will be measured again)")
        self.rejected = rejected
        for _, _, values in good:
            key = record_key(values)
            self.done.add(key)
            self.prompt_digests[key] = values.get("prompt_sha256", "")

    def _set_aside(self, rejected: list[Rejected], header_line: str) -> None:
        try:
            new = not self.rejected_path.exists() or self.rejected_path.stat().st_size == 0
            with self.rejected_path.open("a", encoding="utf-8", newline="") as f:
                if new:
                    f.write("line,reason,row\n")
                for r in rejected:
                    f.write(_format_row([str(r.line), r.reason, r.text]))
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            raise RecordsError(f"cannot set aside invalid rows of {self.path} in {self.rejected_path} ({err})") from None

    def _write_atomic(self, text: str) -> None:
        try:
            atomic_write_text(self.path, text)
        except OSError as err:
            raise RecordsError(f"cannot write {self.path} ({err.strerror or err})") from None

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
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise KeyError(f"unknown record columns: {sorted(unknown)}")
        key = record_key(row)
        if key in self.done:  # finished records are never overwritten
            raise ValueError(f"record {key} already exists in {self.path}")
        values = [_cell(row.get(c)) for c in COLUMNS]
        problem = row_problem(dict(zip(COLUMNS, values)))
        if problem:
            raise ValueError(f"refusing to write an invalid record {key}: {problem}")
        line = _format_row(values).encode("utf-8")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as err:
            raise RecordsError(f"cannot append to {self.path} ({err.strerror or err})") from None
        try:
            end = os.fstat(fd).st_size
            try:
                written = os.write(fd, line)
                while written < len(line):
                    written += os.write(fd, line[written:])
                os.fsync(fd)
            except OSError as err:
                try:
                    os.ftruncate(fd, end)
                except OSError:
                    pass  # the torn line is rejected on the next load
                raise RecordsError(f"cannot append a record to {self.path} ({err.strerror or err}); "
                                   "finished records are kept, rerun to resume") from None
        finally:
            os.close(fd)
        self.done.add(key)
        self.prompt_digests[key] = row.get("prompt_sha256") or ""


def read_records(path: Path):
    """The finished records of a records.csv as a DataFrame (validated; rejected lines excluded and
    reported as warnings without modifying the file)."""
    import pandas as pd

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RecordsError(f"cannot read {path} ({err})") from None
    header, good, rejected = parse_records(text)
    if tuple(header) != COLUMNS:
        raise RecordsError(f"{path} has columns {header}, not this version's schema")
    for r in rejected:
        print(f"specter: warning: {path} line {r.line}: {r.reason}; not counted", file=sys.stderr)
    body = _format_row(list(COLUMNS)) + "".join(raw + "\n" for _, raw, _ in good)
    return pd.read_csv(io.StringIO(body), dtype={c: str for c in TEXT_COLUMNS})
