"""Verification schedule: expert-wise over token-wise verification of K tokens (Fig. 12's claim).

Input: verify_schedule.csv from scripts/bench_verify.py (model, memory, K, expert_wise_ms,
token_wise_ms, speedup, ...).
"""

from __future__ import annotations

import pandas as pd
from matplotlib.patches import Patch

from specter.figures.common import PALETTE, Output, Skip, legend_above, model_label, order_models, style_axes, subplots
from specter.figures.data import ResultSet

NAME = "verify_schedule"


def build(results: ResultSet, out: Output) -> None:
    frames = [df for _, df in results.csvs("verify_schedule.csv") if {"model", "K", "speedup"} <= set(df.columns)]
    if not frames:
        raise Skip("no verify_schedule.csv (python -m scripts.bench_verify)")
    df = pd.concat(frames, ignore_index=True)
    if "memory" not in df:
        df["memory"] = ""
    table = df.groupby(["model", "memory", "K"], as_index=False).median(numeric_only=True)
    out.table(table, NAME, "Verification of K tokens: expert-wise speedup over token-wise (median)",
              notes=["speedup = token_wise_ms / expert_wise_ms; > 1: expert-wise is faster."])
    ks = sorted(table["K"].unique())
    colors = {k: PALETTE[i % len(PALETTE)] for i, k in enumerate(ks)}
    models = order_models(table["model"])
    fig, axes = subplots(1, len(models), w=3.4, h=2.6)
    for ax, model in zip(axes[0], models):
        d = table[table["model"] == model]
        tiers = list(dict.fromkeys(d["memory"]))
        width = 0.8 / len(ks)
        for i, k in enumerate(ks):
            e = d[d["K"] == k].set_index("memory")
            xs = [j + (i - (len(ks) - 1) / 2) * width for j, t in enumerate(tiers) if t in e.index]
            ax.bar(xs, [e.loc[t, "speedup"] for t in tiers if t in e.index], width=width, color=colors[k])
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks(range(len(tiers)), [f"{t} memory" if t else "" for t in tiers])
        style_axes(ax, model_label(model), ylabel="expert-wise speedup (×)")
    legend_above(fig, [Patch(color=colors[k]) for k in ks], [f"K={k}" for k in ks])
    fig.tight_layout()
    out.figure(fig, NAME)
