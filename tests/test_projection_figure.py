"""make_figures' projected figures (specter/figures/projection.py, projected_batching.py, projected_alpha.py) from
experiment=project's CSVs: each is drawn, one per device file, and every title names the device and the draft."""

from __future__ import annotations

import csv

import pytest

from specter.experiments.project import BATCH_VS_PAPER_FIELDS, CSV_FIELDS, TIMELINE_FIELDS

A100, H200 = "A100 40 GB, PCIe 4.0 x16", "H200, PCIe 5.0 x16"


def _write(path, fields, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(rows)


def _row(model, memory, method, tpot, paper="", source="engine", device="a100_40gb_pcie4", k_source="paper", K=""):
    row = {k: "" for k in CSV_FIELDS}
    row.update(model=model, memory=memory, device=device, method=method, source=source, k_source=k_source, K=K,
               draft="GPTQ INT4 g128" if method == "specter" else "",
               tpot_ms=str(tpot), paper_tpot_ms=paper, ratio=f"{tpot / float(paper):.4f}" if paper else "",
               loads_per_token=f"{tpot / 0.731:.4f}", loads_over_belady="1.2000",
               belady_loads_per_token=f"{tpot / 0.731 / 1.2:.4f}", specter_belady_loads_per_token="20.0000")
    return row


@pytest.fixture
def titles(monkeypatch):
    """Figure name -> every axes' title, captured as each figure is saved; "<name>:texts" -> the figure's own
    texts (its caption)."""
    from specter.figures.common import Output

    seen: dict[str, list[str]] = {}
    save = Output.figure

    def figure(self, fig, name):
        seen[name] = [ax.get_title(loc="left") for ax in fig.axes]
        seen[name + ":texts"] = [t.get_text() for t in fig.texts]
        save(self, fig, name)

    monkeypatch.setattr(Output, "figure", figure)
    return seen


def _out(tmp_path):
    from specter.figures.common import Output

    out = Output(tmp_path / "figs")
    out.folder.mkdir()
    return out


def test_projected_fig14_and_window_are_drawn_per_device(tmp_path, titles):
    from specter.figures import projection
    from specter.figures.data import ResultSet

    rows = [_row("dsv2", tier, m, t, "72.2" if m == "specter" and tier == "high" else "", K="16" if m == "specter" else "")
            for tier in ("high", "low") for m, t in (("offload_ar", 40.0), ("specter", 20.0))]
    rows.append(_row("dsv2", "high", "specter", 18.0, "72.2", k_source="profiled", K="24"))
    rows.append(_row("dsv2", "high", "offload_ar", 99.0, source="replay"))  # a cross-check row: not drawn
    _write(tmp_path / "res" / "dsv2-high" / "projection.csv", CSV_FIELDS, rows)
    _write(tmp_path / "res" / "dsv2-high-h200" / "projection.csv", CSV_FIELDS,
           [_row("dsv2", "high", "specter", 9.0, device="h200_pcie5", K="16")])
    ops = [("compute", "L1 draft experts", 0.0, 1.0), ("copy", "h2d L1 expert 3", 0.5, 1.2),
           ("compute", "L1 expert 3", 1.2, 1.3)]
    _write(tmp_path / "res" / "dsv2-high" / "timeline.csv", TIMELINE_FIELDS,
           [dict(zip(TIMELINE_FIELDS, ("dsv2", "high", "a100_40gb_pcie4", "GPTQ INT4 g128", "specter", 24, *op)))
            for op in ops])
    out = _out(tmp_path)
    projection.build(ResultSet(tmp_path / "res"), out)
    names = {p.name for p in out.written}
    assert {"fig14_projected_tpot.png", "fig_projected_window.png", "table_projected_vs_paper.csv",
            "fig14_projected_tpot_h200_pcie5.png", "table_projected_vs_paper_h200_pcie5.csv"} <= names
    table = list(csv.DictReader((out.folder / "table_projected_vs_paper.csv").open()))
    assert "specter_belady_loads_per_token" in table[0] and "loads_over_belady" in table[0]
    ratios = [(r["k_source"], float(r["ratio"])) for r in table if r["method"] == "specter" and r["memory"] == "high"]
    assert len(table) == 5 and sorted(ratios) == [("paper", pytest.approx(20 / 72.2, abs=1e-4)),
                                                  ("profiled", pytest.approx(18 / 72.2, abs=1e-4))]
    assert {r["device"] for r in table} == {"a100_40gb_pcie4"}  # the H200's rows have a table of their own
    for name, device in (("fig14_projected_tpot", A100), ("fig14_projected_tpot_h200_pcie5", H200),
                         ("fig_projected_window", A100)):
        drawn = [t for t in titles[name] if t]
        assert drawn and all(device in t and "GPTQ INT4 g128" in t for t in drawn), (name, drawn)
    md = (out.folder / "table_projected_vs_paper_h200_pcie5.md").read_text().splitlines()[0]
    assert H200 in md and "GPTQ INT4 g128" in md


def test_projected_fig14_skips_without_projections(tmp_path, monkeypatch):
    from specter.figures import projection
    from specter.figures.common import Output, Skip
    from specter.figures.data import ResultSet

    monkeypatch.setattr(projection, "_found", lambda results, name: results.csvs(name))  # no results/project fallback
    (tmp_path / "res").mkdir()
    with pytest.raises(Skip, match="no projection.csv"):
        projection.build(ResultSet(tmp_path / "res"), Output(tmp_path))


def _batch_rows(device):
    from specter.projection.batching import BATCH_FIELDS

    rows = []
    for method, t1 in (("specter", 30.0), ("specmoeoff", 50.0)):
        for B in (1, 2, 4, 8, 16, 32):
            rows.append({f: "" for f in BATCH_FIELDS} | {
                "model": "dsv2", "memory": "high", "device": device, "draft": "GPTQ INT4 g128", "method": method,
                "K": "16", "batch_size": str(B), "tpot_ms": str(t1 * (1 + B / 20)), "throughput_tok_s": str(30 * B),
                "tpot_vs_b1": "1", "throughput_vs_b1": "1"})
    return rows


def test_projected_batching_is_drawn_beside_the_paper(tmp_path, titles):
    from specter.figures import projected_batching
    from specter.figures.data import ResultSet
    from specter.projection.batching import BATCH_FIELDS

    for device in ("a100_40gb_pcie4", "h200_pcie5"):
        folder = tmp_path / "res" / f"dsv2-high-{device}"
        _write(folder / "batch_projection.csv", BATCH_FIELDS, _batch_rows(device))
        _write(folder / "batch_vs_paper.csv", BATCH_VS_PAPER_FIELDS, [
            {"model": "dsv2", "memory": "high", "device": device, "draft": "GPTQ INT4 g128", "claim": "batch_tpot_ratio",
             "method": "specter", "baseline": "", "batch_from": "1", "batch_to": "32", "paper": "1.65",
             "projected": "2.1"}])
    out = _out(tmp_path)
    projected_batching.build(ResultSet(tmp_path / "res"), out)
    names = {p.stem for p in out.written}
    assert {"fig15_projected_batch", "table3_projected_batch", "table3_projected_vs_paper",
            "fig15_projected_batch_h200_pcie5", "table3_projected_batch_h200_pcie5"} <= names
    for name, device in (("fig15_projected_batch", A100), ("fig15_projected_batch_h200_pcie5", H200)):
        first = titles[name][0]
        assert device in first and "GPTQ INT4 g128" in first, first
    table = list(csv.DictReader((out.folder / "table3_projected_batch.csv").open()))
    assert sorted({int(r["batch_size"]) for r in table}) == [1, 2, 4, 8, 16, 32] and len(table) == 12


def test_projected_alpha_curve_marks_the_papers_alpha(tmp_path, titles):
    from specter.figures import projected_alpha
    from specter.figures.data import ResultSet
    from specter.projection.alpha import ALPHA_FIELDS

    rows = [{"model": "qwen15moe", "memory": "high", "device": "a100_40gb_pcie4", "method": m, "K": "8",
             "draft": f"GPTQ INT{b} g128", "bits": str(b), "group": "128", "algo": "gptq", "alpha": str(a),
             "tpot_ms": str(30 / a), "loads_per_token": "30"}
            for m in ("specter", "specmoeoff") for b, a in ((4, 0.99), (3, 0.9), (2, 0.5))]
    _write(tmp_path / "res" / "q" / "alpha_curve.csv", ALPHA_FIELDS, rows)
    out = _out(tmp_path)
    projected_alpha.build(ResultSet(tmp_path / "res", tmp_path / "no-paper"), out)
    assert {"fig_projected_alpha", "table_projected_alpha"} <= {p.stem for p in out.written}
    drawn = [t for t in titles["fig_projected_alpha"] if t]
    assert drawn and all(A100 in t for t in drawn)
    note = " ".join(titles["fig_projected_alpha:texts"])  # the caption: a model, each point one draft
    assert "model, not a measurement" in note and A100 in note and "one draft" in note, note
    assert projected_alpha.paper_alpha(ResultSet(tmp_path / "res")) == pytest.approx(0.9663)
