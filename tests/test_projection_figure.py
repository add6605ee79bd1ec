"""make_figures' projected Fig. 14 (specter/figures/projection.py) from experiment=project's CSVs."""

from __future__ import annotations

import csv

import pytest

from specter.harness.project import CSV_FIELDS, TIMELINE_FIELDS


def _write(path, fields, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def _row(model, memory, method, tpot, paper="", source="engine"):
    row = {k: "" for k in CSV_FIELDS}
    row.update(model=model, memory=memory, device="a100_40gb_pcie4", method=method, source=source,
               tpot_ms=str(tpot), paper_tpot_ms=paper, ratio=f"{tpot / float(paper):.4f}" if paper else "")
    return row


def test_projected_fig14_and_window_are_drawn(tmp_path):
    from specter.figures import projection
    from specter.figures.common import Output
    from specter.figures.data import ResultSet

    rows = [_row("dsv2", tier, m, t, "72.2" if m == "specter" and tier == "high" else "")
            for tier in ("high", "low") for m, t in (("offload_ar", 40.0), ("specter", 20.0))]
    rows.append(_row("dsv2", "high", "offload_ar", 99.0, source="replay"))  # a cross-check row: not drawn
    _write(tmp_path / "res" / "dsv2-high" / "projection.csv", CSV_FIELDS, rows)
    ops = [("compute", "L1 draft experts", 0.0, 1.0), ("copy", "h2d L1 expert 3", 0.5, 1.2),
           ("compute", "L1 expert 3", 1.2, 1.3)]
    _write(tmp_path / "res" / "dsv2-high" / "timeline.csv", TIMELINE_FIELDS,
           [dict(zip(TIMELINE_FIELDS, ("dsv2", "high", "a100_40gb_pcie4", "specter", *op))) for op in ops])
    out = Output(tmp_path / "figs")
    out.folder.mkdir()
    projection.build(ResultSet(tmp_path / "res"), out)
    names = {p.name for p in out.written}
    assert {"fig14_projected_tpot.png", "fig_projected_window.png", "table_projected_vs_paper.csv"} <= names
    table = list(csv.DictReader((out.folder / "table_projected_vs_paper.csv").open()))
    ratios = [float(r["ratio"]) for r in table if r["method"] == "specter" and r["memory"] == "high"]
    assert len(table) == 4 and ratios == [pytest.approx(20 / 72.2, abs=1e-4)]


def test_projected_fig14_skips_without_projections(tmp_path, monkeypatch):
    from specter.figures import projection
    from specter.figures.common import Output, Skip
    from specter.figures.data import ResultSet

    monkeypatch.setattr(projection, "_found", lambda results, name: results.csvs(name))  # no results/project fallback
    (tmp_path / "res").mkdir()
    with pytest.raises(Skip, match="no projection.csv"):
        projection.build(ResultSet(tmp_path / "res"), Output(tmp_path))
