"""Fig. 14: single-request TPOT, models × memory tiers × datasets (+AVG) × every method present.

Statistics, per (model, tier, dataset, method). The prompt is the unit: the repeats of a prompt
decode the same tokens, so each prompt's TPOT is the median over its timing repeats
(specter.records.paired.prompt_medians), and
  median_ms        the median of those per-prompt TPOTs (the bar)
  ci_low_ms, ci_high_ms  percentile-bootstrap 95 % CI of that median, resampling prompts (the error
                   bar; seeded, so the same records always give the same interval)
  mean_ms, p90_ms  mean and p90 over the records (the paper's statistic, kept for the paper
                   comparison; every prompt has the same repeats, so the mean is the prompts' mean)
  prompts, records, repeats  how many of each stand behind the row
AVG: the median and CI over all of the method's prompts in the cell (every dataset); its mean_ms is
the mean of the per-dataset means (the paper's "average over datasets"). Records flagged for a
drifted link (load_ratio_off) are left out and counted in the caption. A lossy method (its tokens
differ from target_only's, specter.figures.lossy) carries its token match in the legend.

One hardware per figure (`hardware_groups`): on a GPU every method shares one figure; on a CPU,
fig14_tpot holds the methods that run on the emulated link (every offloading method), and the
engines that place their own weights (transformers, llama.cpp, vLLM, run with hardware=cpu) are
drawn in fig14_tpot_cpu beside target_only on that same CPU. A bar is never set beside a bar
measured on other hardware. Traced runs (method.trace_windows) are not here: table_traced_runs
sets each beside the untraced run of the same model, tier and method.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.patches import Patch

from specter.figures.common import (Output, Skip, dataset_label, legend_above, method_colors,
    method_label, model_label, order_datasets, order_methods, order_models, order_tiers, percentile, style_axes,
    subplots)
from specter.figures.data import ResultSet, drifted_note
from specter.figures.lossy import lossy_label, token_match
from specter.records.paired import median_interval, prompt_medians

CI_SEED = 0  # the bootstrap's seed: the same records always draw the same intervals
CI_RESAMPLES = 20_000  # enough that an interval's end moves by < 0.01 between seeds (2,000 moved the side of 1)
CI_CHECK_SEEDS = (1, 2, 3, 4)  # a side of 1 (above, below) counts only where these seeds' intervals agree

NAME = "fig14_tpot"
TITLE = "Fig. 14: TPOT per model, memory tier, dataset and method"
KEYS = ["model", "memory", "hardware", "variant"]
NAME_TRACED = "table_traced_runs"
# the figure every offloading method belongs in, by the hardware it ran on (first present wins)
PRIMARY_HARDWARE = ("cuda", "emulated")
HARDWARE_TITLES = {
    "emulated": "offloading methods on the emulated link (CPU)",
    "cpu": "engines that place their own weights, beside target_only, on the CPU (no link)",
    "cuda": "every method on the GPU",
}


def tpot_table(records: pd.DataFrame) -> pd.DataFrame:
    """The numbers behind Fig. 14 (see the module docstring)."""
    records = records.assign(hardware=records["hardware"].fillna("unknown").astype(str)) \
        if "hardware" in records.columns else records.assign(hardware="unknown")
    rows = []
    for (model, memory, hardware, variant), g in records.groupby(KEYS, sort=False):
        per_ds = []
        for dataset, d in g.groupby("dataset", sort=False):
            per_ds.append(_row(model, memory, hardware, variant, dataset, d, 1))
        rows += per_ds
        row = _row(model, memory, hardware, variant, "AVG", g, len(per_ds))
        row["mean_ms"] = float(np.mean([r["mean_ms"] for r in per_ds]))
        rows.append(row)
    table = pd.DataFrame(rows)
    table["_m"] = table["model"].map({m: i for i, m in enumerate(order_models(table["model"]))})
    table["_t"] = table["memory"].map({m: i for i, m in enumerate(order_tiers(table["memory"]))})
    table["_h"] = table["hardware"].map({h: i for i, h in enumerate(order_hardware(table["hardware"]))})
    table["_d"] = table["dataset"].map({m: i for i, m in enumerate(order_datasets(table["dataset"]))})
    table["_v"] = table["method"].map({m: i for i, m in enumerate(order_methods(table["method"]))})
    return table.sort_values(["_m", "_t", "_h", "_d", "_v"]).drop(columns=["_m", "_t", "_h", "_d", "_v"]) \
        .reset_index(drop=True)


def order_hardware(names) -> list[str]:
    names = set(map(str, names))
    known = [h for h in (*PRIMARY_HARDWARE, "cpu") if h in names]
    return known + sorted(names - set(known))


def hardware_groups(hardware) -> list[tuple[str, list[str]]]:
    """(figure name, hardware drawn in it): one hardware per figure; a GPU run shares one figure.

    The first figure is fig14_tpot: the GPU if present, else the emulated link, else the only
    hardware there is; every other hardware gets fig14_tpot_<hardware>."""
    ordered = order_hardware(hardware)
    if not ordered:
        return []
    if "cuda" in ordered:  # on a GPU every method runs on the same device: one figure
        return [(NAME, ["cuda"])] + [(f"{NAME}_{h}", [h]) for h in ordered if h != "cuda"]
    return [(NAME if i == 0 else f"{NAME}_{h}", [h]) for i, h in enumerate(ordered)]


def _row(model, memory, hardware, variant, dataset, records: pd.DataFrame, datasets: int) -> dict:
    tpot = records["tpot_ms"].dropna()
    per_prompt = prompt_medians(records.dropna(subset=["tpot_ms"]))
    ci = median_interval(per_prompt.to_numpy(), resamples=CI_RESAMPLES, seed=CI_SEED)
    return {
        "model": model, "memory": memory, "hardware": hardware, "dataset": dataset, "method": variant,
        "median_ms": ci.median, "ci_low_ms": ci.low, "ci_high_ms": ci.high,
        "mean_ms": float(tpot.mean()), "p90_ms": percentile(tpot, 90),
        "prompts": int(ci.n), "records": int(len(tpot)), "repeats": int(records["repeat"].nunique()),
        "datasets": datasets,
    }


def build(results: ResultSet, out: Output) -> None:
    records = results.records("main")
    if records.empty:
        raise Skip("no records.csv (outside K-sweep, bench, batch and trace folders)")
    records = records.dropna(subset=["tpot_ms"])
    table = tpot_table(records)
    match = token_match(records)
    drifted = results.drifted_count("main")
    for name, hardware in hardware_groups(table["hardware"]):
        sub = table[table["hardware"].isin(hardware)].reset_index(drop=True)
        what = HARDWARE_TITLES.get(hardware[0], f"hardware={hardware[0]}")
        out.table(sub, name, f"{TITLE}: {what}", notes=[
            "TPOT in ms/token; a prompt's TPOT = the median over its timing repeats; bar = median over prompts, "
            "error bar = its bootstrap 95 % CI over prompts (seeded); mean and p90 over records beside it. AVG = "
            "median and CI over every prompt of the cell (its mean_ms: the mean "
            f"of the per-dataset means). {drifted_note(drifted)} "
            f"Hardware: {', '.join(hardware)} (one hardware per figure; see the module docstring)."])
        draw(sub, out, name, f"{what}; {drifted_note(drifted)}", match)
    traced = traced_table(results, table)
    if not traced.empty:
        out.table(traced, NAME_TRACED, "Traced runs (method.trace_windows) beside the untraced run", notes=[
            "Tracing times every copy on the host and writes every event: its TPOT is the run's with the tracer, "
            "drawn in the planner timeline (Figs. 8/9), never in Fig. 14. mean_ms: AVG over the traced datasets."])


def traced_table(results: ResultSet, main: pd.DataFrame) -> pd.DataFrame:
    """Each traced run's mean TPOT beside the untraced run of the same model, tier, hardware and method."""
    traced = results.records("trace")
    if traced.empty or "tpot_ms" not in traced:
        return pd.DataFrame()
    t = tpot_table(traced.dropna(subset=["tpot_ms"]))
    t = t[t["dataset"] == "AVG"]
    ref = main[main["dataset"] == "AVG"].set_index(["model", "memory", "hardware", "method"])["mean_ms"]
    rows = []
    for r in t.itertuples(index=False):
        untraced = ref.get((r.model, r.memory, r.hardware, r.method), float("nan"))
        rows.append({"model": r.model, "memory": r.memory, "hardware": r.hardware, "method": r.method,
                     "traced_ms": r.mean_ms, "untraced_ms": untraced, "traced_over_untraced": r.mean_ms / untraced,
                     "records": r.records})
    return pd.DataFrame(rows)


def draw(table: pd.DataFrame, out: Output, name: str = NAME, what: str = "",
         match: dict[str, float] | None = None) -> None:
    models, tiers = order_models(table["model"]), order_tiers(table["memory"])
    variants = order_methods(table["method"])
    colors = method_colors(variants)
    fig, axes = subplots(len(models), len(tiers), w=max(3.8, 0.9 * table["dataset"].nunique() + 1.5), h=2.9)
    for r, model in enumerate(models):
        for c, tier in enumerate(tiers):
            ax = axes[r][c]
            sub = table[(table["model"] == model) & (table["memory"] == tier)]
            if sub.empty:
                ax.set_axis_off()
                continue
            datasets = order_datasets(sub["dataset"])
            present = [v for v in variants if v in set(sub["method"])]
            interval_bars(ax, datasets, present, sub, colors)
            ax.set_xticks(range(len(datasets)), [dataset_label(d) for d in datasets])
            if "AVG" in datasets:
                ax.axvline(len(datasets) - 1.5, color="#999999", lw=0.6, ls=":")
            # two short lines: a long one-line title runs into the next panel's
            style_axes(ax, f"{model_label(model)}\n{tier} memory", ylabel="median TPOT (ms/token)" if c == 0 else None)
            ax.title.set_fontsize(9)
    handles = [Patch(color=colors[v]) for v in variants]
    legend_above(fig, handles, [lossy_label(method_label(v), (match or {}).get(v)) for v in variants])
    fig.tight_layout()
    if what:  # a caption below the panels: the legend holds the space above them
        fig.text(0.5, 0.0, what, ha="center", va="top", fontsize=9, style="italic")
    out.figure(fig, name)


def interval_bars(ax, datasets: list[str], variants: list[str], table: pd.DataFrame, colors: dict[str, str]) -> None:
    """One bar per (dataset, method) at the median, its error bar the CI (asymmetric)."""
    width = 0.8 / max(1, len(variants))
    for i, name in enumerate(variants):
        rows = table[table["method"] == name].set_index("dataset")
        present = [d for d in datasets if d in rows.index]
        xs = [j + (i - (len(variants) - 1) / 2) * width for j, d in enumerate(datasets) if d in rows.index]
        med = rows.loc[present, "median_ms"].to_numpy(dtype=float)
        err = np.vstack([med - rows.loc[present, "ci_low_ms"].to_numpy(dtype=float),
                         rows.loc[present, "ci_high_ms"].to_numpy(dtype=float) - med])  # [2, n]
        ax.bar(xs, med, width=width, color=colors[name], yerr=np.clip(err, 0, None), capsize=1.5,
               error_kw={"elinewidth": 0.6, "ecolor": "#333333"})
