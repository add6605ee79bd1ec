"""Paired speedup ratios with a bootstrap confidence interval, at the prompt as the unit.

A ratio of two methods' mean (or median) TPOTs hides how much it moves from prompt to prompt; on a
noisy machine the spread matters. Pairing each prompt run by both methods gives one ratio per
prompt; their median and a percentile-bootstrap interval of that median say how firm the speedup
is.

The unit is the prompt, not the record. The repeats of a prompt decode the same tokens (one
output digest), so they are timing repeats of one sample, not further samples: counting them as
independent would narrow an interval by about sqrt(repeats) without any new evidence. So each
(method, prompt) is first summarised by the median TPOT over its repeats (`prompt_medians`),
the ratio is taken per prompt, and the bootstrap resamples prompts (`paired_by_prompt`, the one
implementation behind the CLI comparison table, the headline table and the benchmark scripts).
Records flagged for a drifted link (`load_ratio_off` = 1, `flagged_mask`) are left out first and
counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

PROMPT = ("dataset", "prompt_index")  # a prompt: the unit of every interval; `repeat` only times it again


@dataclass(frozen=True)
class PairedRatio:
    median: float  # median of base_i / other_i
    low: float  # lower end of the bootstrap confidence interval of that median
    high: float
    n: int  # pairs


def _checked(values: Sequence[float], name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=float)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a flat sequence of numbers, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name}: non-finite value at index {int(np.flatnonzero(~np.isfinite(arr))[0])}")
    if (arr <= 0).any():
        raise ValueError(f"{name}: non-positive value at index {int(np.flatnonzero(arr <= 0)[0])}")
    return arr


def paired_ratio(base: Sequence[float], other: Sequence[float], *, confidence: float = 0.95,
                 resamples: int = 2000, seed: int = 0) -> PairedRatio:
    """Median of the per-pair ratios `base[i] / other[i]` and a percentile-bootstrap CI of that median.

    `base` and `other` are the same pairs (same prompt and repeat) measured by two methods, e.g. TPOTs
    of the baseline and of the method, so a ratio above 1 is a speedup. The interval resamples the
    pairs with replacement `resamples` times from `numpy.random.default_rng(seed)`, so the output is
    deterministic for a seed. With fewer than 2 pairs there is nothing to resample: `low` and `high`
    equal `median`. Raises ValueError on mismatched lengths, no pairs, or a non-positive or
    non-finite value.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    b, o = _checked(base, "base"), _checked(other, "other")
    if len(b) != len(o):
        raise ValueError(f"mismatched lengths: base has {len(b)} values, other has {len(o)}")
    if len(b) == 0:
        raise ValueError("no pairs")
    ratios = b / o  # [n]
    ci = median_interval(ratios, confidence=confidence, resamples=resamples, seed=seed)
    return PairedRatio(ci.median, ci.low, ci.high, ci.n)


@dataclass(frozen=True)
class MedianInterval:
    median: float  # median of the values
    low: float  # percentile-bootstrap confidence interval of that median
    high: float
    n: int  # values


def bootstrap_indices(n: int, resamples: int, seed: int) -> np.ndarray:
    """The resampled positions of every bootstrap draw: [resamples, n], from default_rng(seed)."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def median_interval(values: Sequence[float], *, confidence: float = 0.95, resamples: int = 2000,
                    seed: int = 0) -> MedianInterval:
    """Median of `values` and a percentile-bootstrap CI of it (deterministic for a seed; fewer than 2
    values: the interval is the median itself). Vectorized; `median_interval_reference` is the same
    computation in plain Python."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    v = np.asarray(values, dtype=float)
    if v.ndim != 1 or len(v) == 0:
        raise ValueError(f"expected a non-empty flat sequence of numbers, got shape {v.shape}")
    if not np.isfinite(v).all():
        raise ValueError(f"non-finite value at index {int(np.flatnonzero(~np.isfinite(v))[0])}")
    median = float(np.median(v))
    if len(v) < 2:
        return MedianInterval(median, median, median, len(v))
    medians = np.median(v[bootstrap_indices(len(v), resamples, seed)], axis=1)  # [resamples]
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    return MedianInterval(median, float(low), float(high), len(v))


def _median_py(values: list[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _percentile_py(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default method)."""
    s = sorted(values)
    pos = q / 100 * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median_interval_reference(values: Sequence[float], *, confidence: float = 0.95, resamples: int = 2000,
                              seed: int = 0) -> MedianInterval:
    """`median_interval` one resample at a time in plain Python, on the same resampled positions."""
    values = [float(x) for x in values]
    median = _median_py(values)
    if len(values) < 2:
        return MedianInterval(median, median, median, len(values))
    medians = [_median_py([values[i] for i in row]) for row in bootstrap_indices(len(values), resamples, seed).tolist()]
    tail = (1 - confidence) / 2 * 100
    return MedianInterval(median, _percentile_py(medians, tail), _percentile_py(medians, 100 - tail), len(values))


def straddles_one(low: float, high: float) -> bool:
    """A ratio's interval that holds 1: the data do not tell which side is faster."""
    return low <= 1.0 <= high


def paired_ratio_median_reference(base: Sequence[float], other: Sequence[float]) -> float:
    """The per-pair ratio median in plain Python: a slow, obvious check on `paired_ratio`."""
    if len(base) != len(other):
        raise ValueError(f"mismatched lengths: base has {len(base)} values, other has {len(other)}")
    ratios = []
    for b, o in zip(base, other):
        if not (math.isfinite(b) and math.isfinite(o)) or b <= 0 or o <= 0:
            raise ValueError(f"non-positive or non-finite pair ({b}, {o})")
        ratios.append(b / o)
    if not ratios:
        raise ValueError("no pairs")
    ratios.sort()
    mid = len(ratios) // 2
    return ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2


def flagged_mask(records: "pd.DataFrame") -> "pd.Series":
    """Records flagged for a drifted link: their effective load ratio was off the configured one by more
    than hardware.load_ratio_tolerance (records.csv `load_ratio_off` = 1); their TPOT measured another link."""
    import pandas as pd

    if "load_ratio_off" not in records.columns:
        return pd.Series(False, index=records.index)
    return pd.to_numeric(records["load_ratio_off"], errors="coerce").fillna(0) > 0


def prompt_medians(records: "pd.DataFrame", value: str = "tpot_ms", prompt: Sequence[str] = PROMPT) -> "pd.Series":
    """The median of `value` over each prompt's timing repeats, indexed by `prompt`; records without a
    finite, positive `value` do not count (a prompt with none is absent)."""
    valid = _valid(records, value)
    return valid.groupby(list(prompt))[value].median()


def _valid(records: "pd.DataFrame", value: str) -> "pd.DataFrame":
    """The records with a finite, positive `value`, as numbers."""
    import pandas as pd

    v = pd.to_numeric(records[value], errors="coerce").to_numpy(dtype=float)
    keep = np.isfinite(v) & (v > 0)
    return records.loc[keep].assign(**{value: v[keep]})


@dataclass(frozen=True)
class PromptPaired:
    """A paired speedup at the prompt level: median over prompts of median(numerator) / median(denominator)."""

    median: float
    low: float  # percentile-bootstrap CI of that median, resampling prompts
    high: float
    prompts: int  # prompts both methods measured: the bootstrap's unit
    records: int  # unflagged records of the two methods behind those prompts
    flagged: int  # records of the two methods left out for a drifted link (load_ratio_off)

    @property
    def straddles_1(self) -> bool:
        return straddles_one(self.low, self.high)


def paired_by_prompt(records: "pd.DataFrame", by: str, numerator: str, denominator: str, *, value: str = "tpot_ms",
                     prompt: Sequence[str] = PROMPT, confidence: float = 0.95, resamples: int = 2000,
                     seed: int = 0) -> PromptPaired | None:
    """The paired ratio numerator / denominator of `value`, prompt by prompt (see the module docstring).

    `records[by]` names the method of each record. Flagged records (`flagged_mask`) of either method
    are left out and counted; each method's remaining records are summarised per prompt by the median
    over repeats; the prompts both have are paired, and `paired_ratio` gives the median of the
    per-prompt ratios with a bootstrap CI over prompts. None when no prompt is shared."""
    two = records[records[by].isin([numerator, denominator])]
    off = flagged_mask(two)
    clean = two[~off]
    num = prompt_medians(clean[clean[by] == numerator], value, prompt)
    den = prompt_medians(clean[clean[by] == denominator], value, prompt)
    shared = num.index.intersection(den.index)
    if len(shared) == 0:
        return None
    r = paired_ratio(num[shared].to_numpy(), den[shared].to_numpy(), confidence=confidence, resamples=resamples,
                     seed=seed)
    used = int(_valid(clean, value).set_index(list(prompt)).index.isin(shared).sum())
    return PromptPaired(r.median, r.low, r.high, r.n, used, int(off.sum()))
