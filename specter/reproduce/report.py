"""The closing summary: one row per step (reproduced, done earlier, skipped and why, failed and why,
its duration), each error once with the steps that hit it, and a line per figure saying whether it
was drawn from this run's own results or why not (and where the shipped reference has it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from specter.reproduce.datasets import DatasetDecision
from specter.reproduce.estimate import minutes
from specter.reproduce.execute import DONE, FAILED, REPRODUCED, Outcome
from specter.reproduce.plan import Step

REFERENCE = "results/reference"
RESULT_WIDTH = 90  # the result column of the table; the full text is in the error list or the log
# which steps feed each figure of make_figures (its titles in figures/index.md)
FIGURE_INPUTS: dict[str, Callable[[Step], bool]] = {
    "Fig. 7 K sweep": lambda s: s.kind == "k_sweep",
    "Figs. 8/9 planner timeline": lambda s: s.kind == "trace",
    "Figs. 10/11 draft kernel": lambda s: s.name.endswith("bench-draft-kernel"),
    "Fig. 13 routing diversity": lambda s: s.kind == "main" and "specter" in s.name,
    "Fig. 14 TPOT grid": lambda s: s.kind == "main",
    "Headline speedups": lambda s: s.kind == "main",
    "Figs. 15/16 + Table 3 batching": lambda s: s.kind == "batch",
    "I/O vs oracle": lambda s: s.kind == "main",
    "Staging-buffer ablation": lambda s: s.kind == "ablation",
    "Verification schedule": lambda s: s.name.endswith("bench-verify"),
    "Paper vs here": lambda s: s.kind in ("main", "k_sweep", "batch"),
}


def _result(o: Outcome, error_label: dict[str, str] | None = None) -> str:
    if o.status == DONE:
        return o.status
    if o.status == FAILED and error_label and o.step.name in error_label:
        exit = f"exit {o.rc}: " if o.rc is not None else ""
        return f"failed ({exit}error {error_label[o.step.name]} below)"
    text = f"{o.status} ({o.why})" if o.why else o.status
    return text if len(text) <= RESULT_WIDTH else text[:RESULT_WIDTH - 4] + " ..."


def error_groups(outcomes: list[Outcome]) -> tuple[list[str], dict[str, str]]:
    """Each distinct error once (E1, E2, ...) under the steps that reported it; step -> its label."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for o in outcomes:
        if o.status == FAILED:
            groups.setdefault(tuple(o.detail) or (o.why,), []).append(o.step.name)
    out, labels = [], {}
    for k, (detail, names) in enumerate(groups.items(), start=1):
        labels.update({n: f"E{k}" for n in names})
        more = f" and {len(names) - 1} more step(s) with the same error: {', '.join(names[1:])}" if names[1:] else ""
        out.append(f"E{k}: {names[0]}{more}")
        out.extend(f"    {line}" for line in detail)
    return out, labels


def step_table(outcomes: list[Outcome], error_label: dict[str, str] | None = None) -> list[str]:
    rows = [("step", "result", "time")] + [
        (o.step.name, _result(o, error_label), "-" if o.seconds is None else f"{o.seconds:.0f} s") for o in outcomes]
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    out = [f"{r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]:>6}".rstrip() for r in rows]
    out.insert(1, "-" * min(len(out[0]) + 8, 160))
    return out


def read_index(figures: Path) -> list[tuple[str, str, str]]:
    """(figure, status, files) rows of make_figures' index.md."""
    try:
        lines = (figures / "index.md").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("figure", "---"):
            rows.append((cells[0], cells[1], cells[2]))
    return rows


def figure_lines(outcomes: list[Outcome], figures: Path, results: Path) -> list[str]:
    """A line per figure: drawn from this run's results (noting steps that did not finish) or why not."""
    fig = next((o for o in outcomes if o.step.kind == "figures"), None)
    reference = f"the shipped reference: {REFERENCE}/ (python make_figures.py --results {REFERENCE})"
    if fig is None or fig.status not in (REPRODUCED, FAILED):
        return [f"figures were not drawn ({_result(fig) if fig else 'no figures step'}); {reference}"]
    rows = read_index(figures)
    if not rows:
        return [f"make_figures wrote no {figures}/index.md; {reference}"]
    out = []
    for title, status, files in rows:
        feeds = FIGURE_INPUTS.get(title, lambda s: False)
        unfinished = [o.step.name for o in outcomes if feeds(o.step) and o.status not in (REPRODUCED, DONE)]
        if status == "written":
            note = f" (without {len(unfinished)} unfinished step(s): {', '.join(unfinished[:4])}" \
                   f"{', ...' if len(unfinished) > 4 else ''})" if unfinished else ""
            out.append(f"{title}: drawn from this run's results in {results}/{note}")
        else:
            because = f"; its steps did not finish: {', '.join(unfinished[:4])}" if unfinished else ""
            out.append(f"{title}: NOT drawn from this run ({status}{because}); {reference}")
    return out


def summary(outcomes: list[Outcome], decision: DatasetDecision, mode: str, seconds: float, results: Path,
            figures: Path, logs: Path) -> list[str]:
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    lines = [f"== summary ({mode}, {minutes(seconds)}) ==", decision.summary(),
             ", ".join(f"{n} {k}" for k, n in counts.items()), ""]
    errors, labels = error_groups(outcomes)
    lines += step_table(outcomes, labels)
    if errors:
        lines += ["", "errors (each once; the full output is in the step's log):"] + ["  " + e for e in errors]
    lines += ["", f"figures ({figures}/; index.md lists every file):"]
    lines += ["  " + f for f in figure_lines(outcomes, figures, results)]
    lines += ["", f"results: {results}/   logs: {logs}/   figures: {figures}/"]
    return lines


def write_summary(lines: list[str], results: Path) -> Path | None:
    """Keep the summary beside the results (reproduce_summary.md); None if it cannot be written."""
    path = results / "reproduce_summary.md"
    try:
        results.mkdir(parents=True, exist_ok=True)
        path.write_text("```\n" + "\n".join(lines) + "\n```\n", encoding="utf-8")
    except OSError:
        return None
    return path
