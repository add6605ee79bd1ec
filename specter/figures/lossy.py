"""Which methods are lossy: how many of their tokens match target-only decoding.

A lossless method (speculative decoding verified by the target, offloading) produces target-only's
tokens; a lossy one (MoE-Spec's expert budget) does not, and its speedup buys something else than
the same output. The token match of a method is measured, never assumed, from its records:
`token_match_fraction` where the method computes it against target-only decoding (MoE-Spec, the
engines), else the fraction of its records whose `output_digest` equals target_only's on the same
model, tier, dataset, prompt and repeat. A method is lossy when that match is below 1.
"""

from __future__ import annotations

import pandas as pd

REFERENCE = "target_only"
_PAIR = ["model", "memory", "dataset", "prompt_index", "repeat"]


def token_match(records: pd.DataFrame, keys: tuple[str, ...] = ("variant",)) -> dict:
    """{group: mean token match with target_only over its records}, grouped by `keys` (one key: the value
    itself; several: a tuple), for every group it can be measured for."""
    out: dict = {}
    if records.empty or not set(keys) <= set(records.columns):
        return out
    ref = None
    if {"output_digest", *_PAIR} <= set(records.columns):
        base = records[records["method"] == REFERENCE].drop_duplicates(_PAIR)
        ref = base.set_index(_PAIR)["output_digest"] if not base.empty else None
    for group, g in records.groupby(list(keys), sort=False):
        name = group[0] if len(keys) == 1 else tuple(group)
        if "token_match_fraction" in g.columns:
            frac = pd.to_numeric(g["token_match_fraction"], errors="coerce").dropna()
            if not frac.empty:
                out[name] = float(frac.mean())
                continue
        if ref is None or str(g["method"].iloc[0]) == REFERENCE:
            continue
        keyed = g.drop_duplicates(_PAIR).set_index(_PAIR)["output_digest"]
        common = keyed.index.intersection(ref.index)
        if len(common):
            out[name] = float((keyed[common] == ref[common]).mean())
    return out


def matches_below_target(match: float | None) -> bool:
    """Its tokens differ from target-only greedy decoding somewhere (a measured share below 1)."""
    return match is not None and match < 1.0


def lossy_label(label: str, match: float | None) -> str:
    """A legend entry: the method's label, with its token match when it is lossy."""
    return f"{label} (lossy: {match:.0%} token match)" if matches_below_target(match) else label
