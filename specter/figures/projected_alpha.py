"""The projected α curve: TPOT on the paper's machine against the draft's acceptance, per method.

Input: `alpha_curve.csv` as `python run.py experiment=project project.alpha=true` writes it. Each point is one
draft (GPTQ or RTN at 2-4 bits and a group size) at the acceptance it reached on the proxy; every draft is
charged the paper's INT4 g128 cost, so along a line only the acceptance moves. The paper's measured mean α
(results/paper/claims.csv, acceptance_mean) is marked. Per device file (suffix _<device> beside the A100's):

fig_projected_alpha     one panel per model (its high tier when projected): TPOT against α, one line per method,
                        each point labelled with its draft
table_projected_alpha   every point
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.lines import Line2D

from specter.figures.common import (Output, Skip, caption, legend_above, method_colors, method_label, model_label,
                                    order_methods, order_models, place_labels, style_axes, subplots, wrap)
from specter.figures.labels import legend_label
from specter.figures.data import ResultSet
from specter.figures.projection import _found, device_label, suffix

MARKERS = {4: "o", 3: "s", 2: "^"}  # bits


def paper_alpha(results: ResultSet) -> float | None:
    """The paper's mean acceptance over every model (claims.csv), None when the file is absent."""
    paper = getattr(results, "paper", None) or Path(__file__).resolve().parents[2] / "results" / "paper"
    path = Path(paper) / "claims.csv"
    if not path.is_file():
        return None
    claims = pd.read_csv(path)
    hit = claims[(claims["claim"] == "acceptance_mean") & (claims["model"] == "ALL")]
    return float(hit["value"].iloc[0]) if len(hit) else None


def build(results: ResultSet, out: Output) -> None:
    frames = [df for _, df in _found(results, "alpha_curve.csv") if {"alpha", "tpot_ms", "draft"} <= set(df.columns)]
    if not frames:
        raise Skip("no alpha_curve.csv (run: python run.py experiment=project project.alpha=true)")
    df = pd.concat(frames, ignore_index=True).dropna(subset=["alpha", "tpot_ms"])
    df = df.drop_duplicates(["model", "memory", "device", "method", "draft"], keep="last")
    alpha = paper_alpha(results)
    for device, g in df.groupby("device", sort=True):
        _figure(g, out, device, alpha)
        table = g.sort_values(["model", "memory", "method", "alpha"]).reset_index(drop=True)
        out.table(table, "table_projected_alpha" + suffix(device),
                  f"Projected TPOT against the draft's acceptance on {device_label(device)} ({device})",
                  notes=["Each draft at the acceptance it reached on the tiny proxy; every draft is charged the "
                         "paper's INT4 g128 bytes and time, so only the acceptance moves. A model, not a measurement."])


def _short(draft: str) -> str:
    """"GPTQ INT3 g32" -> "G3/32"."""
    algo, bits, group = draft.split()
    return f"{algo[0]}{bits[3:]}/{group[1:]}"


def _figure(df: pd.DataFrame, out: Output, device: str, alpha: float | None) -> None:
    models = order_models(df["model"].unique())
    methods = order_methods(df["method"].unique())
    colors = method_colors(methods)
    w = 5.0 if len(models) == 1 else 3.4
    fig, axes = subplots(1, len(models), w=w, h=3.0)
    points: dict = {}  # panel -> the points labelled with their drafts, placed once the layout is final
    for ax, model in zip(axes[0], models):
        g = df[df["model"] == model]
        tier = "high" if (g["memory"].astype(str) == "high").any() else str(g["memory"].iloc[0])
        g = g[g["memory"].astype(str) == tier]
        for method in methods:
            m = g[g["method"] == method].sort_values("alpha")
            if m.empty:
                continue
            ax.plot(m["alpha"], m["tpot_ms"], lw=1.0, color=colors[method], alpha=0.6)
            labels: dict[tuple[float, float], list[str]] = {}  # drafts that land on one point share one label
            for a, t, bits, draft in zip(m["alpha"], m["tpot_ms"], m["bits"], m["draft"]):
                ax.plot([a], [t], marker=MARKERS.get(int(bits), "o"), ms=4.5, color=colors[method], ls="none")
                labels.setdefault((round(float(a), 3), round(float(t), 1)), []).append(_short(draft))
            if method == methods[0]:  # one set of labels per panel keeps it readable
                points[ax] = [(a, t, ", ".join(names)) for (a, t), names in labels.items()]
        if alpha is not None:
            ax.axvline(alpha, color="black", lw=0.9, ls="--")
            ax.text(alpha, 1.0, f"paper α {alpha:.3f} ", transform=ax.get_xaxis_transform(), fontsize=7, va="top",
                    ha="right")
        ks = g.groupby("method")["K"].first() if "K" in g.columns else pd.Series(dtype=object)
        K = ", ".join(f"{method_label(m)} {ks[m]}" for m in methods if m in ks.index)
        # short titles (model, tier, K, device): the draft varies per point and is explained in the caption
        style_axes(ax, wrap(f"{model_label(model)}, {tier} memory\nK: {K}\n{device_label(device)}",
                            fig.get_figwidth() / len(models) - 0.6, 10),
                   xlabel="acceptance α (accepted / drafted)", ylabel="projected TPOT (ms)")
    handles = [Line2D([], [], color=colors[m], marker="o") for m in methods]
    labels = [legend_label(m) for m in methods]
    handles += [Line2D([], [], color="#555555", marker=mk, ls="none") for mk in MARKERS.values()]
    labels += [f"{b}-bit draft" for b in MARKERS]
    fig.tight_layout()
    legend_above(fig, handles, labels)
    for ax, pts in points.items():
        place_labels(ax, pts, color=colors[methods[0]])
    caption(fig, f"A model, not a measurement: TPOT projected onto {device_label(device)} (cost model + virtual "
                 "clock driven by the engine's schedule on the tiny proxy). Each point is one draft at the acceptance "
                 f"it reached on the proxy, labelled for {method_label(methods[0])} as G/R = GPTQ/RTN, bits/group; "
                 "every draft is charged the paper's INT4 g128 bytes and time, so along a line only the acceptance "
                 "moves. Dashed line: the paper's measured mean α.")
    out.figure(fig, "fig_projected_alpha" + suffix(device))
