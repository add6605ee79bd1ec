"""Figs. 15/16 and Table 3: batched decoding.

Input: `batch.csv` files, one row per (method, model, memory, batch_size, dataset[, repeat]) with
tpot_median_ms, tpot_p90_ms, throughput_tok_s, distinct_experts_per_layer, h2d_bytes_per_token,
acceptance (and tpot_mean_ms when the runs write it: the paper's mean TPOT; the median is used
otherwise). Rows repeated for the same key are averaged.

Fig. 15  TPOT and aggregate throughput against the batch size B, averaged over datasets
Fig. 16  distinct experts per layer (verification working set) and H2D bytes per token against B
Table 3  per-dataset TPOT and throughput at the largest B of each model (+AVG)
Scaling  per (model, method): TPOT(B_max)/TPOT(1), throughput(B_max)/throughput(1), TPOT(2)/TPOT(1),
         working set(2)/working set(1) — the ratios the paper quotes
"""

from __future__ import annotations

import pandas as pd
from matplotlib.lines import Line2D

from specter.figures.common import (
    Output,
    Skip,
    legend_above,
    method_colors,
    method_label,
    model_label,
    order_datasets,
    order_methods,
    order_models,
    style_axes,
    subplots,
)
from specter.figures.data import ResultSet

NAME15, NAME16, NAME_T3, NAME_SCALE = "fig15_batch_tpot", "fig16_batch_working_set", "table3_batch", "table_batch_scaling"
KEY = ["method", "model", "memory", "batch_size", "dataset"]
METRICS = ("tpot_mean_ms", "tpot_median_ms", "tpot_p90_ms", "throughput_tok_s", "distinct_experts_per_layer",
           "h2d_bytes_per_token", "acceptance")


def load_batch(results: ResultSet) -> pd.DataFrame:
    frames = []
    for path, df in results.csvs("batch.csv"):
        missing = {"method", "model", "batch_size"} - set(df.columns)
        if missing:
            print(f"note: {path} lacks {sorted(missing)}; ignored")
            continue
        info = results.run_info(path.parent)
        df = df.assign(**{c: df[c] if c in df.columns else (info.get(c) or "") for c in ("memory",)})
        if "dataset" not in df.columns:
            df["dataset"] = "all"
        frames.append(df)
    if not frames:
        return pd.DataFrame()
    data = pd.concat(frames, ignore_index=True)
    metrics = [m for m in METRICS if m in data.columns]
    for m in metrics:
        data[m] = pd.to_numeric(data[m], errors="coerce")
    data = data.groupby(KEY, as_index=False)[metrics].mean()
    data["tpot_ms"] = data["tpot_mean_ms"] if "tpot_mean_ms" in data.columns else data.get("tpot_median_ms")
    data["series"] = data["method"].astype(str)
    if data["memory"].nunique() > 1:
        data["series"] = data["method"].astype(str) + " (" + data["memory"].astype(str) + ")"
    return data


def averaged(data: pd.DataFrame) -> pd.DataFrame:
    metrics = [m for m in (*METRICS, "tpot_ms") if m in data.columns]
    return data.groupby(["series", "method", "model", "memory", "batch_size"], as_index=False)[metrics].mean()


def scaling_table(avg: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (model, memory, method), g in avg.groupby(["model", "memory", "method"], sort=False):
        g = g.set_index("batch_size").sort_index()
        if 1 not in g.index or len(g) < 2:
            continue
        bmax = int(g.index.max())
        row = {"model": model, "memory": memory, "method": method, "B_max": bmax,
               "tpot_ratio_Bmax_B1": g.loc[bmax, "tpot_ms"] / g.loc[1, "tpot_ms"]}
        if "throughput_tok_s" in g:
            row["throughput_ratio_Bmax_B1"] = g.loc[bmax, "throughput_tok_s"] / g.loc[1, "throughput_tok_s"]
        if 2 in g.index:
            row["tpot_ratio_B2_B1"] = g.loc[2, "tpot_ms"] / g.loc[1, "tpot_ms"]
            if "distinct_experts_per_layer" in g:
                row["working_set_ratio_B2_B1"] = g.loc[2, "distinct_experts_per_layer"] / g.loc[1, "distinct_experts_per_layer"]
        if "distinct_experts_per_layer" in g:
            row["working_set_ratio_Bmax_B1"] = g.loc[bmax, "distinct_experts_per_layer"] / g.loc[1, "distinct_experts_per_layer"]
        rows.append(row)
    return pd.DataFrame(rows)


def table3(data: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (model, memory), g in data.groupby(["model", "memory"], sort=False):
        bmax = g["batch_size"].max()
        g = g[g["batch_size"] == bmax]
        for method in order_methods(g["method"]):
            m = g[g["method"] == method]
            for ds in order_datasets(m["dataset"]):
                d = m[m["dataset"] == ds]
                rows.append({"model": model, "memory": memory, "batch_size": int(bmax), "method": method, "dataset": ds,
                             "tpot_ms": d["tpot_ms"].mean(),
                             "throughput_tok_s": d["throughput_tok_s"].mean() if "throughput_tok_s" in d else None})
            rows.append({"model": model, "memory": memory, "batch_size": int(bmax), "method": method, "dataset": "AVG",
                         "tpot_ms": m["tpot_ms"].mean(),
                         "throughput_tok_s": m["throughput_tok_s"].mean() if "throughput_tok_s" in m else None})
    return pd.DataFrame(rows)


def _lines(fig_axes, avg, models, panels, colors, name, out):
    fig, axes = fig_axes
    for c, model in enumerate(models):
        for r, (metric, ylabel, log) in enumerate(panels):
            ax = axes[r][c]
            d = avg[avg["model"] == model]
            for series, g in d.groupby("series"):
                g = g.sort_values("batch_size")
                ls = "--" if " (low)" in series else "-"
                ax.plot(g["batch_size"], g[metric], marker="o", ms=3.5, lw=1.4, ls=ls, color=colors[series])
            ax.set_xscale("log", base=2)
            bs = sorted(d["batch_size"].unique())
            ax.set_xticks(bs, [str(int(b)) for b in bs])
            if log:
                ax.set_yscale("log")
            style_axes(ax, model_label(model) if r == 0 else None, xlabel="batch size B" if r == len(panels) - 1 else None,
                       ylabel=ylabel if c == 0 else None)
    series = sorted(avg["series"].unique(), key=lambda s: order_methods(avg["method"]).index(s.split(" (")[0]))
    legend_above(fig, [Line2D([], [], color=colors[s], marker="o", ls="--" if " (low)" in s else "-") for s in series],
                 [method_label(s.split(" (")[0]) + (" (" + s.split(" (")[1] if " (" in s else "") for s in series])
    fig.tight_layout()
    out.figure(fig, name)


def build(results: ResultSet, out: Output) -> None:
    data = load_batch(results)
    if data.empty or data["tpot_ms"].isna().all():
        raise Skip("no batch.csv (python run.py experiment=batch ...)")
    avg = averaged(data)
    models = order_models(avg["model"].unique())
    colors = method_colors(avg["series"].unique())
    tpot_note = "mean" if "tpot_mean_ms" in data.columns else "median (no tpot_mean_ms column)"
    out.table(avg.drop(columns=["series"]), NAME15, "Fig. 15/16: batched decoding, averaged over datasets",
              notes=[f"tpot_ms: per-request TPOT, {tpot_note}; throughput: generated tokens / batch wall time."])
    panels = [("tpot_ms", "TPOT (ms/token)", False)]
    if "throughput_tok_s" in avg:
        panels.append(("throughput_tok_s", "throughput (tokens/s)", False))
    _lines(subplots(len(panels), len(models), w=3.4, h=2.5), avg, models, panels, colors, NAME15, out)
    panels16 = [(m, label, False) for m, label in (("distinct_experts_per_layer", "distinct experts / layer"),
                                                  ("h2d_bytes_per_token", "H2D bytes / token"))
                if m in avg and avg[m].notna().any()]
    if panels16:
        _lines(subplots(len(panels16), len(models), w=3.4, h=2.5), avg, models, panels16, colors, NAME16, out)
    else:
        print(f"{NAME16}: skipped: batch.csv has no distinct_experts_per_layer / h2d_bytes_per_token")
    out.table(table3(data), NAME_T3, "Table 3: per-dataset TPOT (ms/token) and throughput (tokens/s) at the largest B")
    scale = scaling_table(avg)
    if not scale.empty:
        out.table(scale, NAME_SCALE, "Batch scaling ratios (the paper's B=1→32 and B=1→2 figures)")
