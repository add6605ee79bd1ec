"""Which records belong together: a record's source (main grid, trace, bench, batch) and its method label.

Two runs of one method are one method unless a setting that changes what the method *does*
differs between them. Settings that only change how a run is observed or where it is written
(`MEASUREMENT_KEYS`) never split a method. A run that traced its windows (`method.trace_windows`)
timed every copy on the host and paid for writing each event, so its times are not the
method's: it is its own source, "trace", drawn by the timeline figure and the traced-runs
table, never in Fig. 14 or the headline. Ablations (a `bench` or `ablation` folder, e.g. the
staging-buffer ablation) are side benchmarks: they keep the main grid to one configuration per
method, so the headline always finds a bare "specter". A lossy method (`is_lossy`: the registry's `lossy`)
carries its token match in its legend label (`legend_label`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from specter.assembly.runners import is_method

# Keys (the last part of a dotted config key) that observe or place a run and do not change it.
MEASUREMENT_KEYS = ("trace_windows", "progress", "output_dir", "recalibrate", "retime_per_record", "allow_hub",
                    "assets_dir",
                    "verify_lossless", "lossless_tie_tolerance")
# Display names of the methods (every legend and table; common.py re-exports them).
METHOD_LABELS = {
    "specter": "Specter", "specmoeoff": "SpecMoEOff", "specmoeoff_artifact": "SpecMoEOff (artifact preset)",
    "moe_spec": "MoE-Spec", "mo_sm": "MO-SM",
    "mo_sc": "MO-SC", "offload_ar": "Offload-AR", "vllm": "vLLM", "transformers": "Transformers",
    "llamacpp": "llama.cpp", "target_only": "Target only",
}
SOURCES = ("main", "trace", "bench", "batch")


def is_measurement_key(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in MEASUREMENT_KEYS


def method_settings(method_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The settings that define a method's behaviour: its flattened config less name and measurement keys."""
    return {k: v for k, v in method_cfg.items() if k != "name" and not is_measurement_key(k)}


def record_source(rel_parts: Sequence[str], method_cfg: Mapping[str, Any]) -> str:
    """Where a records.csv belongs, from its folder below the result root and its run's method config."""
    if any(p.startswith("B=") for p in rel_parts):
        return "batch"
    if "bench" in rel_parts or "ablation" in rel_parts:  # side benchmarks and ablations (prefetch, staging)
        return "bench"
    if bool(method_cfg.get("trace_windows")) or "trace" in rel_parts:
        return "trace"
    if "load_ratio" in rel_parts:  # experiment=load_ratio_sweep (read through load_ratio.csv)
        return "load_ratio"
    return "main"



TOKEN_MATCH = "token_match_fraction"  # the records' column: share of target-only's tokens reproduced


def is_lossy(label: str) -> bool:
    """Whether a method (or a variant label such as 'moe_spec[budget=4]') is lossy by design: its output may
    differ from target-only decoding (not by a tie), the registry's `lossy` fact. Such a method is marked in
    every legend and kept out of lossless means."""
    return is_method(str(label).split("[", 1)[0], lossy=True)


def split_variant(label: str) -> tuple[str, dict[str, str]]:
    """'specter[K=16,prefetch=none]' -> ('specter', {'K': '16', 'prefetch': 'none'}); a bare name -> (name, {})."""
    label = str(label)
    if "[" not in label or not label.endswith("]"):
        return label, {}
    base, inner = label[:-1].split("[", 1)
    parts = re.split(r",(?=[A-Za-z_][\w.]*=)", inner)  # a value may itself hold commas ('[1, 2]')
    return base, dict(p.split("=", 1) if "=" in p else (p, "") for p in parts if p)


def compact_variants(table: pd.DataFrame, column: str = "method", cell: Sequence[str] = ("model", "memory")
                     ) -> pd.Series:
    """Variant labels cut to the settings that differ between the variants of one method left in
    `table` within one cell: 'specter[K=16,decode_path=None,prefetch=none]' beside its other
    prefetch variants becomes 'specter[prefetch=none]', and a method with one variant its bare name.
    The same variant in two cells gets one label (one colour, one legend entry)."""
    out = table[column].astype(str).copy()
    keys = [c for c in cell if c in table.columns]
    parsed = out.map(split_variant)
    bases = parsed.map(lambda p: p[0])
    groups = table.groupby([*(table[k].astype(str) for k in keys), bases]) if keys else table.groupby(bases)
    for _, g in groups:
        settings = [parsed[i][1] for i in g.index]
        names = sorted({k for s in settings for k in s})
        varying = [k for k in names if len({s.get(k) for s in settings}) > 1]
        for i, s in zip(g.index, settings):
            out[i] = parsed[i][0] + (f"[{','.join(f'{k}={s.get(k)}' for k in varying)}]" if varying else "")
    return out


def legend_label(label: str, token_match: float | None = None) -> str:
    """A method's legend label, in words, marked when the method is lossy.

    `label`: a method name or variant label ('moe_spec', 'specter[prefetch=none]'); `token_match`:
    the share (0..1) of target-only's tokens the method reproduced, e.g. the mean of the records'
    `token_match_fraction` (`token_match_of`), or None when not measured. Returns the display name
    with the variant's settings in parentheses ('Specter (prefetch=none)'); a lossy method adds
    'lossy' and its token match: 'MoE-Spec (lossy, 45 % tokens match)', or 'MoE-Spec (lossy)'
    without a measurement. Stable signature: every figure with a legend of methods uses it.
    """
    base, settings = split_variant(label)
    notes = [", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in settings.items())] if settings else []
    if is_lossy(base):
        if token_match is None or (isinstance(token_match, float) and math.isnan(token_match)):
            notes.append("lossy")
        else:
            notes.append(f"lossy, {100 * float(token_match):.0f} % tokens match")
    name = METHOD_LABELS.get(base, base)
    return f"{name} ({'; '.join(notes)})" if notes else name


def token_match_of(records: pd.DataFrame, by: str = "method") -> dict[str, float]:
    """Mean `token_match_fraction` per value of `by` (a method or variant column), over the records
    that carry one; labels without any are absent (legend_label then says just 'lossy')."""
    if records is None or records.empty or TOKEN_MATCH not in records or by not in records:
        return {}
    values = pd.to_numeric(records[TOKEN_MATCH], errors="coerce")
    means = values.groupby(records[by].astype(str)).mean().dropna()
    return {k: float(v) for k, v in means.items()}


CELL = ("model", "memory", "hardware")  # runs in different cells are never drawn side by side


def variant_labels(records: pd.DataFrame) -> pd.Series:
    """Method name, plus the method settings that differ between runs of that method in one cell.

    `records["_method_cfg"]` holds each run's settings as JSON (`method_settings`). Two specter runs
    of one model, tier and hardware that differ only in method.prefetch become
    'specter[prefetch=none]' etc.; a method with a single configuration per cell keeps its bare
    name (a setting that differs between models or tiers by design splits nothing). Nothing is
    hard-coded per method.
    """
    labels = records["method"].astype(str).copy()
    keys = ["method", *(c for c in CELL if c in records.columns)]
    cells = records[keys].astype(str)  # NaN-safe grouping
    for _, group in records.groupby([cells[k] for k in keys]):
        method = str(group["method"].iloc[0])
        cfgs = {c: json.loads(c) for c in group["_method_cfg"].unique()}
        if len(cfgs) < 2:
            continue
        settings = sorted({k for c in cfgs.values() for k in c})
        varying = [k for k in settings if len({json.dumps(c.get(k), default=str) for c in cfgs.values()}) > 1]
        for raw, c in cfgs.items():
            suffix = ",".join(f"{k}={c.get(k)}" for k in varying)
            labels[group.index[group["_method_cfg"] == raw]] = f"{method}[{suffix}]"
    return labels
