"""Fig. 14: single-request TPOT, models × memory tiers × datasets (+AVG) × every method present.

Statistics, per (model, tier, dataset, method):
  mean    mean TPOT over records (what the paper plots and averages)
  median, p90 over records
  std_repeats  standard deviation across repeats of the per-repeat mean (the error bar);
               empty with a single repeat
AVG is the mean over the method's datasets of the per-dataset means (the paper's "average over
five datasets"); its median/p90 are over all records, its error bar the std across repeats of the
per-repeat AVG.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.patches import Patch

from specter.figures.common import (
    grouped_bars,
    Output,
    Skip,
    dataset_label,
    legend_above,
    method_colors,
    method_label,
    model_label,
    order_datasets,
    order_methods,
    order_models,
    order_tiers,
    percentile,
    style_axes,
    subplots,
)
from specter.figures.data import ResultSet

NAME = "fig14_tpot"
TITLE = "Fig. 14: TPOT per model, memory tier, dataset and method"
KEYS = ["model", "memory", "variant"]


def tpot_table(records: pd.DataFrame) -> pd.DataFrame:
    """The numbers behind Fig. 14 (see the module docstring)."""
    rows = []
    for (model, memory, variant), g in records.groupby(KEYS, sort=False):
        per_ds = {}
        for dataset, d in g.groupby("dataset", sort=False):
            per_repeat = d.groupby("repeat")["tpot_ms"].mean()
            per_ds[dataset] = per_repeat
            rows.append(_row(model, memory, variant, dataset, d["tpot_ms"], per_repeat, 1))
        means = pd.DataFrame(per_ds)  # [repeat, dataset] per-repeat means
        per_repeat_avg = means.mean(axis=1)  # AVG of each repeat over the datasets it holds
        row = _row(model, memory, variant, "AVG", g["tpot_ms"], per_repeat_avg, len(per_ds))
        row["mean_ms"] = float(np.mean([r["mean_ms"] for r in rows[-len(per_ds):]]))
        rows.append(row)
    table = pd.DataFrame(rows)
    table["_m"] = table["model"].map({m: i for i, m in enumerate(order_models(table["model"]))})
    table["_t"] = table["memory"].map({m: i for i, m in enumerate(order_tiers(table["memory"]))})
    table["_d"] = table["dataset"].map({m: i for i, m in enumerate(order_datasets(table["dataset"]))})
    table["_v"] = table["method"].map({m: i for i, m in enumerate(order_methods(table["method"]))})
    return table.sort_values(["_m", "_t", "_d", "_v"]).drop(columns=["_m", "_t", "_d", "_v"]).reset_index(drop=True)


def _row(model, memory, variant, dataset, tpot: pd.Series, per_repeat: pd.Series, datasets: int) -> dict:
    return {
        "model": model, "memory": memory, "dataset": dataset, "method": variant,
        "mean_ms": float(tpot.mean()), "median_ms": float(tpot.median()), "p90_ms": percentile(tpot, 90),
        "std_repeats_ms": float(per_repeat.std(ddof=1)) if len(per_repeat) > 1 else float("nan"),
        "records": int(tpot.notna().sum()), "repeats": len(per_repeat), "datasets": datasets,
    }


def build(results: ResultSet, out: Output) -> None:
    records = results.records("main")
    if records.empty:
        raise Skip("no records.csv (outside K-sweep and bench folders)")
    records = records.dropna(subset=["tpot_ms"])
    table = tpot_table(records)
    hw = ", ".join(sorted(set(map(str, records["hardware"].dropna()))))
    out.table(table, NAME, TITLE, notes=[
        f"TPOT in ms/token; mean over records (plotted), median and p90 over records; error bar = std across "
        f"repeats of the per-repeat mean. AVG = mean of the per-dataset means. Hardware: {hw or 'unknown'}."])
    draw(table, out)


def draw(table: pd.DataFrame, out: Output) -> None:
    models, tiers = order_models(table["model"]), order_tiers(table["memory"])
    variants = order_methods(table["method"])
    colors = method_colors(variants)
    fig, axes = subplots(len(models), len(tiers), w=max(3.8, 0.9 * table["dataset"].nunique() + 1.5), h=2.7)
    for r, model in enumerate(models):
        for c, tier in enumerate(tiers):
            ax = axes[r][c]
            sub = table[(table["model"] == model) & (table["memory"] == tier)]
            if sub.empty:
                ax.set_axis_off()
                continue
            datasets = order_datasets(sub["dataset"])
            present = [v for v in variants if v in set(sub["method"])]
            grouped_bars(ax, datasets, present, sub, by="method", index="dataset", value="mean_ms",
                         colors=colors, error="std_repeats_ms")
            ax.set_xticks(range(len(datasets)), [dataset_label(d) for d in datasets])
            if "AVG" in datasets:
                ax.axvline(len(datasets) - 1.5, color="#999999", lw=0.6, ls=":")
            style_axes(ax, f"{model_label(model)} — {tier} memory", ylabel="TPOT (ms/token)" if c == 0 else None)
    handles = [Patch(color=colors[v]) for v in variants]
    legend_above(fig, handles, [method_label(v) for v in variants])
    fig.tight_layout()
    out.figure(fig, NAME)
