"""Figs. 15/16 and Table 3: batched decoding.

Input: `batch.csv` files, one row per (method, model, memory, batch_size, dataset[, repeat]) with
tpot_median_ms, tpot_p90_ms, throughput_tok_s, distinct_experts_per_layer, h2d_bytes_per_token,
acceptance, iterations, new_tokens (and tpot_mean_ms when the runs write it: the paper's mean TPOT;
the median is used otherwise). Rows repeated for the same key are averaged. `batch_summary.csv`
beside them names the sizes a method's memory tier refused ("refused: ... the largest batch that
fits is B=n").

Fig. 15  TPOT and aggregate throughput against the batch size B, averaged over the datasets the batch.csv
         files hold (titles and captions name them: `datasets_note`; one dataset is named, not "averaged")
Fig. 16  the verification working set against B: distinct experts per MoE layer in one target pass
         (`distinct_experts_per_layer`, averaged over the passes), the paper's Fig. 16 quantity, the
         same definition for every method. A pass is what the target model runs at once: one decode
         step of B tokens for an autoregressive method, one verification of B×(K+1) tokens for a
         speculative one (the legend gives each method's pass). It grows with B. Below it, H2D bytes
         per generated token. A method whose folder has no working-set column (an engine that places
         its own weights and does not report routing, or a CSV written before the column) is named
         in the caption, not drawn.
Refused  a size a method's memory tier refused (batch_summary.csv) is drawn as × on the lower edge of
         Figs. 15/16 at that B, in the method's colour, so a line never stops silently
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
from matplotlib.ticker import EngFormatter

from specter.figures.common import (Output, Skip, legend_above, method_colors, method_label, model_label,
    order_datasets, order_methods, order_models, style_axes, subplots)
from specter.figures import tpot_grid
from specter.figures.data import ResultSet
from specter.figures.labels import legend_label
from specter.figures.tpot_grid import HARDWARE_TITLES

NAME15, NAME16, NAME_T3, NAME_SCALE = "fig15_batch_tpot", "fig16_batch_working_set", "table3_batch", "table_batch_scaling"
KEY = ["method", "model", "memory", "hardware", "batch_size", "dataset"]
METRICS = ("tpot_mean_ms", "tpot_median_ms", "tpot_p90_ms", "throughput_tok_s", "distinct_experts_per_layer",
           "h2d_bytes_per_token", "acceptance", "experts_per_layer_per_token", "K", "token_match_fraction")
DEMAND = "experts_per_layer_per_token"  # kept in the tables: working set × passes ÷ tokens generated
WORKING_SET = "distinct_experts_per_layer"  # Fig. 16: distinct experts per MoE layer per target pass
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


def datasets_note(data: pd.DataFrame) -> str:
    """The datasets behind the lines, as the data hold them: "one dataset: humaneval", "mean over 3 datasets: gsm8k,
    wikitext2, humaneval", per method when methods differ, or "dataset not recorded"."""
    def names(d: pd.DataFrame) -> list[str]:
        return order_datasets(set(d["dataset"].astype(str)) - {"all", "", "nan"})

    def phrase(ds: list[str]) -> str:
        if not ds:
            return "dataset not recorded"
        return f"one dataset: {ds[0]}" if len(ds) == 1 else f"mean over {len(ds)} datasets: {', '.join(ds)}"

    per = {m: tuple(names(g)) for m, g in data.groupby("method", sort=False)}
    if len(set(per.values())) <= 1:
        return phrase(list(next(iter(per.values()), ())))
    return "; ".join(f"{method_label(m)}: {phrase(list(per[m]))}" for m in order_methods(per))


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


def series_name(method: str, memory: str, tiers: int) -> str:
    """A line's key: the method, with its memory tier when the data holds more than one."""
    return f"{method} ({memory})" if tiers > 1 else str(method)


def pass_of(k) -> str:
    """What one target pass holds for a method with draft length k (NaN: autoregressive)."""
    return f"B×{int(k) + 1} tokens" if pd.notna(k) and k > 0 else "B tokens"


def refused_note(refused: pd.DataFrame) -> str:
    """The caption's sentence on refused sizes (empty when none)."""
    if refused.empty:
        return ""
    parts = []
    for (method, model, memory), g in refused.groupby(["method", "model", "memory"], sort=True):
        largest = g["largest_b"].dropna()
        sizes = ", ".join(str(int(b)) for b in sorted(g["batch_size"]))
        fits = f"; largest that fits: {int(largest.iloc[0])}" if not largest.empty else ""
        parts.append(f"{method_label(method)} on {model} {memory}: B = {sizes}{fits}")
    return "× on the B axis: refused by the memory budget (" + "; ".join(parts) + ")"


def _lines(fig_axes, avg, models, panels, colors, labels, name, out, refused, caption: str = ""):
    fig, axes = fig_axes
    tiers = avg["memory"].nunique()
    drawn: set[str] = set()
    refused_any = False
    for c, model in enumerate(models):
        d = avg[avg["model"] == model]
        r_model = refused[refused["model"] == model] if not refused.empty else refused
        for r, (metric, ylabel, log) in enumerate(panels):
            ax = axes[r][c]
            for series, g in d.groupby("series"):
                g = g.dropna(subset=[metric]).sort_values("batch_size")
                if g.empty:
                    continue
                drawn.add(series)
                ls = "--" if " (low)" in series else "-"
                ax.plot(g["batch_size"], g[metric], marker="o", ms=3.5, lw=1.4, ls=ls, color=colors[series])
            # a refused size: × at its B on the lower edge (axes coordinates in y), never a silent gap
            edge = ax.get_xaxis_transform()
            for row in r_model.itertuples(index=False):
                series = series_name(row.method, row.memory, tiers)
                if series not in colors:
                    continue
                ax.plot([row.batch_size], [0.0], transform=edge, marker="x", ms=7, mew=1.8, ls="none",
                        color=colors[series], clip_on=False, zorder=5)
                refused_any = True
                drawn.add(series)
            ax.set_xscale("log", base=2)
            bs = sorted(set(d["batch_size"]) | set(r_model["batch_size"] if not r_model.empty else []))
            ax.set_xticks(bs, [str(int(b)) for b in bs])
            ax.minorticks_off()
            if log:
                ax.set_yscale("log")
            if metric == "h2d_bytes_per_token":
                ax.yaxis.set_major_formatter(EngFormatter(unit="B"))
            style_axes(ax, model_label(model).replace(" (", "\n(", 1) if r == 0 else None,
                       xlabel="batch size B" if r == len(panels) - 1 else None, ylabel=ylabel if c == 0 else None)
    order = order_methods(avg["method"])
    series = sorted(drawn, key=lambda s: (order.index(s.split(" (")[0]) if s.split(" (")[0] in order else len(order), s))
    handles = [Line2D([], [], color=colors[s], marker="o", ls="--" if " (low)" in s else "-") for s in series]
    names = [labels[s] for s in series]
    if refused_any:
        handles.append(Line2D([], [], color="#555555", marker="x", mew=1.8, ls="none"))
        names.append("refused: over the memory budget")
    legend_above(fig, handles, names, ncol=min(len(names), 4))
    fig.tight_layout()
    if caption:  # below the panels: the legend holds the space above them
        width = int(fig.get_figwidth() * 15)  # characters per line of 8 pt italic
        fig.text(0.5, 0.0, _wrap(caption, width), ha="center", va="top", fontsize=8, style="italic")
    out.figure(fig, name)


def _wrap(text: str, width: int = 110) -> str:
    import textwrap

    return "\n".join(textwrap.fill(p, width) for p in text.split("\n") if p)


def series_labels(avg: pd.DataFrame, with_pass: bool) -> dict[str, str]:
    """series -> legend label: the method's name (lossy ones with their token match), its tier when
    there are several, and (Fig. 16) what one target pass holds."""
    out = {}
    for series, g in avg.groupby("series"):
        method = str(g["method"].iloc[0])
        match = g["token_match_fraction"].mean() if "token_match_fraction" in g else None
        label = legend_label(method, None if match is None or pd.isna(match) else float(match))
        if " (" in series:
            label += " (" + series.split(" (", 1)[1]
        if with_pass:
            ks = sorted(g["K"].dropna().unique()) if "K" in g else []
            label += ", pass = " + (pass_of(ks[0]) if len(ks) == 1 else
                                    f"B×(K+1) tokens, K = {'/'.join(str(int(k)) for k in ks)}" if ks else pass_of(np.nan))
        out[series] = label
    return out


def build(results: ResultSet, out: Output) -> None:
    data = load_batch(results)
    if data.empty or data["tpot_ms"].isna().all():
        raise Skip("no batch.csv (python run.py experiment=batch ...)")
    refused = refusals(results)
    avg = averaged(data)
    tiers = avg["memory"].nunique()
    every = set(avg["series"]) | {series_name(r.method, r.memory, tiers) for r in refused.itertuples(index=False)}
    colors = method_colors(every)
    tpot_note = "mean" if "tpot_mean_ms" in data.columns else "median (no tpot_mean_ms column)"
    out.table(avg.drop(columns=["series"]), NAME15, f"Fig. 15/16: batched decoding ({datasets_note(data)})",
              notes=[f"tpot_ms: per-request TPOT, {tpot_note}; throughput: generated tokens / batch wall time. "
                     f"{WORKING_SET} (Fig. 16): distinct experts per MoE layer in one target pass, averaged over "
                     "the passes; a pass is a decode step of B tokens (autoregressive) or a verification of "
                     f"B×(K+1) tokens (speculative). {DEMAND}: the same summed over passes ÷ new_tokens "
                     "(demand per generated token, not drawn).",
                     *([refused_note(refused)] if not refused.empty else [])])
    for suffix, hardware in hardware_groups(avg["hardware"]):
        part = avg[avg["hardware"].isin(hardware)]
        models = order_models(part["model"].unique())
        methods_here = set(part["method"])
        refused_here = refused[refused["method"].isin(methods_here) & refused["model"].isin(models)] \
            if not refused.empty else refused
        title = (HARDWARE_TITLES.get(hardware[0], f"hardware={hardware[0]}")
                 + f"; {datasets_note(data[data['hardware'].isin(hardware)])}")
        note = refused_note(refused_here)
        panels = [("tpot_ms", "TPOT (ms/token)", False)]
        if "throughput_tok_s" in part:
            panels.append(("throughput_tok_s", "throughput (tokens/s)", False))
        _lines(subplots(len(panels), len(models), w=3.4, h=2.5), part, models, panels, colors,
               series_labels(part, with_pass=False), NAME15 + suffix, out, refused_here,
               "\n".join(filter(None, [title, note])))
        has_ws = WORKING_SET in part and part[WORKING_SET].notna().any()
        panels16 = [(m, label, False) for m, label in ((WORKING_SET, "working set: distinct experts\n"
                                                       "per layer per target pass"),
                                                      ("h2d_bytes_per_token", "H2D bytes / token"))
                    if m in part and part[m].notna().any()]
        if not has_ws:
            print(f"{NAME16 + suffix}: skipped: no {WORKING_SET} in these batch.csv files "
                  f"({', '.join(order_methods(methods_here))}: engines that place their own weights, or CSVs "
                  "written without it)")
            continue
        lacking = sorted(m for m in methods_here
                         if part.loc[part["method"] == m, WORKING_SET].isna().all())
        missing = (f"no working set in the batch.csv of: {', '.join(method_label(m) for m in lacking)} (not drawn)"
                   if lacking else "")
        ws_note = ("working set: distinct experts per MoE layer in one target pass (decode step or "
                   "verification), averaged over the passes")
        _lines(subplots(len(panels16), len(models), w=3.4, h=2.5), part, models, panels16, colors,
               series_labels(part, with_pass=True), NAME16 + suffix, out, refused_here,
               "\n".join(filter(None, [title, ws_note, missing, note])))
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
