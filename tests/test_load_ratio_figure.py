"""The load-ratio sweep figure: drawn from load_ratio.csv files, kept apart from the main grid."""

from __future__ import annotations

import pandas as pd
import pytest

from specter.figures import load_ratio
from specter.figures.common import Output, Skip
from specter.figures.data import ResultSet

RATIOS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
METHODS = ("target_only", "offload_ar", "mo_sm", "specmoeoff", "specter")


def _sweep(model: str) -> pd.DataFrame:
    rows = []
    for tier in ("high", "low"):
        for r in RATIOS:
            for m in METHODS:
                linked = m != "target_only"
                tpot = 5.0 if not linked else 5.0 + r * (8.0 if m == "offload_ar" else 3.0)
                rows.append({"model": model, "memory": tier, "hardware": "emulated", "method": m, "load_ratio": r,
                             "records": 2, "tpot_ms": tpot,
                             "effective_load_ratio": r * 1.05 if linked else None,
                             "effective_load_ratio_min": r if linked else None,
                             "effective_load_ratio_max": r * 1.1 if linked else None,
                             "load_ratio_off": 0 if linked else None})
    return pd.DataFrame(rows)


def test_figure_and_table_from_load_ratio_csvs(tmp_path):
    root = tmp_path / "results"
    for model in ("tiny_dsv2", "tiny_phi"):
        folder = root / "load_ratio" / model
        folder.mkdir(parents=True)
        _sweep(model).to_csv(folder / "load_ratio.csv", index=False)
    out = Output(tmp_path / "figs")
    out.folder.mkdir()
    load_ratio.build(ResultSet(root), out)
    names = {p.name for p in out.written}
    assert {"fig_load_ratio.png", "fig_load_ratio.pdf", "fig_load_ratio.csv", "fig_load_ratio.md"} <= names
    table = pd.read_csv(out.folder / "fig_load_ratio.csv")
    assert len(table) == 2 * 2 * len(RATIOS) * len(METHODS)
    spec = table[(table.method == "specter") & (table.model == "tiny_dsv2") & (table.memory == "low")]
    assert spec.speedup_vs_offload_ar.to_numpy() == pytest.approx([(5 + 8 * r) / (5 + 3 * r) for r in RATIOS])
    assert "effective_load_ratio" in table.columns
    assert "effective_load_ratio" in (out.folder / "fig_load_ratio.md").read_text()


def test_operating_points_are_the_papers():
    assert load_ratio.operating_point("tiny_dsv2") == 0.7 and load_ratio.operating_point("tiny_qwen") == 0.7
    assert load_ratio.operating_point("tiny_phi") == 6.0


def test_no_sweep_is_a_skip(tmp_path):
    with pytest.raises(Skip, match="load_ratio_sweep"):
        load_ratio.build(ResultSet(tmp_path), Output(tmp_path))


def test_sweep_records_stay_out_of_the_main_grid(tmp_path):
    folder = tmp_path / "load_ratio" / "tiny_dsv2" / "low" / "r=2" / "offload_ar"
    folder.mkdir(parents=True)
    pd.DataFrame([{"method": "offload_ar", "model": "tiny_dsv2", "memory": "low", "dataset": "humaneval",
                   "prompt_index": 0, "repeat": 0, "tpot_ms": 9.0, "new_tokens": 32}]).to_csv(folder / "records.csv",
                                                                                            index=False)
    results = ResultSet(tmp_path)
    assert results.records("main").empty
    assert len(results.records("load_ratio")) == 1
