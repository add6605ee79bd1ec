"""Which records belong together: a record's source (main grid, trace, bench, batch) and its method label.

Two runs of one method are one method unless a setting that changes what the method *does*
differs between them. Settings that only change how a run is observed or where it is written
(`MEASUREMENT_KEYS`) never split a method. A run that traced its windows (`method.trace_windows`)
timed every copy on the host and paid for writing each event, so its times are not the
method's: it is its own source, "trace", drawn by the timeline figure and the traced-runs
table, never in Fig. 14 or the headline. Ablations (a `bench` or `ablation` folder, e.g. the
staging-buffer ablation) are side benchmarks: they keep the main grid to one configuration per
method, so the headline always finds a bare "specter".
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

# Keys (the last part of a dotted config key) that observe or place a run and do not change it.
MEASUREMENT_KEYS = ("trace_windows", "progress", "output_dir", "recalibrate", "retime_per_record", "allow_hub",
                    "assets_dir",
                    "verify_lossless", "lossless_tie_tolerance")
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
