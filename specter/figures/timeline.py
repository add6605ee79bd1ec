"""Figs. 8/9 style: the planner's timeline of one speculative window (draft, H2D copies, verification).

Input: `trace.csv.gz` (or a plain `trace.csv`) in run folders, one row per event: window, event,
layer, expert, start_ms, end_ms, bytes, phase. Events: draft (or draft_step), boundary, copy, compute, wait (verification
waiting for a copy); moe/verify spans are containers and not drawn. A copy's phase, when it is a
label (cold_start, overlap, cleanup, ...), colours it; otherwise (empty: the engine's own traces) copies are
split into "while drafting" (started before the window's last draft step ended) and "during
verification". Columns dataset/prompt_index/repeat, when present, tell records apart.

Figure  per trace (one row each, at most MAX_TRACES): the representative window — among windows
        with copies, the one with the median copied bytes — as three lanes: draft steps, copies
        coloured by phase, target compute; chunk boundaries b_i as dashed lines
Table   per trace, means over windows: window length, draft / copy / compute time, bytes copied,
        copies per phase, and the overlap fraction = copy time that runs while the draft runs,
        over all copy time
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.patches import Patch

from specter.figures.common import Output, Skip, legend_above, model_label, style_axes, subplots
from specter.figures.data import ResultSet

NAME = "fig09_planner_timeline"
COLUMNS = {"window", "event", "start_ms", "end_ms"}
RECORD = ["dataset", "prompt_index", "repeat"]
DRAFT = ("draft", "draft_step")
MAX_TRACES = 6
PHASE_COLORS = ("#E69F00", "#009E73", "#CC79A7", "#F0E442", "#56B4E9", "#7F7F7F")


def load_traces(results: ResultSet) -> list[tuple[dict, pd.DataFrame]]:
    traces = []
    for path, df in results.csvs("trace.csv"):
        if not COLUMNS <= set(df.columns):
            print(f"note: {path} lacks {sorted(COLUMNS - set(df.columns))}; ignored")
            continue
        for col, default in (("bytes", 0), ("phase", ""), ("layer", -1), ("expert", -1)):
            if col not in df.columns:
                df[col] = default
        df["phase"] = df["phase"].fillna("").astype(str)
        keys = [c for c in RECORD if c in df.columns] + ["window"]
        df["_w"] = df[keys].astype(str).agg("/".join, axis=1)
        df["event"] = df["event"].replace({"draft_step": "draft"})
        df["copy_kind"] = copy_kinds(df)
        traces.append((results.run_info(path.parent), df))
    return traces


def copy_kinds(df: pd.DataFrame) -> pd.Series:
    """The copy's planner phase when the trace labels it, else when it started relative to drafting."""
    copies = df["event"] == "copy"
    labels = df.loc[copies, "phase"]
    if len(labels) and not labels.str.contains(r"\d").any():
        return df["phase"].where(copies, "")
    draft_end = df[df["event"] == "draft"].groupby("_w")["end_ms"].max()
    ends = df["_w"].map(draft_end)
    kind = pd.Series("during verification", index=df.index)
    kind[df["start_ms"] < ends] = "while drafting"
    return kind.where(copies, "")


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two interval sets (b need not be disjoint)."""
    merged: list[list[float]] = []
    for s, e in sorted(b):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return sum(max(0.0, min(e, me) - max(s, ms)) for s, e in a for ms, me in merged)


def window_stats(df: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for w, g in df.groupby("_w", sort=False):
        dur = g["end_ms"] - g["start_ms"]
        copies = g[g["event"] == "copy"]
        drafts = g[g["event"] == "draft"]
        copy_ms = float(dur[g["event"] == "copy"].sum())
        overlap = _overlap(list(zip(copies["start_ms"], copies["end_ms"])), list(zip(drafts["start_ms"], drafts["end_ms"])))
        row = {"window": w, "window_ms": float(g["end_ms"].max() - g["start_ms"].min()),
               "draft_ms": float(dur[g["event"] == "draft"].sum()), "copy_ms": copy_ms,
               "compute_ms": float(dur[g["event"] == "compute"].sum()),
               "wait_ms": float(dur[g["event"] == "wait"].sum()),
               "bytes": float(pd.to_numeric(copies["bytes"], errors="coerce").fillna(0).sum()),
               "copies": len(copies), "boundaries": int((g["event"] == "boundary").sum()),
               "overlap_fraction": overlap / copy_ms if copy_ms > 0 else np.nan}
        for kind, n in copies["copy_kind"].value_counts().items():
            row[f"copies_{(kind or 'unlabelled').replace(' ', '_')}"] = int(n)
        rows.append(row)
    return pd.DataFrame(rows)


def representative(stats: pd.DataFrame) -> str:
    with_copies = stats[stats["copies"] > 0]
    pool = (with_copies if not with_copies.empty else stats).sort_values(["bytes", "window"], kind="stable")
    return pool.iloc[(len(pool) - 1) // 2]["window"]


def build(results: ResultSet, out: Output) -> None:
    traces = load_traces(results)
    if not traces:
        raise Skip("no trace.csv or trace.csv.gz (window,event,layer,expert,start_ms,end_ms,bytes,phase) in any run folder")
    rows, shown = [], []
    for info, df in traces:
        stats = window_stats(df)
        phase_cols = sorted(c for c in stats.columns if c.startswith("copies_"))
        stats[phase_cols] = stats[phase_cols].fillna(0)
        rep = representative(stats)
        mean = stats.drop(columns=["window"]).mean(numeric_only=True)
        rows.append({"run": info["run"], "model": info["model"], "memory": info["memory"], "method": info["method"],
                     "windows": len(stats), "shown_window": rep, **mean.to_dict()})
        shown.append((info, df[df["_w"] == rep]))
    out.table(pd.DataFrame(rows), NAME, "Figs. 8/9: planner timeline per window (means over windows)",
              notes=["Times in ms, bytes per window; overlap_fraction = copy time concurrent with drafting / copy time; "
                     "copies_<phase>: copies per window in that planner phase."])
    shown = shown[:MAX_TRACES]
    phases = sorted({p for _, w in shown for p in w.loc[w["event"] == "copy", "copy_kind"]})
    pcolor = {p: PHASE_COLORS[i % len(PHASE_COLORS)] for i, p in enumerate(phases)}
    fig, axes = subplots(len(shown), 1, w=8.5, h=2.0)
    lanes = {"draft": 2, "copy": 1, "compute": 0, "wait": 0}
    boundary_labels: dict = {}  # panel -> its chunk boundaries, labelled once the layout is final
    for ax, (info, w) in zip(axes[:, 0], shown):
        t0 = w["start_ms"].min()
        for event, y in lanes.items():
            ev = w[w["event"] == event]
            for i, r in enumerate(ev.itertuples(index=False)):
                color = {"draft": "#0072B2" if i % 2 == 0 else "#56B4E9", "compute": "#555555",
                         "wait": "#D55E00", "copy": pcolor.get(r.copy_kind, "#7F7F7F")}[event]
                ax.broken_barh([(r.start_ms - t0, max(r.end_ms - r.start_ms, 1e-3))], (y - 0.35, 0.7),
                               facecolors=color, edgecolors="white", linewidth=0.3)
        bounds = [b - t0 for b in w.loc[w["event"] == "boundary", "start_ms"].sort_values()]
        for b in bounds:
            ax.axvline(b, color="black", ls="--", lw=0.7)
        boundary_labels[ax] = bounds
        ax.set_yticks([2, 1, 0], ["draft (q)", "H2D copies", "verify (p)"])
        ax.set_ylim(-0.6, 2.9)
        label = f"{model_label(str(info['model']))}, {info['memory']} memory, {info['method']} — window {w['_w'].iloc[0]}"
        style_axes(ax, label, xlabel="time in window (ms)")
        ax.grid(axis="x", alpha=0.3, linewidth=0.6)
    handles = [Patch(color="#0072B2"), Patch(color="#555555"), Patch(color="#D55E00")]
    handles += [Patch(color=pcolor[p]) for p in phases]
    legend_above(fig, handles, ["draft step", "target compute", "waiting for a copy"]
                 + [f"copy: {p or 'unlabelled'}" for p in phases])
    fig.tight_layout()
    for ax, bounds in boundary_labels.items():
        _label_boundaries(ax, bounds)
    out.figure(fig, NAME)


def _label_boundaries(ax, bounds: list[float]) -> None:
    """b1, b2, ... above the chunk boundaries; boundaries closer than their labels are wide share one label
    ("b1–b3") rather than printing over each other. Needs the final layout (it compares pixels)."""
    renderer = ax.figure.canvas.get_renderer()
    last, first = None, 0
    for i, b in enumerate(bounds, start=1):
        if last is not None:
            box = ax.text(b, 2.55, f" b{i}", ha="left", va="bottom", fontsize=7)
            overlaps = box.get_window_extent(renderer).x0 <= last.get_window_extent(renderer).x1 + 1
            box.remove()
            if overlaps:
                last.set_text(f" b{first}–b{i}")
                continue
        last, first = ax.text(b, 2.55, f" b{i}", ha="left", va="bottom", fontsize=7), i
