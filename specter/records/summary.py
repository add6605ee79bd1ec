"""Per-(method, model, memory, dataset) summary of a records.csv, as CSV and a terminal table.

Only finished records are summarized (`records.read_records` validates every row), and
summary.csv is written atomically.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

GROUP = ["method", "model", "memory", "dataset"]


def summarize(records: pd.DataFrame) -> pd.DataFrame:
    df = records.copy()
    df["h2d_mb_per_token"] = df["h2d_bytes"] / df["new_tokens"] / 1e6
    if "hit_rate" not in df:  # records of an older layout: the same rate from the counts
        demand = df["demand_hits"] + df["demand_misses"]
        df["hit_rate"] = df["demand_hits"] / demand.where(demand > 0)
    for col in ("window_experts", "window_experts_vs_independent", "loads_per_window_layer", "retention_hits",
                "retention_reloads", "belady_loads_per_token"):
        if col not in df:
            df[col] = float("nan")
    agg = df.groupby(GROUP, sort=False).agg(
        records=("output_digest", "size"),
        new_tokens=("new_tokens", "median"),
        tpot_ms=("tpot_ms", "median"),
        ttft_ms=("ttft_ms", "median"),
        acceptance_alpha=("acceptance_alpha", "mean"),
        mean_accepted_len=("mean_accepted_len", "mean"),
        h2d_mb_per_token=("h2d_mb_per_token", "mean"),
        hit_rate=("hit_rate", "mean"),  # demand hit rate of the device expert cache (empty: every expert resident)
        # the routing regime: distinct experts per window and MoE layer, and that over independent routing's expectation
        window_experts=("window_experts", "mean"),
        window_experts_vs_independent=("window_experts_vs_independent", "mean"),
        prefetch_recall=("prefetch_recall", "mean"),
        # load efficiency (predict.oracle.load_columns): loads per window and MoE layer, retained experts a window
        # used (and of those, reloaded within it) per record, the Belady bound in loads per token
        loads_per_window_layer=("loads_per_window_layer", "mean"),
        retention_hits=("retention_hits", "mean"),
        retention_reloads=("retention_reloads", "mean"),
        belady_loads_per_token=("belady_loads_per_token", "mean"),
        # the emulated link as it ran (assembly/load_ratio.py): configured and mean effective ratio, flagged records
        load_ratio=("load_ratio", "first"),
        effective_load_ratio=("effective_load_ratio", "mean"),
        load_ratio_off=("load_ratio_off", lambda s: s.sum(min_count=1)),
    )
    bytes_sum = df.groupby(GROUP, sort=False)["h2d_bytes"].sum()
    oracle_sum = df.groupby(GROUP, sort=False)["oracle_h2d_bytes"].sum(min_count=1)
    agg["oracle_ratio"] = bytes_sum / oracle_sum.where(oracle_sum > 0)
    agg["loads_over_belady"] = agg["oracle_ratio"]  # the same ratio of sums, under the name records carry
    return agg.reset_index()


def write_summary(out: Path) -> pd.DataFrame:
    from specter.records.records import RecordsError, read_records
    from specter.paths import atomic_write_text

    summary = summarize(read_records(out / "records.csv"))
    try:
        atomic_write_text(out / "summary.csv", summary.to_csv(index=False))
    except OSError as err:
        raise RecordsError(f"cannot write {out / 'summary.csv'} ({err.strerror or err})") from None
    return summary


def print_summary(summary: pd.DataFrame, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, header_style="bold")
    shown = [c for c in summary.columns if summary[c].notna().any()]
    for col in shown:
        table.add_column(col, justify="left" if col in GROUP else "right")
    for _, row in summary.iterrows():
        table.add_row(*[_fmt(row[c]) for c in shown])
    Console(width=max(120, 14 * len(shown))).print(table)


def _fmt(v) -> str:
    if isinstance(v, float):
        return "" if pd.isna(v) else f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
