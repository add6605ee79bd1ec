"""Figs. 10/11: draft MoE kernel backends (latency against tokens; speedup of each backend).

Input: `draft_kernel*.csv` from scripts/bench_draft_kernel.py, in either layout:
  wide  one row per case (device, dtype, H, I, E, k, T) and one `<backend>_ms` column per backend
  long  columns backend and ms (or median_ms) per case
Every backend and shape in the CSV is drawn; none is named here.

Fig. 10  median latency (ms) against the tokens per call T, one line per backend, one panel per
         case (device, dtype, H×I, E experts, top-k)
Fig. 11  speedup of each fused backend b over per-expert calls of that same kernel
         (`<b>_per_expert`: one call per active expert on its tokens, i.e. unfused INT4 calls),
         speedup = <b>_per_expert_ms / <b>_ms, geometric mean over the E/top-k cases of each H×I.
         A CSV without per-expert columns (written before they existed) falls back to one shared
         baseline, `unfused` (dequantize each active expert + HF's eager loop), else `reference`,
         else the slowest backend; the figure's title and table say which it is. The caption
         adds, per H×I, how the fused INT4 path (`torch`) compares with the FP loop in the same
         dtype (`fp_loop`: no quantization), since a faster INT4 kernel can still lose to FP.
Both captions name the device, dtype and threads: every ratio is one dtype on both sides (the
benchmark checks each backend's output dtype), and CPU times say nothing of a GPU kernel's speed.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from specter.figures.common import PALETTE, Output, Skip, grouped_bars, legend_above, style_axes, subplots
from specter.figures.data import ResultSet

NAME10 = "fig10_draft_kernel_latency"
NAME11 = "fig11_draft_kernel_speedup"
CASE = ["device", "dtype", "H", "I", "E", "k"]
BASELINES = ("unfused", "reference")  # the shared baseline of a CSV without per-expert columns
PER_EXPERT = "_per_expert"


def long_table(results: ResultSet) -> pd.DataFrame:
    frames = []
    for path, df in results.csvs("draft_kernel*.csv"):
        if {"backend"} <= set(df.columns) and ({"ms"} & set(df.columns) or {"median_ms"} & set(df.columns)):
            d = df.rename(columns={"median_ms": "ms"})
        else:
            backends = [c for c in df.columns if c.endswith("_ms")]
            if not backends or "T" not in df.columns:
                print(f"note: {path} has no <backend>_ms or backend/ms columns; ignored")
                continue
            keep = [c for c in df.columns if c in CASE + ["T"]]
            d = df.melt(id_vars=keep, value_vars=backends, var_name="backend", value_name="ms")
            d["backend"] = d["backend"].str[: -len("_ms")]
        for col in CASE:
            if col not in d.columns:
                d[col] = "" if col in ("device", "dtype") else 0
        frames.append(d[CASE + ["T", "backend", "ms"]])
    if not frames:
        return pd.DataFrame()
    table = pd.concat(frames, ignore_index=True)
    table["ms"] = pd.to_numeric(table["ms"], errors="coerce")
    table = table.dropna(subset=["ms"])
    table = table.groupby(CASE + ["T", "backend"], as_index=False)["ms"].median()
    return table.sort_values(CASE + ["T", "backend"]).reset_index(drop=True)


def pairs(backends) -> dict[str, str]:
    """fused backend -> the backend that calls the same kernel once per expert (present in the data)."""
    backends = set(backends)
    return {b[: -len(PER_EXPERT)]: b for b in sorted(backends)
            if b.endswith(PER_EXPERT) and b[: -len(PER_EXPERT)] in backends}


def speedup_table(table: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Per (case, T, backend): baseline_ms / backend_ms, with the baseline named in column `baseline`.

    Returns the table and a description of the baseline(s) for titles."""
    backends = sorted(table["backend"].unique())
    wide = table.pivot_table(index=CASE + ["T"], columns="backend", values="ms")
    paired = pairs(backends)
    if paired:
        ratios = pd.DataFrame({b: wide[base] / wide[b] for b, base in paired.items()})
        baseline_of = paired
        described = "per-expert calls of the same kernel"
    else:
        baseline = next((b for b in BASELINES if b in backends), None)
        if baseline is None:
            baseline = table.groupby("backend")["ms"].median().idxmax()
        ratios = wide.rdiv(wide[baseline], axis=0).drop(columns=baseline)  # baseline_ms / backend_ms
        baseline_of = {b: baseline for b in ratios.columns}
        described = f"the `{baseline}` backend"
    long = ratios.reset_index().melt(id_vars=CASE + ["T"], var_name="backend", value_name="speedup").dropna()
    long["baseline"] = long["backend"].map(baseline_of)
    group = ["device", "dtype", "H", "I", "T", "backend", "baseline"]
    agg = long.groupby(group, as_index=False)["speedup"].agg(
        speedup_geomean=lambda s: float(np.exp(np.log(s).mean())), speedup_min="min", speedup_max="max", cases="size")
    return agg.sort_values(group).reset_index(drop=True), described


def fp_versus_int4(table: pd.DataFrame, fused: str = "torch", fp: str = "fp_loop") -> list[str]:
    """Per (device, dtype, H×I): geometric mean over E/top-k/T of fp_ms / fused_ms (> 1: INT4 faster)."""
    wide = table.pivot_table(index=CASE + ["T"], columns="backend", values="ms")
    if fused not in wide or fp not in wide:
        return []
    ratio = (wide[fp] / wide[fused]).dropna().reset_index(name="r")
    lines = []
    for (dev, dt, h, i), g in ratio.groupby(["device", "dtype", "H", "I"]):
        geo = float(np.exp(np.log(g["r"]).mean()))
        lines.append(f"{dev} {dt} {h}×{i}: FP loop / fused INT4 ({fused}) = {geo:.2f}× "
                     f"(range {g['r'].min():.2f}–{g['r'].max():.2f}; > 1: INT4 faster)")
    return lines


def device_note(table: pd.DataFrame) -> str:
    kinds = sorted({f"{d} {t}" for d, t in table[["device", "dtype"]].itertuples(index=False)})
    cpu = " CPU times: what the fusion saves in host work, not a GPU kernel's speed." \
        if (table["device"] == "cpu").any() else ""
    return f"every backend in one dtype per panel ({', '.join(kinds)}).{cpu}"


def build(results: ResultSet, out: Output) -> None:
    table = long_table(results)
    if table.empty:
        raise Skip("no draft_kernel.csv (python -m scripts.bench_draft_kernel)")
    backends = sorted(table["backend"].unique())
    colors = {b: PALETTE[i % len(PALETTE)] for i, b in enumerate(backends)}
    out.table(table, NAME10, "Fig. 10: draft MoE latency per backend (median ms per call)",
              notes=["H×I: expert hidden × intermediate size; E experts, top-k routing, T tokens per call."])
    cases = table[CASE].drop_duplicates().sort_values(CASE).itertuples(index=False)
    cases = list(cases)
    rows = sorted({(c.device, c.dtype, c.H, c.I) for c in cases})
    cols = sorted({(c.E, c.k) for c in cases})
    fig, axes = subplots(len(rows), len(cols), w=2.6, h=2.2, sharey="row")
    for r, (dev, dt, h, i) in enumerate(rows):
        for c, (e, k) in enumerate(cols):
            ax = axes[r][c]
            d = table[(table.device == dev) & (table.dtype == dt) & (table.H == h) & (table.I == i)
                      & (table.E == e) & (table.k == k)]
            if d.empty:
                ax.set_axis_off()
                continue
            for b, g in d.groupby("backend"):
                ax.plot(g["T"], g["ms"], marker="o", ms=3, lw=1.2, color=colors[b])
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ts = sorted(d["T"].unique())
            ax.set_xticks(ts, [str(int(t)) for t in ts])
            ax.minorticks_off()
            style_axes(ax, f"{h}×{i}, E={e}, top-{k}", xlabel="tokens per call T",
                       ylabel=f"{dev} {dt}\nlatency (ms)".strip() if c == 0 else None)
            ax.title.set_fontsize(8)
    legend_above(fig, [Line2D([], [], color=colors[b], marker="o") for b in backends], backends)
    fig.tight_layout()
    fig.text(0.5, 0.0, textwrap.fill(device_note(table), int(fig.get_figwidth() * 15)), ha="center", va="top",
             fontsize=8, style="italic")
    out.figure(fig, NAME10)

    speed, baseline = speedup_table(table)
    if speed.empty:
        print(f"{NAME11}: skipped: no backend to compare with {baseline}")
        return
    others = sorted(speed["backend"].unique())
    out.table(speed, NAME11, f"Fig. 11: speedup over {baseline} (geometric mean over E/top-k cases)",
              notes=["speedup = baseline_ms / backend_ms (column `baseline` names it); > 1: the fused call is faster. "
                     "A `<b>_per_expert` baseline calls kernel b once per active expert on that expert's tokens.",
                     device_note(table), *fp_versus_int4(table)])
    panels = sorted({(d, t, h, i) for d, t, h, i in speed[["device", "dtype", "H", "I"]].itertuples(index=False)})
    fig, axes = subplots(1, len(panels), w=3.4, h=2.6)
    for ax, (dev, dt, h, i) in zip(axes[0], panels):
        d = speed[(speed.device == dev) & (speed.dtype == dt) & (speed.H == h) & (speed.I == i)]
        ts = sorted(d["T"].unique())
        grouped_bars(ax, ts, others, d, by="backend", index="T", value="speedup_geomean", colors=colors)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks(range(len(ts)), [str(int(t)) for t in ts])
        style_axes(ax, f"{dev} {dt} {h}×{i}".strip(), xlabel="tokens per call T",
                   ylabel="speedup (×)" if ax is axes[0][0] else None)
        ax.title.set_fontsize(9)
    labels = [f"{b} over {speed[speed.backend == b]['baseline'].iloc[0]}" for b in others]
    legend_above(fig, [Patch(color=colors[b]) for b in others], labels, ncol=min(len(labels), 3))
    fig.tight_layout()
    caption = [f"baseline: {baseline}", device_note(table), *fp_versus_int4(table)]
    width = int(fig.get_figwidth() * 15)
    fig.text(0.5, 0.0, "\n".join(textwrap.fill(c, width) for c in caption), ha="center", va="top", fontsize=8,
             style="italic")
    out.figure(fig, NAME11)
