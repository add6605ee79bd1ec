"""Paired speedup ratios: the median of per-pair ratios, its bootstrap CI, and the compare.csv columns
(paired by prompt: tests/test_paired_stats.py checks the unit)."""

import math

import numpy as np
import pandas as pd
import pytest

from specter.records.paired import PairedRatio, paired_ratio, paired_ratio_median_reference


def test_hand_computed_medians():
    assert paired_ratio([10, 20, 30], [5, 10, 10]).median == 2.0  # ratios [2, 2, 3]
    assert paired_ratio([10, 30, 8, 9], [10, 10, 2, 3]).median == 3.0  # ratios [1, 3, 4, 3], sorted [1, 3, 3, 4]
    r = paired_ratio([6, 8], [3, 2])  # ratios [2, 4]
    assert r.median == 3.0 and r.n == 2 and 2.0 <= r.low <= r.median <= r.high <= 4.0


def test_one_pair_has_a_degenerate_interval():
    assert paired_ratio([9.0], [3.0]) == PairedRatio(3.0, 3.0, 3.0, 1)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 17, 64, 101])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_median_matches_the_plain_python_reference(n, seed):
    rng = np.random.default_rng(seed)
    base, other = rng.uniform(1, 100, n).tolist(), rng.uniform(1, 100, n).tolist()
    assert math.isclose(paired_ratio(base, other).median, paired_ratio_median_reference(base, other), rel_tol=1e-12)


def test_interval_contains_the_median_and_narrows_with_more_pairs():
    rng = np.random.default_rng(7)
    widths = []
    for n in (8, 64, 512):
        other = rng.uniform(5, 15, n)
        base = other * rng.lognormal(np.log(2.0), 0.3, n)  # speedup around 2 with noise
        r = paired_ratio(base, other)
        assert r.low <= r.median <= r.high and r.n == n
        widths.append(r.high - r.low)
    assert widths[0] > widths[1] > widths[2]
    assert 1.8 < r.low <= r.high < 2.2


def test_same_seed_same_output_and_seed_matters():
    rng = np.random.default_rng(3)
    base, other = rng.uniform(1, 10, 30), rng.uniform(1, 10, 30)
    assert paired_ratio(base, other, seed=5) == paired_ratio(base, other, seed=5)
    a, b = paired_ratio(base, other, seed=5), paired_ratio(base, other, seed=6)
    assert a.median == b.median and (a.low, a.high) != (b.low, b.high)


@pytest.mark.parametrize("base, other, match", [
    ([1, 2], [1], "mismatched lengths"),
    ([], [], "no pairs"),
    ([1, 0], [1, 1], "base: non-positive"),
    ([1, 2], [1, -1], "other: non-positive"),
    ([1, float("nan")], [1, 1], "base: non-finite"),
    ([1, 1], [float("inf"), 1], "other: non-finite"),
])
def test_bad_inputs_raise(base, other, match):
    with pytest.raises(ValueError, match=match):
        paired_ratio(base, other)
    with pytest.raises(ValueError):
        paired_ratio_median_reference(base, other)


def test_bad_options_raise():
    with pytest.raises(ValueError, match="confidence"):
        paired_ratio([1, 2], [1, 2], confidence=1.0)
    with pytest.raises(ValueError, match="resamples"):
        paired_ratio([1, 2], [1, 2], resamples=0)


def _records():
    """offload_ar and specter over 4 prompts; specter's per-prompt speedups are 2, 2, 3, 4."""
    ar, sp = [20.0, 40.0, 30.0, 80.0], [10.0, 20.0, 10.0, 20.0]
    n = 4
    return pd.DataFrame({
        "method": ["offload_ar"] * n + ["specter"] * n, "dataset": ["he"] * 2 * n,
        "prompt_index": list(range(n)) * 2, "repeat": [0] * 2 * n, "tpot_ms": ar + sp,
        "output_digest": ["a"] * 2 * n, "acceptance_alpha": [None] * n + [0.9] * n,
        "mean_accepted_len": [None] * n + [4.0] * n, "h2d_bytes": [300.0] * 2 * n,
        "oracle_h2d_bytes": [100.0] * 2 * n, "new_tokens": [10] * 2 * n,
    })


def test_comparison_table_adds_paired_columns():
    from specter.experiments.compare import comparison_table

    rec = _records()
    t = comparison_table(rec).set_index("method")
    assert t.loc["specter", "speedup_vs_offload_ar"] == 35.0 / 15.0  # ratio of median TPOTs, unchanged
    assert t.loc["specter", "speedup_paired_median"] == 2.5  # median of [2, 2, 3, 4]
    assert t.loc["specter", "prompts"] == 4  # one repeat per prompt here: a prompt is a pair
    assert not t.loc["specter", "ci_straddles_1"]
    assert 2.0 <= t.loc["specter", "speedup_ci_low"] <= 2.5 <= t.loc["specter", "speedup_ci_high"] <= 4.0
    assert t.loc["offload_ar", "speedup_paired_median"] == 1.0 and t.loc["offload_ar", "prompts"] == 4
    # a prompt only one method ran, or a missing TPOT, is not a pair
    extra = pd.concat([rec, rec.iloc[[4]].assign(prompt_index=9)], ignore_index=True)
    extra.loc[0, "tpot_ms"] = float("nan")
    t = comparison_table(extra).set_index("method")
    assert t.loc["specter", "prompts"] == 3 and t.loc["specter", "speedup_paired_median"] == 3.0  # [2, 3, 4]


def test_comparison_table_without_the_baseline_has_no_pairs():
    from specter.experiments.compare import comparison_table

    t = comparison_table(_records().query("method == 'specter'")).set_index("method")
    assert t.loc["specter", "prompts"] == 0 and pd.isna(t.loc["specter", "speedup_paired_median"])


def test_printed_table_shows_the_paired_interval(capsys):
    from specter.experiments.compare import comparison_table, print_comparison

    t = comparison_table(_records())
    print_comparison(t, title="t")
    out = capsys.readouterr().out
    row = t.set_index("method").loc["specter"]
    assert "paired ×" in out
    assert f"2.5 [{row.speedup_ci_low:.3g}–{row.speedup_ci_high:.3g}]" in out


def test_printed_table_keeps_every_header_and_cell_whole(capsys):
    """Sixteen columns must not fold a header over two lines or cut a cell to `…` (CI greps for 'TPOT ms')."""
    from specter.experiments.compare import _HEADERS, print_comparison

    cols = ["records", "tpot_ms", "speedup_vs_offload_ar", "speedup_paired_median", "prompts", "acceptance_alpha",
            "tokens_per_iteration", "h2d_mb_per_token", "h2d_over_oracle", "hit_rate",
            "window_experts_vs_independent", "same_tokens_as_target_only", "load_ratio", "effective_load_ratio",
            "load_ratio_off"]
    t = pd.DataFrame([{"method": m, **{c: 123.456 for c in cols}, "speedup_ci_low": 1.0, "speedup_ci_high": 2.0,
                       "ci_straddles_1": None} for m in ("target_only", "offload_ar", "moe_infinity_sm", "specter")])
    print_comparison(t, title="tiny_dsv2 at memory=low, hardware=emulated (results/compare/x/compare.csv)")
    out = capsys.readouterr().out
    assert "…" not in out
    for col in cols:
        assert _HEADERS.get(col, col.replace("_", " ")) in out, col
    assert "moe_infinity_sm" in out and "123" in out
