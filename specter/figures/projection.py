"""Projected Fig. 14: each method's TPOT on the paper's machine, from the engine's own schedule on the virtual
clock (`experiment=project`), beside the paper's published TPOTs; and one projected window per model.

Input: `projection.csv` and `timeline.csv` as `python run.py experiment=project` writes them
(`results/project/<model>-<memory>-<device>/`, also searched when the result set has none;
`python -m specter.experiments.projection_grid` writes all three models x both tiers). Only the engine rows
(`source=engine`) are drawn; the replay rows are a cross-check of offload_ar.

fig14_projected_tpot       per real model, projected TPOT per tier and method (bars), the paper's TPOT
                           of the same cell as a black marker; a method whose K was profiled on the
                           modelled device has a second bar at its default K ("paper K")
table_projected_vs_paper   every cell: projected ms, paper ms where published, projected / paper, K and
                           where it came from, loads per token (and the engine's load-efficiency columns
                           when its records carry them)
fig_projected_window       per model, one Specter window on the two streams: compute (draft experts,
                           target experts, the rest) and copy (H2D expert loads)

One figure and one table per device file (suffix _<device> beside the A100's): hardware is never mixed in
one panel. Every title names the device and the draft, and every caption says the figure is a model: a projection
is a model of the paper's machine driven by the real engine's schedule, not a measurement. Lossy methods are
hatched and marked in the legend; a bar past CLIP_OVER x its panel's median is clipped and labelled.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.patches import Patch

from specter.figures.common import (Output, Skip, caption, legend_above, method_colors, model_label, order_methods,
                                    order_models, order_tiers, style_axes, subplots, wrap)
from specter.figures.labels import is_lossy, legend_label
from specter.figures.data import ResultSet

NAME = "fig14_projected_tpot"
KINDS = {"draft": "#56B4E9", "expert": "#E69F00", "h2d": "#009E73", "other": "#B0B0B0"}
KIND_LABELS = ("draft steps (INT4 experts + FP16 rest)", "target experts (verification)", "H2D expert copy",
               "verification: attention, router, lm_head")


DEFAULT_DEVICE = "a100_40gb_pcie4"  # the paper's machine: its figures carry no suffix
DEVICE_LABELS = {"a100_40gb_pcie4": "A100 40 GB, PCIe 4.0 x16", "h200_pcie5": "H200, PCIe 5.0 x16"}
# the engine rows' load efficiency; specter_belady_loads_per_token: Specter's Belady bound beside each row's loads/token
LOAD_COLUMNS = ("loads_per_window_layer", "retention_hits", "loads_over_belady", "belady_loads_per_token",
                "specter_belady_loads_per_token")


def device_label(device: str) -> str:
    return DEVICE_LABELS.get(str(device), str(device))


def suffix(device: str) -> str:
    return "" if device == DEFAULT_DEVICE else f"_{device}"


def draft_of(df: pd.DataFrame) -> str:
    """The draft the speculative rows ran, as the CSV names it ("not recorded" for a CSV from before the column)."""
    names = sorted({str(d) for d in df.get("draft", pd.Series(dtype=str)).dropna() if str(d)})
    return ", ".join(names) if names else "draft not recorded"


def _found(results: ResultSet, name: str) -> list[tuple[Path, pd.DataFrame]]:
    found = results.csvs(name)
    if not found:  # experiment=project's default output folder
        fallback = ResultSet(Path(__file__).resolve().parents[2] / "results" / "project")
        found = fallback.csvs(name) if fallback.root.is_dir() else []
    return found


def projections(results: ResultSet) -> pd.DataFrame:
    frames = [df for _, df in _found(results, "projection.csv") if {"source", "tpot_ms", "method"} <= set(df.columns)]
    if not frames:
        raise Skip("no projection.csv (run: python -m specter.experiments.projection_grid, or python run.py experiment=project)")
    df = pd.concat(frames, ignore_index=True)
    for col in ("k_source", "K", "draft", *LOAD_COLUMNS):
        if col not in df.columns:
            df[col] = ""
    df["k_source"] = df["k_source"].fillna("").astype(str)
    df = df[df["source"] == "engine"].dropna(subset=["tpot_ms"])
    df = df.drop_duplicates(["model", "memory", "device", "method", "k_source"], keep="last")
    return df.assign(series=_series(df))


def _series(df: pd.DataFrame) -> list[str]:
    """The bar a row is drawn as: the method, or "<method>[paper K]" for the default-K row of a method that also
    has a profiled row (the profiled one is the method's own bar)."""
    profiled = set(zip(df["model"], df["memory"], df["device"], df["method"], df["k_source"]))
    return [f"{m}[paper K]" if k == "paper" and (mo, me, d, m, "profiled") in profiled else m
            for mo, me, d, m, k in zip(df["model"], df["memory"], df["device"], df["method"], df["k_source"])]


def build(results: ResultSet, out: Output) -> None:
    df = projections(results)
    for device, g in df.groupby("device", sort=True):
        _tpot_figure(g, out, suffix(device), device)
    _windows(results, out)


# A bar taller than CLIP_OVER x its panel's median bar is cut at the panel's top and labelled with its value. A
# lossy method's projection can be several times every other (MoE-Spec's ~950 ms on Phi-3.5-MoE); drawn whole
# it flattens the other bars into a few pixels. A log axis would do the same job but makes bar lengths meaningless
# (a bar's length is no longer its TPOT), and a broken axis doubles every panel; a clipped bar keeps the linear
# scale the other bars are compared on and still says the clipped value in numbers.
CLIP_OVER = 3.0
MODEL_NOTE = ("A model, not a measurement: TPOT projected onto {device} (cost model + virtual clock driven by the "
              "engine's own schedule on the tiny proxy), drafts as each panel names them.")


def _bar_label(series: str) -> str:
    """A bar's legend label: the method in words, lossy ones marked ("MoE-Spec (lossy)"), a default-K bar so named."""
    method, at_paper_k = (series[: -len("[paper K]")], True) if series.endswith("[paper K]") else (series, False)
    return legend_label(method) + (" at the paper's K" if at_paper_k else "")


def _clip_at(values: list[float], papers: list[float]) -> float | None:
    """The panel's top when some bar is an outlier (over CLIP_OVER x the median bar), else None (no clipping);
    every paper marker stays inside it."""
    if not values:
        return None
    median = float(pd.Series(values).median())
    top = max(CLIP_OVER * median, 1.1 * max(papers, default=0.0))
    return top if max(values) > top else None


def _tpot_figure(df: pd.DataFrame, out: Output, suffix: str, device: str) -> None:
    models = order_models(df["model"].unique())
    methods = order_methods(df["series"].unique())
    colors = method_colors(methods)
    hatches = {m: "///" if is_lossy(m) else None for m in methods}  # lossy bars read as such without the legend
    fig, axes = subplots(1, len(models), w=4.2, h=3.0)
    width = 0.8 / max(1, len(methods))
    panel_in = fig.get_figwidth() / len(models) - 0.5
    clipped = []
    for ax, model in zip(axes[0], models):
        g = df[df["model"] == model]
        tiers = order_tiers(g["memory"].unique())
        papers = [float(p) for p in pd.to_numeric(g.get("paper_tpot_ms"), errors="coerce").dropna()] \
            if "paper_tpot_ms" in g else []
        top = _clip_at([float(v) for v in g["tpot_ms"]], papers)
        for i, method in enumerate(methods):
            for t, tier in enumerate(tiers):
                cell = g[(g["memory"] == tier) & (g["series"] == method)]
                if cell.empty:
                    continue
                x = t + (i - (len(methods) - 1) / 2) * width
                tpot = float(cell["tpot_ms"].iloc[0])
                ax.bar(x, tpot if top is None else min(tpot, top), width, color=colors[method],
                       hatch=hatches[method], edgecolor="white", linewidth=0)
                if top is not None and tpot > top:
                    clipped.append(method)
                    ax.text(x, top * 0.98, f"{tpot:.0f} ms ✂", rotation=90, ha="center", va="top", fontsize=6,
                            color="black", bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none"})
                paper = cell["paper_tpot_ms"].iloc[0] if "paper_tpot_ms" in cell else None
                if paper is not None and not pd.isna(paper):
                    ax.plot(x, float(paper), marker="D", color="black", markersize=4, zorder=3)
        if top is not None:
            ax.set_ylim(0, top)
        ax.set_xticks(range(len(tiers)), [f"{t} memory" for t in tiers])
        # the device and the draft in every panel (the draft's acceptance may differ per model), wrapped to it
        style_axes(ax, wrap(f"{model_label(model)}\n{device_label(device)}\n{draft_of(g)} draft", panel_in, 9),
                   ylabel="projected TPOT (ms)")
        ax.title.set_fontsize(9)
    handles = [Patch(facecolor=colors[m], hatch=hatches[m], edgecolor="white", linewidth=0) for m in methods]
    labels = [_bar_label(m) for m in methods]
    from matplotlib.lines import Line2D

    handles.append(Line2D([], [], marker="D", color="black", linestyle="none", markersize=4))
    labels.append("paper (Fig. 14, measured on the A100)")
    fig.tight_layout()  # the titles inside the figure, the legend above them
    legend_above(fig, handles, labels, ncol=4)
    note = MODEL_NOTE.format(device=device_label(device)) + " Hatched: lossy methods (their output may differ from " \
        "the target's)."
    if clipped:
        note += (f" A bar over {CLIP_OVER:g}x its panel's median is cut at the panel's top (✂) and labelled with its "
                 "projected TPOT.")
    caption(fig, note)
    out.figure(fig, NAME + suffix)
    loads = [c for c in LOAD_COLUMNS if pd.to_numeric(df[c], errors="coerce").notna().any()]  # once the engine has them
    table = df[["model", "memory", "device", "method", "draft", "K", "k_source", "tpot_ms", "paper_tpot_ms", "ratio",
                "loads_per_token", *loads, "copy_busy", "acceptance", "proxy", "series"]].copy()
    table["model"] = pd.Categorical(table["model"], models, ordered=True)
    table["series"] = pd.Categorical(table["series"], methods, ordered=True)
    table = table.sort_values(["model", "memory", "series"]).drop(columns="series").reset_index(drop=True)
    out.table(table, "table_projected_vs_paper" + suffix,
              f"Projected TPOT on {device_label(device)} ({device}), {draft_of(df)} draft, beside the paper's",
              notes=["A model of that machine (cost model + virtual clock) driven by the engine's own schedule "
                     "on the tiny proxy, not a measurement. ratio = projected / paper (the paper's A100). "
                     "k_source: profiled = the fastest K of a profile on this device; paper = the method's default K."])


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
    df = df[df["device"] == DEFAULT_DEVICE] if (df["device"] == DEFAULT_DEVICE).any() else df
    device = str(df["device"].iloc[0])
    cases = df[["model", "memory"]].drop_duplicates()
    cases = cases[cases["memory"] == "high"] if (cases["memory"] == "high").any() else cases
    models = order_models(cases["model"].unique())
    fig, axes = subplots(len(models), 1, w=8.0, h=2.1)
    fig.subplots_adjust(hspace=1.1)
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
        K = f", K = {g['K'].iloc[0]}" if "K" in g.columns else ""
        # each panel's own draft: the models' drafts differ (a proxy's acceptance comes from its own calibration)
        style_axes(ax, f"{model_label(model)}, {tier} memory: one Specter window{K} (projected)\n"
                       f"{device_label(device)}; {draft_of(g)} draft", xlabel="ms")
    legend_above(fig, [Patch(color=c) for c in KINDS.values()], list(KIND_LABELS), ncol=2)
    caption(fig, MODEL_NOTE.format(device=device_label(device)).replace("TPOT projected", "Windows projected"))
    out.figure(fig, "fig_projected_window")
