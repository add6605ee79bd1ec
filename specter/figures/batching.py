"""Figs. 15/16 and Table 3: batched decoding.

Input: `batch.csv` files, one row per (method, model, memory, batch_size, dataset[, repeat]) with
tpot_median_ms, tpot_p90_ms, throughput_tok_s, distinct_experts_per_layer, h2d_bytes_per_token,
acceptance, iterations, new_tokens (and tpot_mean_ms when the runs write it: the paper's mean TPOT;
the median is used otherwise). Rows repeated for the same key are averaged. `batch_summary.csv`
beside them names the sizes a method's memory tier refused ("refused: ... the largest batch that
fits is B=n").

Fig. 15  TPOT and aggregate throughput against the batch size B, averaged over datasets
Fig. 16  expert demand per generated token and H2D bytes per token against B. One quantity for
         every method: experts_per_layer_per_token = distinct_experts_per_layer × iterations ÷
         new_tokens, i.e. the distinct experts each MoE layer needed per target pass, summed over
         the passes and divided by the tokens generated. A pass is one decode step of B tokens for
         an autoregressive method and one verification window of B×(K+1) tokens for a speculative
         one, so the per-pass working set (distinct_experts_per_layer, kept in the table) is not
         one quantity across methods and is not drawn.
Table 3  per-dataset TPOT and throughput of every method at the largest B of each model and tier
         (the largest size any method ran or was refused at, the paper's B = 32); a method refused
         there is a row "refused (largest B = n)", one not run there "not run (largest B = n)"
Scaling  per (model, tier, method): TPOT(B_max)/TPOT(1), throughput(B_max)/throughput(1), TPOT(2)/TPOT(1),
         working set(2)/working set(1) — the ratios the paper quotes — at that same B_max for every
         method; a method without B_max keeps its row, with the status in place of the B_max ratios
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from specter.figures.common import (Output, Skip, legend_above, method_colors, method_label, model_label,
    order_datasets, order_methods, order_models, style_axes, subplots)
from specter.figures import tpot_grid
from specter.figures.data import ResultSet
from specter.figures.tpot_grid import HARDWARE_TITLES

NAME15, NAME16, NAME_T3, NAME_SCALE = "fig15_batch_tpot", "fig16_batch_working_set", "table3_batch", "table_batch_scaling"
KEY = ["method", "model", "memory", "hardware", "batch_size", "dataset"]
METRICS = ("tpot_mean_ms", "tpot_median_ms", "tpot_p90_ms", "throughput_tok_s", "distinct_experts_per_layer",
           "h2d_bytes_per_token", "acceptance", "experts_per_layer_per_token")
DEMAND = "experts_per_layer_per_token"
_LARGEST = re.compile(r"largest batch that fits is B=(\d+)")


def load_batch(results: ResultSet) -> pd.DataFrame:
    frames = []
    for path, df in results.csvs("batch.csv"):
        missing = {"method", "model", "batch_size"} - set(df.columns)
        if missing:
            print(f"note: {path} lacks {sorted(missing)}; ignored")
            continue
        info = results.run_info(path.parent)
        df = df.assign(**{c: df[c] if c in df.columns else (info.get(c) or "") for c in ("memory", "hardware")})
        hw = df["hardware"].where(df["hardware"].notna() & (df["hardware"].astype(str) != ""))
        df["hardware"] = hw.fillna(info.get("hardware") or "unknown").astype(str)
        if "dataset" not in df.columns:
            df["dataset"] = "all"
        frames.append(df)
    if not frames:
        return pd.DataFrame()
    data = pd.concat(frames, ignore_index=True)
    for m in (*METRICS, "iterations", "new_tokens"):
        if m in data.columns:
            data[m] = pd.to_numeric(data[m], errors="coerce")
    if {"distinct_experts_per_layer", "iterations", "new_tokens"} <= set(data.columns):
        # per row (one dataset and repeat): summed per-pass working sets over the tokens generated
        data[DEMAND] = data["distinct_experts_per_layer"] * data["iterations"] / data["new_tokens"].where(
            data["new_tokens"] > 0)
    metrics = [m for m in METRICS if m in data.columns]
    data = data.groupby(KEY, as_index=False)[metrics].mean()
    data["tpot_ms"] = data["tpot_mean_ms"] if "tpot_mean_ms" in data.columns else data.get("tpot_median_ms")
    data["series"] = data["method"].astype(str)
    if data["memory"].nunique() > 1:
        data["series"] = data["method"].astype(str) + " (" + data["memory"].astype(str) + ")"
    return data


def averaged(data: pd.DataFrame) -> pd.DataFrame:
    metrics = [m for m in (*METRICS, "tpot_ms") if m in data.columns]
    return data.groupby(["series", "method", "model", "memory", "hardware", "batch_size"], as_index=False)[metrics].mean()


def refusals(results: ResultSet) -> pd.DataFrame:
    """(method, model, memory, batch_size, largest_b, status) of every refused size in batch_summary.csv."""
    rows = []
    for path, df in results.csvs("batch_summary.csv"):
        if not {"method", "model", "batch_size", "status"} <= set(df.columns):
            continue
        info = results.run_info(path.parent)
        for r in df[df["status"].astype(str).str.startswith("refused")].itertuples(index=False):
            found = _LARGEST.search(str(r.status))
            memory = getattr(r, "memory", None)
            rows.append({"method": r.method, "model": r.model,
                         "memory": memory if isinstance(memory, str) and memory else info.get("memory") or "",
                         "batch_size": int(r.batch_size), "largest_b": int(found.group(1)) if found else None,
                         "status": str(r.status)})
    return pd.DataFrame(rows, columns=["method", "model", "memory", "batch_size", "largest_b", "status"])


def target_sizes(data: pd.DataFrame, refused: pd.DataFrame | None = None) -> dict[tuple[str, str], int]:
    """(model, memory) -> the largest B any method ran or was refused at (Table 3's and the scaling B)."""
    sizes = data.groupby(["model", "memory"])["batch_size"].max().to_dict()
    if refused is not None and not refused.empty:
        for (model, memory), b in refused.groupby(["model", "memory"])["batch_size"].max().items():
            if (model, memory) in sizes:
                sizes[(model, memory)] = max(sizes[(model, memory)], b)
    return {k: int(v) for k, v in sizes.items()}


def missing_status(method: str, model: str, memory: str, b: int, measured: pd.DataFrame,
                   refused: pd.DataFrame | None) -> str:
    """Why `method` has no row at B=b: "refused (largest B = n)" or "not run (largest B = n)"."""
    if refused is not None and not refused.empty:
        r = refused[(refused["method"] == method) & (refused["model"] == model) & (refused["memory"] == memory)
                    & (refused["batch_size"] == b)]
        if not r.empty:
            n = r["largest_b"].iloc[0]
            return f"refused (largest B = {int(n)})" if pd.notna(n) else "refused"
    ran = measured[(measured["method"] == method) & (measured["model"] == model) & (measured["memory"] == memory)]
    largest = int(ran["batch_size"].max()) if not ran.empty else 0
    return f"not run (largest B = {largest})"


def scaling_table(avg: pd.DataFrame, refused: pd.DataFrame | None = None) -> pd.DataFrame:
    rows = []
    bmax_of = target_sizes(avg, refused)
    for (model, memory, hardware, method), g in avg.groupby(["model", "memory", "hardware", "method"], sort=False):
        g = g.set_index("batch_size").sort_index()
        if 1 not in g.index or len(g) < 2:
            continue
        bmax = bmax_of[(model, memory)]
        row = {"model": model, "memory": memory, "hardware": hardware, "method": method, "B_max": bmax,
               "status": "measured"}
        if bmax in g.index:
            row["tpot_ratio_Bmax_B1"] = g.loc[bmax, "tpot_ms"] / g.loc[1, "tpot_ms"]
            if "throughput_tok_s" in g:
                row["throughput_ratio_Bmax_B1"] = g.loc[bmax, "throughput_tok_s"] / g.loc[1, "throughput_tok_s"]
            if "distinct_experts_per_layer" in g:
                row["working_set_ratio_Bmax_B1"] = (g.loc[bmax, "distinct_experts_per_layer"]
                                                    / g.loc[1, "distinct_experts_per_layer"])
        else:
            row["status"] = missing_status(method, model, memory, bmax, avg, refused)
        if 2 in g.index:
            row["tpot_ratio_B2_B1"] = g.loc[2, "tpot_ms"] / g.loc[1, "tpot_ms"]
            if "distinct_experts_per_layer" in g:
                row["working_set_ratio_B2_B1"] = g.loc[2, "distinct_experts_per_layer"] / g.loc[1, "distinct_experts_per_layer"]
        rows.append(row)
    return pd.DataFrame(rows)


def table3(data: pd.DataFrame, refused: pd.DataFrame | None = None) -> pd.DataFrame:
    """Every method's per-dataset TPOT and throughput at its model and tier's largest B (+AVG)."""
    rows = []
    bmax_of = target_sizes(data, refused)
    hardware_of = data.groupby("method")["hardware"].first().to_dict()
    for (model, memory, hardware), g in data.groupby(["model", "memory", "hardware"], sort=False):
        bmax = bmax_of[(model, memory)]
        methods = set(g["method"])
        if refused is not None and not refused.empty:  # a method refused at every size has no batch.csv row
            r = refused[(refused["model"] == model) & (refused["memory"] == memory)]
            methods |= {m for m in r["method"] if hardware_of.get(m, hardware) == hardware}
        at = g[g["batch_size"] == bmax]
        base = {"model": model, "memory": memory, "hardware": hardware, "batch_size": int(bmax)}
        for method in order_methods(methods):
            m = at[at["method"] == method]
            if m.empty:
                rows.append({**base, "method": method, "dataset": "AVG", "tpot_ms": np.nan,
                             "throughput_tok_s": np.nan,
                             "status": missing_status(method, model, memory, bmax, data, refused)})
                continue
            for ds in order_datasets(m["dataset"]):
                d = m[m["dataset"] == ds]
                rows.append({**base, "method": method, "dataset": ds, "tpot_ms": d["tpot_ms"].mean(),
                             "throughput_tok_s": d["throughput_tok_s"].mean() if "throughput_tok_s" in d else np.nan,
                             "status": "measured"})
            rows.append({**base, "method": method, "dataset": "AVG", "tpot_ms": m["tpot_ms"].mean(),
                         "throughput_tok_s": m["throughput_tok_s"].mean() if "throughput_tok_s" in m else np.nan,
                         "status": "measured"})
    return pd.DataFrame(rows)


def with_status_text(table: pd.DataFrame, columns: tuple[str, ...]) -> pd.DataFrame:
    """The table for reading: a value missing because of a refusal shows the status text instead."""
    shown = table.astype(object).copy()
    missing = table["status"] != "measured"
    for col in columns:
        if col in shown.columns:
            shown.loc[missing & table[col].isna(), col] = table.loc[missing, "status"]
    return shown.drop(columns="status")


def hardware_groups(hardware) -> list[tuple[str, list[str]]]:
    """(name suffix, hardware): one hardware per figure, as Fig. 14 (tpot_grid.hardware_groups)."""
    return [(name[len(tpot_grid.NAME):], hw) for name, hw in tpot_grid.hardware_groups(hardware)]


def _lines(fig_axes, avg, models, panels, colors, name, out, caption: str = ""):
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
            style_axes(ax, model_label(model).replace(" (", "\n(", 1) if r == 0 else None, xlabel="batch size B" if r == len(panels) - 1 else None,
                       ylabel=ylabel if c == 0 else None)
    series = sorted(avg["series"].unique(), key=lambda s: order_methods(avg["method"]).index(s.split(" (")[0]))
    legend_above(fig, [Line2D([], [], color=colors[s], marker="o", ls="--" if " (low)" in s else "-") for s in series],
                 [method_label(s.split(" (")[0]) + (" (" + s.split(" (")[1] if " (" in s else "") for s in series])
    fig.tight_layout()
    if caption:  # below the panels: the legend holds the space above them
        fig.text(0.5, 0.0, caption, ha="center", va="top", fontsize=9, style="italic")
    out.figure(fig, name)


def build(results: ResultSet, out: Output) -> None:
    data = load_batch(results)
    if data.empty or data["tpot_ms"].isna().all():
        raise Skip("no batch.csv (python run.py experiment=batch ...)")
    refused = refusals(results)
    avg = averaged(data)
    colors = method_colors(avg["series"].unique())
    tpot_note = "mean" if "tpot_mean_ms" in data.columns else "median (no tpot_mean_ms column)"
    out.table(avg.drop(columns=["series"]), NAME15, "Fig. 15/16: batched decoding, averaged over datasets",
              notes=[f"tpot_ms: per-request TPOT, {tpot_note}; throughput: generated tokens / batch wall time. "
                     f"{DEMAND}: distinct_experts_per_layer × iterations ÷ new_tokens (the same quantity for every "
                     "method: expert demand per generated token); distinct_experts_per_layer: per target pass, "
                     "whose size differs between methods (B tokens, or B×(K+1) for a speculative window)."])
    for suffix, hardware in hardware_groups(avg["hardware"]):
        part = avg[avg["hardware"].isin(hardware)]
        models = order_models(part["model"].unique())
        caption = HARDWARE_TITLES.get(hardware[0], f"hardware={hardware[0]}")
        panels = [("tpot_ms", "TPOT (ms/token)", False)]
        if "throughput_tok_s" in part:
            panels.append(("throughput_tok_s", "throughput (tokens/s)", False))
        _lines(subplots(len(panels), len(models), w=3.4, h=2.5), part, models, panels, colors,
               NAME15 + suffix, out, caption)
        panels16 = [(m, label, False) for m, label in ((DEMAND, "distinct experts / layer\nper generated token"),
                                                      ("h2d_bytes_per_token", "H2D bytes / token"))
                    if m in part and part[m].notna().any()]
        if panels16:
            _lines(subplots(len(panels16), len(models), w=3.4, h=2.5), part, models, panels16, colors,
                   NAME16 + suffix, out, caption)
        else:
            print(f"{NAME16 + suffix}: skipped: no distinct_experts_per_layer+iterations+new_tokens "
                  "or h2d_bytes_per_token (methods that place their own weights count no expert I/O)")
    t3 = table3(data, refused)
    out.table(t3, NAME_T3, "Table 3: per-dataset TPOT (ms/token) and throughput (tokens/s) at the largest B",
              notes=["batch_size: the largest B any method ran or was refused at, per model and tier; a method "
                     "without a measurement there is listed with why (refused by its memory tier, or not run)."],
              display=with_status_text(t3, ("tpot_ms", "throughput_tok_s")))
    scale = scaling_table(avg, refused)
    if not scale.empty:
        out.table(scale, NAME_SCALE, "Batch scaling ratios (the paper's B=1→32 and B=1→2 figures)",
                  notes=["B_max: the model and tier's largest B, the same for every method; status says why a "
                         "method has no B_max ratios."],
                  display=with_status_text(scale, ("tpot_ratio_Bmax_B1", "throughput_ratio_Bmax_B1")))
