"""The columns of batch.csv and their validation schema: torch-free, so the figures read batch.csv
through the same validated reader the harness writes it with."""

from __future__ import annotations

from specter.records.rowstore import Schema

BATCH_COLUMNS = (
    # the columns the figure code reads (specter/figures/batching.py)
    "method", "model", "memory", "batch_size", "dataset", "tpot_median_ms", "tpot_p90_ms", "throughput_tok_s",
    "distinct_experts_per_layer", "h2d_bytes_per_token", "acceptance",
    # more of the same measurement
    "repeat", "hardware", "K", "resident_experts", "requests", "batches", "new_tokens", "wall_s", "tpot_mean_ms",
    "ttft_median_ms", "accepted_fraction", "iterations", "h2d_bytes", "demand_hits", "demand_misses",
    "copy_wait_ms", "oracle_h2d_bytes", "prefetch_recall", "kv_compactions", "footprint_mb", "budget_mb",
    # added later, at the end (readers take the older header; a writer resuming one asks for a new output_dir)
    "token_match_fraction",
)

BATCH_TEXT = frozenset({"method", "model", "memory", "dataset", "hardware"})
BATCH_SCHEMA = Schema(
    "batch", BATCH_COLUMNS, ("dataset", "repeat"), text=BATCH_TEXT,
    integers=frozenset({"batch_size", "repeat", "requests", "batches", "new_tokens", "iterations"}),
    required=("method", "model", "memory", "batch_size", "dataset", "repeat", "requests", "batches", "new_tokens",
              "wall_s"),
)
