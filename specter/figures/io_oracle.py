"""H2D traffic against the perfect-knowledge (Belady) oracle, per model, tier and method variant.

Input: records with h2d_bytes and oracle_h2d_bytes. Side benchmarks (results/bench: the prefetch
ablations) are used when present, else the main grid. ratio = sum(h2d_bytes) / sum(oracle_h2d_bytes).
Each method's oracle is the bound for its own cache (its M slots per layer, the `oracle_slots`
column; staging buffers are lent within a window and back at its end, so they do not loosen it)
over its own windows (a decode step for autoregressive methods, a K+1 verification for speculative
ones), so every ratio is against the same kind of bound. Variants are named by the settings that
differ between a method's runs in a cell (`labels.compact_variants`: 'specter[prefetch=none]'),
and the legend says them in words; the CSV keeps the full variant label in `variant`.
"""

from __future__ import annotations

import pandas as pd

from specter.figures.common import Output, Skip, ratio_bars
from specter.figures.data import ResultSet
from specter.figures.labels import compact_variants, legend_label, token_match_of
from specter.figures.staging import is_staging_ablation

NAME = "io_vs_oracle"


def build(results: ResultSet, out: Output) -> None:
    records = results.records("bench")
    if not records.empty and "run" in records:  # the staging ablation is drawn by its own figure
        records = records[~records["run"].map(is_staging_ablation)]
    if records.empty or "oracle_h2d_bytes" not in records or records["oracle_h2d_bytes"].isna().all():
        records = results.records("main")
    if records.empty or "oracle_h2d_bytes" not in records or records["oracle_h2d_bytes"].isna().all():
        raise Skip("no record has oracle_h2d_bytes")
    sub = records.dropna(subset=["oracle_h2d_bytes", "h2d_bytes"])
    g = sub.groupby(["model", "memory", "variant"])
    table = pd.DataFrame({"h2d_bytes": g["h2d_bytes"].sum(), "oracle_h2d_bytes": g["oracle_h2d_bytes"].sum(),
                          "tokens": g["new_tokens"].sum() if "new_tokens" in sub else None,
                          "oracle_slots": g["resident_experts"].first() if "resident_experts" in sub else None,
                          "staging_buffers": g["staging_buffers"].first() if "staging_buffers" in sub else None,
                          }).reset_index()
    table["ratio"] = table["h2d_bytes"] / table["oracle_h2d_bytes"].where(table["oracle_h2d_bytes"] > 0)
    table["method"] = compact_variants(table, column="variant")
    match = token_match_of(sub, by="variant")
    labels = {m: legend_label(m, match.get(v)) for m, v in zip(table["method"], table["variant"])}
    out.table(table, NAME, "H2D bytes relative to the perfect-knowledge oracle (sum over records)",
              notes=["ratio = h2d_bytes / oracle_h2d_bytes; 1 = as few bytes as an oracle with a perfect future.",
                     "oracle_slots: the slots per layer each method's own bound assumes (its M); staging buffers "
                     "are lent only within a window and do not loosen the bound (tests/test_oracle.py)."])
    ratio_bars(out, table, NAME, "ratio", "H2D bytes / oracle bytes", labels=labels)
