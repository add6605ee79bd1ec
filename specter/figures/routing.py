"""Fig. 13: routing diversity per dataset — per-window expert working sets and pairwise distances.

Input: `routes.csv.gz` (or a plain `routes.csv`) in run folders, columns dataset, prompt_index,
repeat, window, layer, expert, count (tokens of that window routed to that expert in that layer). Per model one run configuration
is used: method specter if present (else the first method by name), high memory if present.

Left   distinct experts per layer per window: for every distinct (prompt, window) the mean over layers
       of the number of experts with count > 0; box plot per dataset
Right  pairwise routing distance between datasets: per layer the expert-frequency distribution of
       each dataset (counts summed over every distinct window, normalised); distance = Jensen–Shannon
       distance (base 2, in [0, 1]) averaged over the layers both datasets route through

Windows are counted once: the repeats of a prompt are timing repeats that decode the same tokens, so
they route the same windows. Each (dataset, prompt_index, window, layer) is taken from the lowest
repeat that logged it (`distinct_windows`); adding identical repeats changes no number.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from specter.figures.common import (
    Output,
    Skip,
    dataset_label,
    model_label,
    order_datasets,
    order_models,
    order_tiers,
    percentile,
    style_axes,
    subplots,
)
from specter.figures.data import ResultSet, flatten
from specter.figures.labels import record_source

NAME = "fig13_routing"
COLUMNS = {"dataset", "window", "layer", "expert", "count"}


def _main_grid(results: ResultSet, folder) -> bool:
    """A run of the main grid: not a K-sweep point, batch size, side benchmark or traced run
    (those repeat the main grid's prompts: their routes would count the same windows again)."""
    rel = Path(folder).relative_to(results.root).parts if Path(folder).is_relative_to(results.root) else ()
    if any(p.startswith("K=") for p in rel):
        return False
    return record_source(rel, flatten(results.config(folder).get("method") or {})) == "main"


def load_routes(results: ResultSet) -> pd.DataFrame:
    main = results.csvs("routes.csv", folders=lambda folder: _main_grid(results, folder))
    frames = []
    for path, df in main or results.csvs("routes.csv"):  # a set with routes only outside the main grid still draws
        if not COLUMNS <= set(df.columns):
            print(f"note: {path} lacks {sorted(COLUMNS - set(df.columns))}; ignored")
            continue
        info = results.run_info(path.parent)
        for col in ("prompt_index", "repeat"):
            if col not in df.columns:
                df[col] = 0
        model = df["model"] if "model" in df.columns else info["model"] or path.parent.name
        frames.append(df.assign(model=model, method=info["method"] or "", memory=info["memory"] or "",
                                run=info["run"]))
    if not frames:
        return pd.DataFrame()
    routes = pd.concat(frames, ignore_index=True)
    chosen = []
    for model, g in routes.groupby("model"):
        methods = sorted(g["method"].unique())
        method = "specter" if "specter" in methods else methods[0]
        g = g[g["method"] == method]
        memory = order_tiers(g["memory"].unique())[0]
        chosen.append(g[g["memory"] == memory])
    return pd.concat(chosen, ignore_index=True)


WINDOW = ["model", "dataset", "prompt_index", "window", "layer"]  # one routed window of one layer, any repeat


def distinct_windows(routes: pd.DataFrame) -> pd.DataFrame:
    """Each (model, dataset, prompt_index, window, layer) once: the rows of the lowest repeat that logged it (the
    repeats of a prompt decode the same tokens, so a later repeat logs the same window again)."""
    if routes.empty or "repeat" not in routes.columns:
        return routes
    repeat = pd.to_numeric(routes["repeat"], errors="coerce").fillna(0)
    first = repeat.groupby([routes[c] for c in WINDOW]).transform("min")
    return routes[repeat == first]


def working_sets(routes: pd.DataFrame) -> pd.DataFrame:
    """One row per distinct (model, prompt, window): mean over layers of the distinct experts routed to."""
    used = distinct_windows(routes)
    used = used[used["count"] > 0]
    per_layer = used.groupby(WINDOW)["expert"].nunique()
    return per_layer.groupby(WINDOW[:-1]).mean().rename("distinct_experts").reset_index()


def js_distance(p: np.ndarray, q: np.ndarray) -> float:
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2

    def kl(a, b):
        nz = a > 0
        return float(np.sum(a[nz] * np.log2(a[nz] / b[nz])))

    return float(np.sqrt(max(0.0, (kl(p, m) + kl(q, m)) / 2)))


def distances(routes: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for model, g in distinct_windows(routes).groupby("model"):
        counts = g.groupby(["dataset", "layer", "expert"])["count"].sum()
        experts = sorted(g["expert"].unique())
        datasets = order_datasets(g["dataset"].unique())
        for i, a in enumerate(datasets):
            for b in datasets[i + 1:]:
                ds = []
                for layer in sorted(g["layer"].unique()):
                    try:
                        pa = counts.loc[(a, layer)].reindex(experts, fill_value=0).to_numpy(float)
                        pb = counts.loc[(b, layer)].reindex(experts, fill_value=0).to_numpy(float)
                    except KeyError:
                        continue
                    if pa.sum() > 0 and pb.sum() > 0:
                        ds.append(js_distance(pa, pb))
                if ds:
                    rows.append({"model": model, "dataset_a": a, "dataset_b": b, "js_distance": float(np.mean(ds)),
                                 "layers": len(ds)})
    return pd.DataFrame(rows)


def build(results: ResultSet, out: Output) -> None:
    routes = load_routes(results)
    if routes.empty:
        raise Skip("no routes.csv or routes.csv.gz (dataset,prompt_index,repeat,window,layer,expert,count) in any run folder")
    ws = working_sets(routes)
    summary = ws.groupby(["model", "dataset"]).agg(
        windows=("distinct_experts", "size"), mean=("distinct_experts", "mean"),
        median=("distinct_experts", "median"), p90=("distinct_experts", lambda s: percentile(s, 90))).reset_index()
    runs = routes.groupby("model")["run"].first().to_dict()
    summary["run"] = summary["model"].map(runs)
    out.table(summary, f"{NAME}_working_set", "Fig. 13 (left): distinct experts per layer per window",
              notes=["Per distinct (prompt, window): mean over layers of the experts with count > 0. `windows` "
                     "counts each window once: the repeats of a prompt decode the same tokens, so only the lowest "
                     "repeat that logged a window is used."])
    dist = distances(routes)
    if not dist.empty:
        out.table(dist, f"{NAME}_distance", "Fig. 13 (right): pairwise routing distance between datasets",
                  notes=["Jensen–Shannon distance (base 2, 0 = identical, 1 = disjoint) of the per-layer expert "
                         "frequency distributions (each distinct window counted once), mean over layers."])
    models = order_models(routes["model"].unique())
    fig, axes = subplots(len(models), 2, w=3.8, h=2.9)
    for r, model in enumerate(models):
        left, right = axes[r]
        w = ws[ws["model"] == model]
        datasets = order_datasets(w["dataset"].unique())
        box = left.boxplot([w.loc[w["dataset"] == d, "distinct_experts"] for d in datasets], widths=0.6,
                           patch_artist=True, showfliers=False, medianprops={"color": "black"})
        for patch in box["boxes"]:
            patch.set(facecolor="#56B4E9", alpha=0.7, edgecolor="#0072B2")
        left.set_xticks(range(1, len(datasets) + 1), [dataset_label(d) for d in datasets])
        # the model on its own line: "<model> (mirrors <real model>): <panel>" overran the next panel
        style_axes(left, f"{model_label(model)}\nworking set per window", ylabel="distinct experts / layer")
        d = dist[dist["model"] == model] if not dist.empty else dist
        names = order_datasets(routes.loc[routes["model"] == model, "dataset"].unique())
        mat = np.zeros((len(names), len(names)))
        for row in d.itertuples(index=False):
            i, j = names.index(row.dataset_a), names.index(row.dataset_b)
            mat[i, j] = mat[j, i] = row.js_distance
        im = right.imshow(mat, cmap="viridis", vmin=0, vmax=1)  # JS distance is bounded by 1
        right.set_xticks(range(len(names)), [dataset_label(n) for n in names])
        right.set_yticks(range(len(names)), [dataset_label(n) for n in names])
        for i in range(len(names)):
            for j in range(len(names)):
                right.text(j, i, f"{mat[i, j]:.2f}", ha="center", va="center", fontsize=7,
                           color="white" if mat[i, j] < 0.6 else "black")
        right.set_title(f"{model}\nrouting distance (JS)", fontsize=10, loc="left", fontweight="bold")
        fig.colorbar(im, ax=right, fraction=0.046, pad=0.04)
    fig.tight_layout()
    out.figure(fig, NAME)
