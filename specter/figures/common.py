"""Shared pieces of every figure: the palette, display names, and the writer of PNG/PDF/CSV/Markdown.

Only pandas, numpy and matplotlib are imported here (and in every module of this package), so
figures can be drawn from an unpacked artifact without torch.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch
import numpy as np
import pandas as pd

from specter.figures.labels import METHOD_LABELS  # noqa: F401  (figures read it from here too)


class Skip(Exception):
    """A figure has no input; the message names what it looked for."""


# Methods the paper compares, in its order; any other method found in the data follows, sorted.
KNOWN_METHODS = ("specter", "specmoeoff", "specmoeoff_artifact", "moe_spec", "mo_sm", "mo_sc", "offload_ar", "vllm",
                 "transformers", "llamacpp", "target_only")
# A colour-blind-safe qualitative palette (Okabe–Ito first, then Tableau), one colour per method.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000",
           "#8C564B", "#7F7F7F", "#BCBD22", "#17BECF", "#9467BD", "#FF9896", "#AEC7E8", "#98DF8A")
# The paper's dataset abbreviations and order (GK, WT, HE, GP, C4), then AVG.
DATASET_LABELS = {"gsm8k": "GK", "wikitext2": "WT", "humaneval": "HE", "gpqa": "GP", "c4": "C4", "AVG": "AVG"}
TIER_ORDER = ("high", "low")
MODEL_ORDER = ("dsv2", "qwen15moe", "phi35moe", "tiny_dsv2", "tiny_qwen", "tiny_phi")
REAL_OF_TINY = {"tiny_dsv2": "dsv2", "tiny_qwen": "qwen15moe", "tiny_phi": "phi35moe"}
MODEL_LABELS = {"dsv2": "DeepSeek-V2-Lite", "qwen15moe": "Qwen1.5-MoE", "phi35moe": "Phi-3.5-MoE"}


def base_method(label: str) -> str:
    """'specter[prefetch=none]' -> 'specter'."""
    return str(label).split("[", 1)[0]


def order_methods(labels: Iterable[str]) -> list[str]:
    """Known methods in the paper's order, variants right after their method, unknown ones sorted."""
    def key(label: str):
        base = base_method(label)
        rank = KNOWN_METHODS.index(base) if base in KNOWN_METHODS else len(KNOWN_METHODS)
        return (rank, base, label != base, label)
    return sorted(set(map(str, labels)), key=key)


def method_colors(labels: Iterable[str]) -> dict[str, str]:
    """One colour per label, stable for a given set: assigned in `order_methods` order."""
    ordered = order_methods(labels)
    return {label: PALETTE[i % len(PALETTE)] for i, label in enumerate(ordered)}


def method_label(label: str) -> str:
    base = base_method(label)
    return METHOD_LABELS.get(base, base) + str(label)[len(base):]


def order_datasets(names: Iterable[str]) -> list[str]:
    known = [d for d in DATASET_LABELS if d != "AVG"]
    names = set(map(str, names))
    return [d for d in known if d in names] + sorted(names - set(known) - {"AVG"}) + (["AVG"] if "AVG" in names else [])


def dataset_label(name: str) -> str:
    return DATASET_LABELS.get(name, name)


def order_models(names: Iterable[str]) -> list[str]:
    names = set(map(str, names))
    return [m for m in MODEL_ORDER if m in names] + sorted(names - set(MODEL_ORDER))


def model_label(name: str) -> str:
    if name in REAL_OF_TINY:
        return f"{name} (mirrors {MODEL_LABELS[REAL_OF_TINY[name]]})"
    return MODEL_LABELS.get(name, name)


def order_tiers(names: Iterable[str]) -> list[str]:
    names = set(map(str, names))
    return [t for t in TIER_ORDER if t in names] + sorted(names - set(TIER_ORDER))


def style_axes(ax, title: str | None = None, xlabel: str | None = None, ylabel: str | None = None) -> None:
    if title:
        ax.set_title(title, fontsize=10, loc="left", fontweight="bold")
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3, linewidth=0.6)
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)


def legend_above(fig, handles, labels, ncol: int | None = None) -> None:
    """One legend for the whole figure, above the panels (never over the data), in as many columns
    (at most `ncol`, default 6) as fit the figure's width: a wider legend would widen the saved
    image past what reads at MAX_WIDTH_PX."""
    ncol = max(1, min(ncol or 6, len(labels)))
    renderer = fig.canvas.get_renderer()
    while True:
        legend = fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=ncol,
                            frameon=False, fontsize=8)
        if ncol == 1 or legend.get_window_extent(renderer).width <= fig.bbox.width:
            return
        legend.remove()
        ncol -= 1


def wrap(text: str, width_in: float, fontsize: float = 10.0, bold: bool = True) -> str:
    """`text` broken into lines of at most the characters that fit `width_in` inches at `fontsize` points
    (an average glyph of the sans face is about 0.6 em wide bold, 0.55 em regular); existing line breaks are
    kept. Panel titles that name a device and a draft are longer than their panel: unbroken, they print over
    the next panel."""
    chars = max(12, int(width_in * 72 / ((0.6 if bold else 0.55) * fontsize)))
    return "\n".join(textwrap.fill(line, chars, break_on_hyphens=False) for line in str(text).splitlines())


def caption(fig, text: str, fontsize: float = 7.5):
    """A caption below everything the figure draws, wrapped to its width; call it after the layout is final
    (tight_layout, legend_above). What a figure is (e.g. a model, not a measurement) reads here in one place
    instead of lengthening every panel title."""
    fig.canvas.draw()  # the tick labels' extents exist only once drawn
    renderer = fig.canvas.get_renderer()
    bottom = min(0.0, fig.get_tightbbox(renderer).y0 / fig.get_figheight())
    return fig.text(0.01, bottom - 0.01, wrap(text, fig.get_figwidth() * 0.98, fontsize, bold=False), ha="left",
                    va="top", fontsize=fontsize, color="#333333")


def thin_tick_labels(fig, axes: Sequence) -> None:
    """Blank every tick label of each axis in `axes` (x axes) that would touch the one kept before it (uneven
    ticks such as K = 4, 8, 16, 32: the small ones crowd); the ticks themselves stay. Call it once the layout is
    final."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for axis in axes:
        last = None
        for label in axis.get_ticklabels():
            if not label.get_visible() or not label.get_text():
                continue
            box = label.get_window_extent(renderer)
            if last is not None and box.x0 <= last.x1 + 2:
                label.set_visible(False)
                continue
            last = box


# Offsets (points) tried in turn for a point's label: beside it first, then further out with a leader line.
LABEL_OFFSETS = tuple((dx * r, dy * r) for r in (1, 2, 3, 4.5) for dx, dy in
                      ((4, 3), (4, -9), (-4, 3), (-4, -9), (0, 6), (0, -13), (8, -3), (-8, -3)))


def place_labels(ax, points: Sequence[tuple[float, float, str]], fontsize: float = 6, color: str = "#222222",
                 ) -> list:
    """Label data points without printing one label over another or over the axes' other texts: each label
    takes the first offset of LABEL_OFFSETS where its box lies inside the axes and clear of every text placed
    so far (a leader line when it sits away from its point); a label with no free place joins the nearest
    placed label's text. Call it once the layout is final (positions are in pixels). Returns the labels."""
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    taken = [t.get_window_extent(renderer) for t in ax.texts if t.get_visible() and t.get_text().strip()]
    placed: list = []

    def fits(box) -> bool:
        inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
        return inside and not any(box.overlaps(b) for b in taken)

    for x, y, text in points:
        for dx, dy in LABEL_OFFSETS:
            far = abs(dx) > 8 or abs(dy) > 13
            label = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=fontsize,
                                color=color, ha="left" if dx > 0 else "right" if dx < 0 else "center",
                                arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "#777777"} if far else None)
            box = label.get_window_extent(renderer)
            if fits(box):
                taken.append(box)
                placed.append(label)
                break
            label.remove()
        else:  # crowded: name it beside its nearest neighbour's label rather than over it
            nearest = min(placed, key=lambda t: (t.xy[0] - x) ** 2 + (t.xy[1] - y) ** 2, default=None)
            if nearest is not None:
                nearest.set_text(f"{nearest.get_text()}, {text}")
    return placed


def grouped_bars(ax, categories: list, series: list[str], table: pd.DataFrame, by: str, index: str, value: str,
                 colors: dict[str, str], error: str | None = None, **bar_kw) -> None:
    """One bar per (category, series), side by side within each category; missing pairs are left out.

    `table` rows: `by` names the series, `index` the category, `value` the bar height (and `error`,
    when given, its error bar)."""
    width = 0.8 / max(1, len(series))
    for i, name in enumerate(series):
        rows = table[table[by] == name].set_index(index)
        present = [c for c in categories if c in rows.index]
        xs = [j + (i - (len(series) - 1) / 2) * width for j, c in enumerate(categories) if c in rows.index]
        kw = dict(bar_kw)
        if error is not None:
            err = [rows.loc[c, error] for c in present]
            if not all(pd.isna(e) for e in err):
                kw.update(yerr=np.nan_to_num(np.asarray(err, dtype=float)), capsize=1.5,
                          error_kw={"elinewidth": 0.6, "ecolor": "#333333"})
        ax.bar(xs, [rows.loc[c, value] for c in present], width=width, color=colors[name], **kw)


# Every figure is read at 1,600 px (a README column, a reviewer's screen): at the default dpi the
# figure's width is capped so the saved PNG (bbox_inches="tight" adds a little) stays within it.
MAX_WIDTH_PX = 1600
DEFAULT_DPI = 150
MAX_WIDTH_IN = 10.2


def subplots(nrows: int, ncols: int, w: float = 3.6, h: float = 2.8, **kw):
    """A grid of panels w × h inches each, narrowed to MAX_WIDTH_IN in all when that is wider."""
    width = min(w * ncols + 0.6, MAX_WIDTH_IN)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, h * nrows + 0.4), squeeze=False, **kw)
    return fig, axes


def markdown_table(df: pd.DataFrame, floatfmt: str = ".4g") -> str:
    """A GitHub-flavoured Markdown table (no extra dependency)."""
    def cell(v) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return ""
        if isinstance(v, (float, np.floating)):
            return format(float(v), floatfmt)
        if isinstance(v, (bool, np.bool_)):
            return "yes" if v else ""
        return str(v).replace("|", "\\|")
    cols = [str(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


@dataclass
class Output:
    """Where one make_figures call writes; remembers every file it wrote."""

    folder: Path
    dpi: int = DEFAULT_DPI
    written: list[Path] = field(default_factory=list)

    def figure(self, fig, name: str) -> None:
        for ext in ("png", "pdf"):
            path = self.folder / f"{name}.{ext}"
            fig.savefig(path, dpi=self.dpi, bbox_inches="tight", metadata=_metadata(ext))
            self.written.append(path)
        plt.close(fig)

    def table(self, df: pd.DataFrame, name: str, title: str, notes: Sequence[str] = (),
              floatfmt: str = ".4g", display: pd.DataFrame | None = None) -> pd.DataFrame:
        """df as CSV (numbers) and Markdown (`display` when given: the same rows with text in some cells)."""
        csv = self.folder / f"{name}.csv"
        df.to_csv(csv, index=False)
        md = self.folder / f"{name}.md"
        shown = df if display is None else display
        body = [f"### {title}", "", *[f"{n}" for n in notes], *([""] if notes else []), markdown_table(shown, floatfmt), ""]
        md.write_text("\n".join(body))
        self.written += [csv, md]
        return df


def _metadata(ext: str) -> dict:
    # no creation dates: the same CSVs give byte-identical PDFs (and stable checksums)
    return {"CreationDate": None} if ext == "pdf" else {}


def percentile(values: pd.Series, q: float) -> float:
    """Linear-interpolated percentile (numpy's default), NaN for an empty series."""
    v = pd.to_numeric(values, errors="coerce").dropna().to_numpy()
    return float(np.percentile(v, q)) if len(v) else float("nan")


def ratio_bars(out: "Output", table: pd.DataFrame, name: str, value: str, ylabel: str,
               labels: dict[str, str] | None = None) -> None:
    """One panel per model, bars per memory tier and method (`table`: model, memory, method, `value`),
    a dashed line at 1: the shape of every "this over that" figure. `labels`: method -> legend
    label (default: `labels.legend_label` of the method, lossy ones marked)."""
    from specter.figures.labels import legend_label

    labels = labels or {}
    methods = order_methods(table["method"])
    colors = method_colors(methods)
    models = order_models(table["model"])
    fig, axes = subplots(1, len(models), w=3.6, h=2.8)
    for ax, model in zip(axes[0], models):
        d = table[table["model"] == model]
        tiers = order_tiers(d["memory"])
        present = [m for m in methods if m in set(d["method"])]
        grouped_bars(ax, tiers, present, d, by="method", index="memory", value=value, colors=colors)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks(range(len(tiers)), [f"{t} memory" for t in tiers])
        style_axes(ax, model_label(model).replace(" (", "\n(", 1), ylabel=ylabel)  # two lines: panels are narrow
    legend_above(fig, [Patch(color=colors[m]) for m in methods], [labels.get(m) or legend_label(m) for m in methods])
    fig.tight_layout()
    out.figure(fig, name)
