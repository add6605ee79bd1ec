"""The record schema (one row per generated sequence) and a resumable CSV writer.

A record is keyed by (method, model, memory, dataset, prompt_index, repeat). Rows are appended and
flushed one at a time, so an interrupted run keeps every finished record; a rerun skips them.
Columns that do not apply to a method stay empty, never a made-up number.
"""

from __future__ import annotations

import csv
import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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
)


def token_digest(token_ids: Iterable[int]) -> str:
    """sha256 of the generated token ids (decimal, comma separated)."""
    return hashlib.sha256(",".join(str(int(t)) for t in token_ids).encode()).hexdigest()


def record_key(row: dict[str, Any]) -> tuple[str, ...]:
    return tuple(str(row[c]) for c in KEY_COLUMNS)


class RecordWriter:
    """Appends records to `records.csv`; knows which keys are already finished."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.done: set[tuple[str, ...]] = set()
        if self.path.exists() and self.path.stat().st_size > 0:
            with self.path.open(newline="") as f:
                reader = csv.DictReader(f)
                if tuple(reader.fieldnames or ()) != COLUMNS:
                    raise ValueError(
                        f"{self.path} has columns {reader.fieldnames}, not this version's schema; "
                        "use a new output_dir"
                    )
                self.done = {record_key(r) for r in reader}
        else:
            with self.path.open("w", newline="") as f:
                csv.writer(f).writerow(COLUMNS)

    def is_done(self, key: tuple[str, ...]) -> bool:
        return key in self.done

    def append(self, row: dict[str, Any]) -> None:
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise KeyError(f"unknown record columns: {sorted(unknown)}")
        key = record_key(row)
        if key in self.done:  # finished records are never overwritten
            raise ValueError(f"record {key} already exists in {self.path}")
        with self.path.open("a", newline="") as f:
            csv.writer(f).writerow(["" if row.get(c) is None else row.get(c) for c in COLUMNS])
            f.flush()
        self.done.add(key)
