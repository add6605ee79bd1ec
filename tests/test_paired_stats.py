"""Paired speedups at the right unit: the prompt, not the record.

The repeats of a prompt decode the same tokens; they time one sample again. The statistics
(specter.records.paired.paired_by_prompt, behind both the CLI comparison table and the headline
table) summarise each (method, prompt) by the median over its repeats, pair by prompt, bootstrap
over prompts, and leave flagged records out (counted).
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import pandas as pd
import pytest

from specter.records.paired import bootstrap_indices, paired_by_prompt, paired_ratio


def _identical_repeats(repeats: int, prompts: int = 9) -> pd.DataFrame:
    """offload_ar and specter on `prompts` prompts, every prompt's `repeats` records identical."""
    rng = np.random.default_rng(11)
    spec = rng.uniform(8, 12, prompts)
    ratio = rng.lognormal(np.log(1.3), 0.25, prompts)  # speedups spread around 1.3, some below 1
    rows = []
    for i in range(prompts):
        for r in range(repeats):
            rows.append({"method": "specter", "dataset": "gsm8k", "prompt_index": i, "repeat": r, "tpot_ms": spec[i]})
            rows.append({"method": "offload_ar", "dataset": "gsm8k", "prompt_index": i, "repeat": r,
                         "tpot_ms": spec[i] * ratio[i]})
    return pd.DataFrame(rows)


def test_identical_repeats_do_not_narrow_the_interval():
    """Adding repeats that only re-time the same prompts must not make the interval narrower.

    Under the old record-level statistics every record was a pair: with R identical repeats the
    bootstrap resampled n*R ratios, R copies of each of the n prompt ratios. The median of n*R draws
    from those copies varies less than the median of n draws from the n ratios (its spread falls
    roughly as 1/sqrt(R)), so the interval narrowed as repeats were added although no new prompt was
    seen; the assertion `widths == [widths[0]] * 4` below failed on it (the last block shows that the
    record-level computation does shrink on this very set). Prompt-level statistics see the same n
    per-prompt medians whatever R is, and the same seed draws the same resamples: the width is
    exactly the same.
    """
    widths = []
    for repeats in (1, 2, 4, 8):
        r = paired_by_prompt(_identical_repeats(repeats), "method", "offload_ar", "specter")
        assert r.prompts == 9 and r.records == 2 * 9 * repeats and r.flagged == 0
        widths.append(r.high - r.low)
    assert widths[0] > 0
    assert widths == [widths[0]] * 4

    # the old unit: one "pair" per record; its interval shrinks as identical repeats are added
    old = []
    for repeats in (1, 8):
        df = _identical_repeats(repeats).sort_values(["dataset", "prompt_index", "repeat"])
        ar, sp = df[df.method == "offload_ar"].tpot_ms.to_numpy(), df[df.method == "specter"].tpot_ms.to_numpy()
        rr = paired_ratio(ar, sp)
        old.append(rr.high - rr.low)
    assert old[1] < 0.75 * old[0]


# ---------------------------------------------------------------- a slow, obviously correct reference


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _percentile(xs: list[float], q: float) -> float:
    """numpy's default percentile: linear between the closest ranks."""
    s = sorted(xs)
    pos = q / 100 * (len(s) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def slow_paired(rows: list[dict], by: str, num: str, den: str, seed: int = 0, resamples: int = 2000):
    """Record by record, in plain Python: (median, low, high, prompts, records, flagged) or None."""
    times: dict[tuple, list[float]] = {}
    flagged = 0
    for r in rows:
        if r[by] not in (num, den):
            continue
        if r.get("load_ratio_off") == 1:
            flagged += 1
            continue
        t = r["tpot_ms"]
        if not (isinstance(t, float) and math.isfinite(t) and t > 0):
            continue
        times.setdefault((r[by], r["dataset"], r["prompt_index"]), []).append(t)
    prompts = sorted({k[1:] for k in times if k[0] == num} & {k[1:] for k in times if k[0] == den})
    if not prompts:
        return None
    ratios = [_median(times[(num, *p)]) / _median(times[(den, *p)]) for p in prompts]
    records = sum(len(times[(m, *p)]) for m in (num, den) for p in prompts)
    if len(ratios) < 2:
        m = _median(ratios)
        return m, m, m, len(prompts), records, flagged
    medians = [_median([ratios[i] for i in row]) for row in bootstrap_indices(len(ratios), resamples, seed).tolist()]
    return (_median(ratios), _percentile(medians, 2.5), _percentile(medians, 97.5), len(prompts), records, flagged)


def _grid() -> pd.DataFrame:
    """2 models x 2 tiers x 3 methods x 2 datasets x 3 prompts, 1-3 repeats each; a few flagged records,
    a missing TPOT, and a prompt only specter ran."""
    rng = np.random.default_rng(3)
    rows = []
    for model in ("tiny_dsv2", "tiny_qwen"):
        for memory in ("low", "high"):
            for method, scale in (("specter", 1.0), ("offload_ar", 2.0), ("mo_sm", 1.05)):
                for dataset in ("gsm8k", "humaneval"):
                    for p in range(3 if method != "specter" else 4):
                        for rep in range(int(rng.integers(1, 4))):
                            rows.append({"model": model, "memory": memory, "hardware": "emulated", "method": method,
                                         "variant": method, "dataset": dataset, "prompt_index": p, "repeat": rep,
                                         "tpot_ms": float(10 * scale * rng.lognormal(0, 0.15)),
                                         "load_ratio_off": int(rng.random() < 0.1), "output_digest": f"{dataset}{p}"})
    rows[5]["tpot_ms"] = float("nan")
    return pd.DataFrame(rows)


def test_pairing_over_a_grid_matches_the_slow_reference():
    from specter.figures.headline import paired_table

    grid = _grid()
    table = paired_table(grid).set_index(["model", "memory", "method"])
    assert len(table) == 2 * 2 * 2
    for (model, memory), g in grid.groupby(["model", "memory"]):
        rows = g.to_dict("records")
        for method in ("offload_ar", "mo_sm"):
            fast = paired_by_prompt(g, "variant", method, "specter")
            slow = slow_paired(rows, "variant", method, "specter")
            got = (fast.median, fast.low, fast.high, fast.prompts, fast.records, fast.flagged)
            assert got == pytest.approx(slow, rel=1e-12), (model, memory, method)
            row = table.loc[(model, memory, method)]  # the headline table is the same computation
            assert (row.speedup, row.ci_low, row.ci_high, row.prompts, row.records, row.flagged) == pytest.approx(slow)
            assert row.ci_straddles_1 == (slow[1] <= 1 <= slow[2])
    assert table["flagged"].sum() > 0 and table["prompts"].max() <= 6  # the prompt only specter ran is no pair


def _as_records(df: pd.DataFrame) -> pd.DataFrame:
    """The records.csv columns comparison_table reads besides TPOT, empty."""
    return df.assign(h2d_bytes=float("nan"), oracle_h2d_bytes=float("nan"), acceptance_alpha=float("nan"),
                     mean_accepted_len=float("nan"), new_tokens=32)


def test_cli_comparison_uses_the_same_prompt_level_statistic():
    from specter.experiments.compare import comparison_table

    g = _grid().query("model == 'tiny_qwen' and memory == 'low'")
    t = comparison_table(_as_records(g)).set_index("method")
    for method in ("specter", "mo_sm"):
        slow = slow_paired(g.to_dict("records"), "method", "offload_ar", method)
        row = t.loc[method]
        assert (row.speedup_paired_median, row.speedup_ci_low, row.speedup_ci_high, row.prompts) == \
            pytest.approx(slow[:4])
        assert row.ci_straddles_1 == (slow[1] <= 1 <= slow[2])


def test_a_straddling_cli_cell_says_so(capsys):
    from specter.experiments.compare import comparison_table, print_comparison

    rows = [{"method": m, "dataset": "gsm8k", "prompt_index": p, "repeat": 0, "tpot_ms": t, "output_digest": "x"}
            for p, (a, b) in enumerate([(10, 9), (10, 11), (10, 10.5), (10, 9.5)])
            for m, t in (("offload_ar", a), ("specter", b))]
    t = comparison_table(_as_records(pd.DataFrame(rows)), reference="offload_ar")
    assert bool(t.set_index("method").loc["specter", "ci_straddles_1"])
    assert t.set_index("method").loc["offload_ar", "ci_straddles_1"] is None  # the baseline is 1 by definition
    print_comparison(t, title="t")
    out = capsys.readouterr().out
    assert "∋1" in out and "straddles 1" in out
    assert out.count("∋1") == 2  # specter's row and the caption, never the baseline's [1–1]


def test_flagged_records_are_left_out_and_counted():
    df = _identical_repeats(2)
    base = paired_by_prompt(df, "method", "offload_ar", "specter")
    # a drifted record far off: flagged, it must not move anything
    bad = df.iloc[[0]].assign(repeat=2, tpot_ms=1000.0, load_ratio_off=1)
    r = paired_by_prompt(pd.concat([df.assign(load_ratio_off=0), bad], ignore_index=True),
                         "method", "offload_ar", "specter")
    assert (r.median, r.low, r.high, r.prompts, r.records) == (base.median, base.low, base.high, 9, 36)
    assert r.flagged == 1
