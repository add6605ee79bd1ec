"""Median TPOT intervals and paired speedups: the vectorized bootstrap against its plain-Python
reference over a grid of sizes, seeds and levels; determinism; a CI that holds 1 is reported."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from specter.records.paired import (median_interval, median_interval_reference, paired_ratio, straddles_one)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 15, 45])
@pytest.mark.parametrize("seed", [0, 1, 17])
@pytest.mark.parametrize("confidence", [0.8, 0.95])
def test_fast_median_interval_matches_the_reference(n, seed, confidence):
    values = np.random.default_rng(100 + n).lognormal(2.0, 0.4, size=n).tolist()
    fast = median_interval(values, confidence=confidence, resamples=300, seed=seed)
    ref = median_interval_reference(values, confidence=confidence, resamples=300, seed=seed)
    assert fast.n == ref.n == n
    assert fast.median == pytest.approx(ref.median, rel=1e-12)
    assert fast.low == pytest.approx(ref.low, rel=1e-12) and fast.high == pytest.approx(ref.high, rel=1e-12)
    assert fast.low <= fast.median <= fast.high or n < 3


def test_interval_is_deterministic_and_narrows_with_more_records():
    rng = np.random.default_rng(5)
    few, many = rng.normal(10, 2, 8), rng.normal(10, 2, 400)
    assert median_interval(few, seed=3) == median_interval(few, seed=3)
    a, b = median_interval(few), median_interval(many)
    assert (b.high - b.low) < (a.high - a.low)
    assert median_interval([4.0]) .low == median_interval([4.0]).high == 4.0


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="non-empty"):
        median_interval([])
    with pytest.raises(ValueError, match="non-finite"):
        median_interval([1.0, float("nan")])


def test_paired_ratio_is_the_median_interval_of_the_ratios():
    base, other = [10.0, 12.0, 9.0, 11.0, 14.0], [5.0, 6.0, 6.0, 5.5, 7.0]
    r = paired_ratio(base, other, seed=2)
    m = median_interval([b / o for b, o in zip(base, other)], seed=2)
    assert (r.median, r.low, r.high, r.n) == (m.median, m.low, m.high, m.n)


def test_a_ci_holding_one_is_reported_in_the_headline(tmp_path):
    from specter.figures.headline import headline_table, straddling

    rows = []
    rng = np.random.default_rng(0)
    for i in range(6):
        for r in range(2):
            s = 10 + rng.normal(0, 0.5)
            rows += [{"model": "tiny_dsv2", "memory": "low", "hardware": "emulated", "dataset": "gsm8k",
                      "prompt_index": i, "repeat": r, "method": m, "variant": m, "tpot_ms": t, "output_digest": d}
                     for m, t, d in (("specter", s, f"x{i}"), ("offload_ar", 2 * s, f"x{i}"),  # a clear 2x
                                     ("mo_sm", s * (1 + rng.normal(0, 0.2)), f"x{i}"),      # noise around 1
                                     ("target_only", 3 * s, f"x{i}"),
                                     ("moe_spec", 0.9 * s, f"x{i}" if i < 3 else "other"))]  # lossy
    table = headline_table(pd.DataFrame(rows)).set_index(["model", "method"])
    assert table.loc[("tiny_dsv2", "offload_ar"), "speedup"] == pytest.approx(2.0)
    assert not table.loc[("tiny_dsv2", "offload_ar"), "ci_straddles_1"]
    assert table.loc[("tiny_dsv2", "mo_sm"), "ci_straddles_1"]
    assert straddling(table.reset_index()) == ["tiny_dsv2/low mo_sm"]
    assert table.loc[("tiny_dsv2", "moe_spec"), "lossy"] and table.loc[("tiny_dsv2", "moe_spec"), "token_match"] == 0.5
    lossless = table.loc[("ALL", "ALL lossless"), "speedup"]
    kept = [table.loc[("tiny_dsv2", m), "speedup"] for m in ("offload_ar", "mo_sm", "target_only")]
    assert lossless == pytest.approx(np.mean(kept))  # moe_spec left out
    assert straddles_one(0.9, 1.1) and not straddles_one(1.01, 1.3)


def test_drifted_records_are_left_out_of_the_figures_and_counted(tmp_path):
    from specter.figures import tpot_grid
    from specter.figures.common import Output
    from specter.figures.data import ResultSet

    run = tmp_path / "main" / "tiny_dsv2-offload_ar-low"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model:\n  name: tiny_dsv2\nmemory:\n  name: low\nmethod:\n  name: offload_ar\n"
                                     "hardware:\n  name: emulated\n")
    pd.DataFrame([{"method": "offload_ar", "model": "tiny_dsv2", "memory": "low", "dataset": "gsm8k",
                   "prompt_index": i, "repeat": 0, "hardware": "emulated", "new_tokens": 4, "tpot_ms": t,
                   "output_digest": "x", "load_ratio_off": off}
                  for i, (t, off) in enumerate(((10.0, 0), (11.0, 0), (99.0, 1)))]).to_csv(run / "records.csv", index=False)
    results = ResultSet(tmp_path)
    assert results.drifted_count("main") == 1 and len(results.records("main")) == 2
    (tmp_path / "figs").mkdir()
    out = Output(tmp_path / "figs", dpi=40)
    tpot_grid.build(results, out)
    table = pd.read_csv(tmp_path / "figs" / "fig14_tpot.csv")
    assert table["ci_high_ms"].max() <= 11.0  # the drifted 99 ms is not in any interval
    assert "1 record(s) flagged for a drifted link" in (tmp_path / "figs" / "fig14_tpot.md").read_text()
