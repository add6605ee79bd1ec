"""Projected Fig. 14: each method's TPOT on the paper's machine, from the engine's own schedule on the virtual
clock (`experiment=project`), beside the paper's published TPOTs; and one projected window per model.

Input: `projection.csv` and `timeline.csv` as `python run.py experiment=project` writes them
(`results/project/<model>-<memory>-<device>/`, also searched when the result set has none;
`python -m specter.projection.grid` writes all three models x both tiers). Only the engine rows
(`source=engine`) are drawn; the replay rows are a cross-check of offload_ar.

fig14_projected_tpot       per real model, projected TPOT per tier and method (bars), the paper's TPOT
                           of the same cell as a black marker
table_projected_vs_paper   every cell: projected ms, paper ms where published, projected / paper
fig_projected_window       per model, one Specter window on the two streams: compute (draft experts,
                           target experts, the rest) and copy (H2D expert loads)

A projection is a model of the paper's machine driven by the real engine's schedule, not a measurement.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.patches import Patch

from specter.figures.common import (Output, Skip, legend_above, method_colors, method_label, model_label,
                                    order_methods, order_models, order_tiers, style_axes, subplots)
from specter.figures.data import ResultSet

NAME = "fig14_projected_tpot"
KINDS = {"draft": "#56B4E9", "expert": "#E69F00", "h2d": "#009E73", "other": "#B0B0B0"}
KIND_LABELS = ("draft steps (INT4 experts + FP16 rest)", "target experts (verification)", "H2D expert copy",
               "verification: attention, router, lm_head")


def _found(results: ResultSet, name: str) -> list[tuple[Path, pd.DataFrame]]:
    found = results.csvs(name)
    if not found:  # experiment=project's default output folder
        fallback = ResultSet(Path(__file__).resolve().parents[2] / "results" / "project")
        found = fallback.csvs(name) if fallback.root.is_dir() else []
    return found


def projections(results: ResultSet) -> pd.DataFrame:
    frames = [df for _, df in _found(results, "projection.csv") if {"source", "tpot_ms", "method"} <= set(df.columns)]
    if not frames:
        raise Skip("no projection.csv (run: python -m specter.projection.grid, or python run.py experiment=project)")
    df = pd.concat(frames, ignore_index=True)
    df = df[df["source"] == "engine"].dropna(subset=["tpot_ms"])
    return df.drop_duplicates(["model", "memory", "device", "method"], keep="last")


def build(results: ResultSet, out: Output) -> None:
    df = projections(results)
    for device, g in df.groupby("device", sort=True):
        suffix = "" if device == "a100_40gb_pcie4" else f"_{device}"
        _tpot_figure(g, out, suffix, device)
    _windows(results, out)


def _tpot_figure(df: pd.DataFrame, out: Output, suffix: str, device: str) -> None:
    models = order_models(df["model"].unique())
    methods = order_methods(df["method"].unique())
    colors = method_colors(methods)
    fig, axes = subplots(1, len(models), w=4.2, h=3.0)
    width = 0.8 / max(1, len(methods))
    for ax, model in zip(axes[0], models):
        g = df[df["model"] == model]
        tiers = order_tiers(g["memory"].unique())
        for i, method in enumerate(methods):
            for t, tier in enumerate(tiers):
                cell = g[(g["memory"] == tier) & (g["method"] == method)]
                if cell.empty:
                    continue
                x = t + (i - (len(methods) - 1) / 2) * width
                ax.bar(x, float(cell["tpot_ms"].iloc[0]), width, color=colors[method])
                paper = cell["paper_tpot_ms"].iloc[0] if "paper_tpot_ms" in cell else None
                if paper is not None and not pd.isna(paper):
                    ax.plot(x, float(paper), marker="D", color="black", markersize=4, zorder=3)
        ax.set_xticks(range(len(tiers)), [f"{t} memory" for t in tiers])
        style_axes(ax, model_label(model), ylabel="projected TPOT (ms)")
    handles = [Patch(color=colors[m]) for m in methods]
    labels = [method_label(m) for m in methods]
    from matplotlib.lines import Line2D

    handles.append(Line2D([], [], marker="D", color="black", linestyle="none", markersize=4))
    labels.append("paper (Fig. 14)")
    legend_above(fig, handles, labels)
    out.figure(fig, NAME + suffix)
    table = df[["model", "memory", "method", "tpot_ms", "paper_tpot_ms", "ratio", "loads_per_token", "copy_busy",
                "acceptance", "proxy"]].copy()
    table["model"] = pd.Categorical(table["model"], models, ordered=True)
    table["method"] = pd.Categorical(table["method"], methods, ordered=True)
    table = table.sort_values(["model", "memory", "method"]).reset_index(drop=True)
    out.table(table, "table_projected_vs_paper" + suffix, f"Projected TPOT on {device} beside the paper's",
              notes=["A model of the paper's machine (cost model + virtual clock) driven by the engine's own schedule "
                     "on the tiny proxy, not a measurement. ratio = projected / paper."])


def _kinds(ops: pd.DataFrame) -> list[str]:
    """Each op's colour: copies; compute up to the window's last draft-expert op is the draft; after it,
    the target's experts and the rest of verification."""
    draft = ops[ops["op"].str.contains("draft experts")]
    draft_end = float(draft["end_ms"].max()) if len(draft) else float("-inf")
    out = []
    for stream, op, end in zip(ops["stream"], ops["op"], ops["end_ms"]):
        out.append("h2d" if stream == "copy" else "draft" if end <= draft_end + 1e-9 else
                   "expert" if " expert " in op else "other")
    return out


def _windows(results: ResultSet, out: Output) -> None:
    frames = [df for _, df in _found(results, "timeline.csv") if not df.empty and {"stream", "start_ms"} <= set(df.columns)]
    if not frames:
        return
    df = pd.concat(frames, ignore_index=True)
    df = df[df["device"] == "a100_40gb_pcie4"] if (df["device"] == "a100_40gb_pcie4").any() else df
    cases = df[["model", "memory"]].drop_duplicates()
    cases = cases[cases["memory"] == "high"] if (cases["memory"] == "high").any() else cases
    models = order_models(cases["model"].unique())
    fig, axes = subplots(len(models), 1, w=8.0, h=1.9)
    fig.subplots_adjust(hspace=0.9)
    for ax, model in zip(axes[:, 0], models):
        tier = cases[cases["model"] == model]["memory"].iloc[0]
        g = df[(df["model"] == model) & (df["memory"] == tier)]
        g = g.assign(kind=_kinds(g))
        for lane, stream in enumerate(("copy", "compute")):
            s = g[g["stream"] == stream]
            for kind, color in KINDS.items():
                part = s[s["kind"] == kind]
                if len(part):
                    ax.broken_barh(list(zip(part["start_ms"], part["end_ms"] - part["start_ms"])), (lane - 0.4, 0.8),
                                   color=color)
        ax.set_yticks([0, 1], ["copy", "compute"])
        style_axes(ax, f"{model_label(model)}, {tier} memory: one Specter window (projected)", xlabel="ms")
    legend_above(fig, [Patch(color=c) for c in KINDS.values()], list(KIND_LABELS), ncol=2)
    out.figure(fig, "fig_projected_window")
