"""No figure make_figures draws prints one text over another, and every projected figure says it is a model.

Every figure module of make_figures (specter/figures/cli.py FIGURES) builds from the shipped reference result set
(results/reference, the set tests/test_reference_figures.py redraws); each figure is checked where Output.figure
would save it, instead of being saved (drawing PNG and PDF twice would only slow the test): the figure is drawn
(Agg) and the window extents of its visible texts (titles, suptitle, axis labels, the tick labels drawn, legend
texts, annotations, free texts) are compared pairwise. Two texts overlap when their boxes share more than
TOLERANCE_PX in both directions.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from matplotlib.text import Text

from specter.figures.cli import FIGURES
from specter.figures.common import Output, Skip
from specter.figures.data import ResultSet

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "results" / "reference"
TOLERANCE_PX = 1.0
# the modules whose figures are projections onto a modelled machine (a model, not a measurement)
PROJECTED = ("projection", "projected_batching", "projected_alpha")


def _drawn_ticks(axis) -> list:
    """The ticks an axis draws: those inside its view interval (the others keep stale labels that are not drawn)."""
    update = getattr(axis, "_update_ticks", None)
    if update is not None:
        return list(update())
    return axis.get_major_ticks() + axis.get_minor_ticks()


def _describe(text: Text) -> str:
    """The text and where it sits: the panel (its title's first line) or the figure."""
    ax = text.axes
    if ax is None:  # tick labels carry no axes: find the panel whose axis holds them
        ax = next((a for a in text.figure.axes for axis in (a.xaxis, a.yaxis)
                   if any(text in (t.label1, t.label2) for t in axis.get_major_ticks() + axis.get_minor_ticks())),
                  None) if text.figure is not None else None
    if ax is None:
        return f"{text.get_text()!r} (figure)"
    title = ax.get_title(loc="left") or ax.get_title() or f"panel {text.figure.axes.index(ax)}"
    return f"{text.get_text()!r} in panel {title.splitlines()[0]!r}"


def visible_texts(fig) -> list[Text]:
    """Every Text the drawn figure shows, non-empty; of the tick labels, only those of the ticks drawn."""
    tick_labels: set[int] = set()  # every tick's labels, drawn or not: findobj would return the stale ones too
    drawn: list[Text] = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                tick_labels.update((id(tick.label1), id(tick.label2)))
            for tick in _drawn_ticks(axis):
                drawn += [label for label in (tick.label1, tick.label2) if tick.get_visible()]
    texts = drawn + [t for t in fig.findobj(Text) if id(t) not in tick_labels]
    out, seen = [], set()
    for text in texts:
        if id(text) in seen or not text.get_text().strip() or not _really_visible(text):
            continue
        seen.add(id(text))
        out.append(text)
    return out


def _really_visible(text: Text) -> bool:
    """The text and the panel holding it are shown."""
    return text.get_visible() and (text.axes is None or text.axes.get_visible())


def overlaps(fig) -> list[tuple[str, str]]:
    """Pairs of texts of a drawn figure whose boxes overlap by more than TOLERANCE_PX (described for a message)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = []
    for text in visible_texts(fig):
        box = text.get_window_extent(renderer)
        if box.width > 0 and box.height > 0:
            boxes.append((text, box))
    found = []
    for (a, ba), (b, bb) in itertools.combinations(boxes, 2):
        dx = min(ba.x1, bb.x1) - max(ba.x0, bb.x0)
        dy = min(ba.y1, bb.y1) - max(ba.y0, bb.y0)
        if dx > TOLERANCE_PX and dy > TOLERANCE_PX:
            found.append((_describe(a), _describe(b)))
    return found


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """Figure name -> (module name, overlapping text pairs, every text of the figure), for every figure the
    reference set draws."""
    if not REFERENCE.is_dir():
        pytest.skip("no committed reference result set")
    seen: dict[str, tuple[str, list, list[str]]] = {}
    results = ResultSet(REFERENCE, REPO / "results" / "paper")
    out = Output(tmp_path_factory.mktemp("figs"))
    module_of = {}

    def check(self, fig, name):
        import matplotlib.pyplot as plt

        pairs = overlaps(fig)
        seen[name] = (module_of["now"], pairs, [t.get_text() for t in visible_texts(fig)])
        plt.close(fig)

    mp = pytest.MonkeyPatch()
    mp.setattr(Output, "figure", check)
    try:
        for _, module in FIGURES:
            module_of["now"] = module.__name__.rsplit(".", 1)[1]
            try:
                module.build(results, out)
            except Skip:
                pass
    finally:
        mp.undo()
    return seen


def test_the_check_sees_overprinted_texts_and_crowded_ticks():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.set_title("a panel", loc="left")
    ax.text(0.5, 0.5, "one label")
    ax.text(0.5, 0.5, "another label")
    ax.set_xticks([1.0, 1.01], ["first tick", "second tick"])
    ax.text(0.1, 0.9, "")  # empty: never counted
    found = overlaps(fig)
    plt.close(fig)
    assert ("'one label' in panel 'a panel'", "'another label' in panel 'a panel'") in found
    assert ("'first tick' in panel 'a panel'", "'second tick' in panel 'a panel'") in found
    assert len(found) == 2, found


def test_every_module_draws_from_the_reference_set(drawn):
    modules = {m for m, _, _ in drawn.values()}
    # headline and paper_compare write tables only; every other module draws from the reference set
    drawing = {"k_sweep", "timeline", "draft_kernel", "routing", "tpot_grid", "batching", "io_oracle", "staging",
               "verify_schedule", "load_ratio", "projection", "projected_batching", "projected_alpha"}
    assert drawing <= modules, sorted(drawing - modules)


def test_no_text_overprints_another(drawn):
    bad = {name: pairs for name, (_, pairs, _) in drawn.items() if pairs}
    lines = [f"{name}: {a} overlaps {b}" for name, pairs in sorted(bad.items()) for a, b in pairs]
    assert not bad, f"{len(lines)} overlapping text pairs in {len(bad)} figure(s):\n" + "\n".join(lines)


def _says_model(text: str) -> bool:
    """A title or caption that calls the figure a model of a named device (not a panel that merely names one)."""
    from specter.figures.projection import DEVICE_LABELS

    return bool(re.search(r"\bmodel\b", text, re.IGNORECASE)) and any(d in text for d in DEVICE_LABELS.values())


def test_every_projected_figure_says_it_is_a_model(drawn):
    projected = {name: texts for name, (module, _, texts) in drawn.items() if module in PROJECTED}
    assert {"fig14_projected_tpot", "fig_projected_window", "fig15_projected_batch", "fig_projected_alpha"} <= set(
        projected), sorted(projected)
    silent = sorted(name for name, texts in projected.items() if not any(_says_model(t) for t in texts))
    assert not silent, f"projected figures with no text calling them a model of their device: {silent}"
