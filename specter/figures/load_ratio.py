"""TPOT against the emulated link's load ratio r, per model and memory tier; Specter's speedup below.

Input: every `load_ratio.csv` (experiment=load_ratio_sweep: model, memory, method, load_ratio,
tpot_ms, effective_load_ratio, ...). Each point sits at its configured r; a thin whisker ending in
a small cross runs from it to the *effective* ratio the cell's records ran under (their mean), so
a cell whose machine drifted off its configured link shows it. Each model's named points are marked: the
device file's ratio (the cost model of the real model, what an emulated run defaults to) solid, and the
earlier hand estimate (r = 0.7 for DeepSeek-V2-Lite and Qwen1.5-MoE, 6 for Phi-3.5-MoE) dotted.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from matplotlib.ticker import NullLocator

from specter.figures.common import (MODEL_LABELS, REAL_OF_TINY, Output, Skip, caption, legend_above, method_colors,
                                    model_label, order_methods, order_models, order_tiers, style_axes, subplots)
from specter.figures.labels import legend_label
from specter.figures.data import ResultSet

NAME = "fig_load_ratio"
TITLE = "TPOT against the emulated link's load ratio r = expert load / layer step (per model and tier)"
# The earlier hand estimate of r per real model (a sweep without a `point` column is marked with these).
OPERATING_POINTS = {"dsv2": 0.7, "qwen15moe": 0.7, "phi35moe": 6.0}
REFERENCE, BASELINE, OURS = "target_only", "offload_ar", "specter"
STYLE_WORDS = {"-": "solid", "--": "dashed", "-.": "dash-dotted", ":": "dotted"}
NEEDED = {"model", "memory", "method", "load_ratio", "tpot_ms"}


def sweep_table(results: ResultSet) -> pd.DataFrame:
    """Every load_ratio.csv row, with Specter's speedup over offload_ar at the same (model, tier, r)."""
    frames = []
    for path, df in results.csvs("load_ratio.csv"):
        if not NEEDED <= set(df.columns):
            print(f"note: {path} lacks {sorted(NEEDED - set(df.columns))}; ignored")
            continue
        frames.append(df.assign(run=str(path.parent.relative_to(results.root)) or "."))
    if not frames:
        return pd.DataFrame()
    table = pd.concat(frames, ignore_index=True)
    for col in ("effective_load_ratio", "effective_load_ratio_min", "effective_load_ratio_max", "load_ratio_off"):
        if col not in table:
            table[col] = np.nan
    key = ["model", "memory", "load_ratio"]
    base = table[table.method == BASELINE].groupby(key).tpot_ms.median()  # one per cell, even if two sweeps hold it
    idx = pd.MultiIndex.from_frame(table[key])
    table["speedup_vs_offload_ar"] = base.reindex(idx).to_numpy() / table.tpot_ms.to_numpy()
    table["_m"] = table.model.map({m: i for i, m in enumerate(order_models(table.model))})
    table["_t"] = table.memory.map({t: i for i, t in enumerate(order_tiers(table.memory))})
    table["_k"] = table.method.map({m: i for i, m in enumerate(order_methods(table.method))})
    table = table.sort_values(["_m", "_t", "load_ratio", "_k"]).drop(columns=["_m", "_t", "_k"])
    lead = ["model", "memory", "load_ratio", "method", "effective_load_ratio", "effective_load_ratio_min",
            "effective_load_ratio_max", "load_ratio_off", "tpot_ms", "speedup_vs_offload_ar"]
    rest = [c for c in ("hardware", "point", "records", "layer_step_ms", "expert_load_ms", "acceptance_alpha",
                        "h2d_mb_per_token", "run") if c in table.columns]
    return table[lead + rest].reset_index(drop=True)


def operating_point(model: str) -> float | None:
    return OPERATING_POINTS.get(REAL_OF_TINY.get(model, model))


def named_points(table: pd.DataFrame, model: str) -> dict[float, str]:
    """The sweep's named ratios for one model (its `point` column: the device file the emulated link's
    default models, and the legacy estimate); a sweep without the column gets the legacy estimate."""
    if "point" in table:
        d = table[(table.model == model) & table.point.fillna("").astype(str).ne("")]
        if not d.empty:
            return dict(zip(d.load_ratio.astype(float), d.point.astype(str)))
    own = operating_point(model)
    return {} if own is None else {own: "legacy estimate"}


def _mark_operating_points(ax, points: dict[float, str]) -> None:
    """The model's calibrated device point solid, the legacy estimate dotted, each labelled at the top."""
    for r, name in sorted(points.items()):
        legacy = name == "legacy estimate"
        ax.axvline(r, color="#555555", lw=0.8 if legacy else 1.2, ls=":" if legacy else "-", alpha=0.8, zorder=1)
        ax.text(r, 1.0, f" {'legacy' if legacy else name.split('_')[0]} r={r:g}", transform=ax.get_xaxis_transform(),
                fontsize=6, color="#555555", va="top", ha="left", rotation=90)


def _plot(ax, d: pd.DataFrame, y: str, color: str, **kw) -> None:
    """A method's curve at the configured ratios, with a whisker to each point's effective ratio."""
    ax.plot(d["load_ratio"], d[y], color=color, ms=3.2, lw=1.3, zorder=3, **kw)
    eff = pd.to_numeric(d["effective_load_ratio"], errors="coerce")
    for r, e, v in zip(d["load_ratio"], eff, d[y]):
        if pd.notna(e) and pd.notna(v):
            ax.plot([r, e], [v, v], color=color, lw=0.7, alpha=0.5, zorder=2)
            ax.plot([e], [v], marker="x", ms=3, color=color, alpha=0.7, zorder=2, lw=0)


def build(results: ResultSet, out: Output) -> None:
    table = sweep_table(results)
    if table.empty:
        raise Skip("no load_ratio.csv (python run.py experiment=load_ratio_sweep ...)")
    flagged = int(pd.to_numeric(table.load_ratio_off, errors="coerce").fillna(0).sum())
    out.table(table.drop(columns="run"), NAME, TITLE, notes=[
        "load_ratio: the configured r of the cell; effective_load_ratio: mean over its records of the link's mean "
        "expert-load time / the layer step probed around each record (min/max across records); load_ratio_off: "
        f"records outside the run's tolerance ({flagged} in all). target_only uses no link: one run per model, "
        "repeated at every r.",
        "speedup_vs_offload_ar: offload_ar's TPOT over the method's at the same model, tier and r.",
    ])
    models = order_models(table.model)
    tiers = order_tiers(table.memory)
    methods = order_methods(table.method)
    colors = method_colors(methods)
    ratios = sorted(table.load_ratio.unique())
    named_ratios = {r for model in models for r in named_points(table, model)}
    fig, axes = subplots(len(tiers) + 1, len(models), w=3.4, h=2.5, sharex="col")
    tier_styles = {t: s for t, s in zip(tiers, ("-", "--", "-.", ":"))}
    for c, model in enumerate(models):
        for r_, tier in enumerate(tiers):
            ax = axes[r_][c]
            d = table[(table.model == model) & (table.memory == tier)]
            for method in methods:
                m = d[d.method == method].sort_values("load_ratio")
                if m.empty:
                    continue
                if method == REFERENCE:
                    ax.axhline(m.tpot_ms.median(), color=colors[method], lw=1.2, ls="--", zorder=2)
                    continue
                _plot(ax, m, "tpot_ms", colors[method], marker="o")
            _mark_operating_points(ax, named_points(table, model))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            style_axes(ax, f"{model}, {tier} memory", ylabel="TPOT (ms/token)" if c == 0 else None)
            if r_ == 0:
                ax.text(0.0, 1.13, model_label(model), transform=ax.transAxes, fontsize=8, color="#444444")
        ax = axes[-1][c]
        for tier in tiers:
            s = table[(table.model == model) & (table.memory == tier) & (table.method == OURS)].sort_values("load_ratio")
            if not s.empty:
                _plot(ax, s, "speedup_vs_offload_ar", colors.get(OURS, "#0072B2"), marker="s", ls=tier_styles[tier])
        ax.axhline(1.0, color="black", lw=0.6)
        _mark_operating_points(ax, named_points(table, model))
        ax.set_xscale("log", base=2)
        style_axes(ax, f"{model}: Specter's speedup\nover Offload-AR", xlabel="load ratio r (×: effective r)",
                   ylabel="speedup (×)" if c == 0 else None)
        # ticks at the swept grid only: a model's named ratios (3.616, 4.104 beside 4) sit a few pixels from a
        # grid ratio, so their tick labels would print over it; each named line says its own r at its top
        grid = [r for r in ratios if r not in named_ratios]
        ax.set_xticks(grid, [f"{r:g}" for r in grid], fontsize=7)
        ax.xaxis.set_minor_locator(NullLocator())
    handles = [Line2D([], [], color=colors[m], marker=None if m == REFERENCE else "o",
                      ls="--" if m == REFERENCE else "-", lw=1.3) for m in methods]
    labels = [legend_label(m) for m in methods]
    # the figure's legend holds the methods only; the line styles of the tiers and the marks say what they are
    # in the caption (eleven entries in one legend read as a table, not a key)
    legend_above(fig, handles, labels)
    fig.tight_layout()
    legacy = ", ".join(f"{r:g} {MODEL_LABELS.get(m, m)}" for m, r in OPERATING_POINTS.items())
    hardware = ", ".join(sorted(table["hardware"].dropna().astype(str).unique())) if "hardware" in table else ""
    caption(fig, f"Measured ({hardware or 'hardware not recorded'}) at each configured load ratio r. Vertical "
                 "lines: solid, the r of the model's device file (its label names the device and r); dotted, the "
                 f"earlier hand estimate ({legacy}). A thin whisker ending in × runs to the effective r the cell's "
                 "records ran under (their mean). Speedup row: " + ", ".join(
                     f"{STYLE_WORDS.get(tier_styles[t], tier_styles[t])} {t} memory" for t in tiers) + ".")
    out.figure(fig, NAME)
