"""Projected Figs. 15 and Table 3: batched decoding on the paper's machine, beside the paper's batching numbers.

Input: `batch_projection.csv` and `batch_vs_paper.csv` as `python run.py experiment=project project.batch=true`
writes them (per model x tier x device; `python -m specter.experiments.projection_grid --batch` for the grid). Per device
file (suffix _<device> beside the A100's; hardware never shares a panel):

fig15_projected_batch      one row per model: mean per-request TPOT against B, throughput against B (one line
                           per method), and the paper's batching ratios beside the same ratios projected
                           (B = 1 -> 2 and 1 -> 32 for Specter, Specter over SpecMoEOff at B = 32 and 16)
table3_projected_batch     every projected point: TPOT, throughput, loads per token, acceptance, working set
table3_projected_vs_paper  each of the paper's batching claims beside the projected ratio (and, for the claims
                           against SpecMoEOff, quoted as maxima, the projected maximum over B and its B)
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from specter.figures.common import (Output, Skip, caption, legend_above, method_colors, model_label, order_methods,
                                    order_models, style_axes, subplots, wrap)
from specter.figures.labels import legend_label
from specter.figures.data import ResultSet
from specter.figures.projection import _found, device_label, suffix

CLAIM_LABELS = {"batch_tpot_ratio": "TPOT", "batch_throughput_ratio": "throughput", "batch_working_set_ratio":
                "working set", "batch_tpot_speedup": "TPOT vs SpecMoEOff", "batch_throughput_gain":
                "throughput vs SpecMoEOff"}


def read_found(results: ResultSet, name: str, need: set[str]) -> pd.DataFrame:
    """Every `name` CSV the projection figures find that has the `need` columns and rows, concatenated."""
    frames = [df for _, df in _found(results, name) if need <= set(df.columns) and len(df)]
    if not frames:
        return pd.DataFrame()
    return pd.concat(frames, ignore_index=True)


def build(results: ResultSet, out: Output) -> None:
    df = read_found(results, "batch_projection.csv", {"method", "batch_size", "tpot_ms", "throughput_tok_s", "device"})
    if df.empty:
        raise Skip("no batch_projection.csv (run: python run.py experiment=project project.batch=true)")
    df = df.drop_duplicates(["model", "memory", "device", "method", "batch_size"], keep="last")
    versus = read_found(results, "batch_vs_paper.csv", {"claim", "paper", "projected", "device"})
    for device, g in df.groupby("device", sort=True):
        v = versus[versus["device"] == device] if not versus.empty else versus
        _figure(g, v, out, device)
        _tables(g, v, out, device)


def _tier(g: pd.DataFrame) -> str:
    tiers = set(g["memory"].astype(str))
    return "high" if "high" in tiers else sorted(tiers)[0]


def _figure(df: pd.DataFrame, versus: pd.DataFrame, out: Output, device: str) -> None:
    models = order_models(df["model"].unique())
    methods = order_methods(df["method"].unique())
    colors = method_colors(methods)
    fig, axes = subplots(len(models), 3, w=3.2, h=2.6)
    for row, model in zip(axes, models):
        g = df[df["model"] == model]
        tier = _tier(g)
        g = g[g["memory"].astype(str) == tier]
        draft = str(g["draft"].iloc[0]) if "draft" in g.columns else "draft not recorded"
        for method in methods:
            m = g[g["method"] == method].sort_values("batch_size")
            if m.empty:
                continue
            for ax, col in zip(row[:2], ("tpot_ms", "throughput_tok_s")):
                ax.plot(m["batch_size"], m[col], marker="o", ms=3.5, lw=1.4, color=colors[method])
        sizes = sorted(g["batch_size"].unique())
        for ax, ylabel in zip(row[:2], ("mean TPOT per request (ms)", "throughput (tokens/s)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(int(b)) for b in sizes])
            ax.minorticks_off()
            style_axes(ax, None, xlabel="batch size B", ylabel=ylabel)
        # wrapped to its panel: unbroken, the draft's name ran over the next panel's tick labels
        row[0].set_title(wrap(f"{model_label(model)}, {tier} memory\n{device_label(device)}; {draft} draft",
                              fig.get_figwidth() / 3 - 0.4, 9), fontsize=9, loc="left", fontweight="bold")
        _claims(row[2], versus[(versus["model"] == model) & (versus["memory"].astype(str) == tier)]
                if not versus.empty else versus, device)
    handles = [Line2D([], [], color=colors[m], marker="o") for m in methods]
    labels = [legend_label(m) for m in methods]
    handles += [Patch(color="black"), Patch(color="#9E9E9E")]
    labels += ["paper (Table 3 / Figs. 15-16 text)", "projected"]
    legend_above(fig, handles, labels)
    fig.tight_layout()
    caption(fig, f"A model, not a measurement: batching projected onto {device_label(device)} (cost model + virtual "
                 "clock driven by the engine's own batched loop on the tiny proxy), drafts as each row names them.")
    out.figure(fig, "fig15_projected_batch" + suffix(device))


def _claims(ax, versus: pd.DataFrame, device: str) -> None:
    """Paired bars: the paper's ratio (its A100) and the projected one (on `device`), per claim."""
    if versus.empty:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no paper claims for this model", ha="center", va="center", transform=ax.transAxes)
        return
    v = versus.assign(paper=pd.to_numeric(versus["paper"], errors="coerce"),
                      projected=pd.to_numeric(versus["projected"], errors="coerce"))
    names = [f"{CLAIM_LABELS.get(c, c)}\nB {a}->{b}" if c.endswith("ratio") else f"{CLAIM_LABELS.get(c, c)}\nB={b}"
             for c, a, b in zip(v["claim"], v["batch_from"], v["batch_to"])]
    y = np.arange(len(v))
    ax.barh(y - 0.2, v["paper"], 0.4, color="black")
    ax.barh(y + 0.2, v["projected"].fillna(0), 0.4, color="#9E9E9E")
    ax.set_yticks(y, names, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", lw=0.6, ls=":")
    panel_in = ax.figure.get_figwidth() / 3 - 0.6  # this panel's width: unbroken, the title ran past the figure
    style_axes(ax, wrap(f"paper (its A100) vs projected ratios on {device_label(device)}", panel_in, 10),
               xlabel="ratio (x)")
    ax.grid(axis="x", alpha=0.3, linewidth=0.6)


def _tables(df: pd.DataFrame, versus: pd.DataFrame, out: Output, device: str) -> None:
    cols = [c for c in ("model", "memory", "device", "draft", "method", "K", "batch_size", "tpot_ms", "throughput_tok_s",
                        "tpot_vs_b1", "throughput_vs_b1", "loads_per_token", "acceptance", "working_set")
            if c in df.columns]
    table = df[cols].sort_values(["model", "memory", "method", "batch_size"]).reset_index(drop=True)
    drafts = ", ".join(sorted({str(d) for d in df.get("draft", pd.Series(dtype=str)).dropna()})) or "not recorded"
    note = ("A model of that machine (cost model + virtual clock) driven by the engine's own batched loop on the "
            "tiny proxy (per-request KV, acceptance and rollback), not a measurement. TPOT: mean per-request TPOT; "
            "throughput: the batch's tokens over its span.")
    out.table(table, "table3_projected_batch" + suffix(device),
              f"Projected batching on {device_label(device)} ({device}), {drafts} draft", notes=[note])
    if not versus.empty:
        out.table(versus.reset_index(drop=True), "table3_projected_vs_paper" + suffix(device),
                  f"The paper's batching numbers beside the projection on {device_label(device)}, {drafts} draft",
                  notes=["paper: results/paper/claims.csv (the paper's A100). projected_max: the largest projected "
                         "value over B, for the claims the paper quotes as maxima."])
