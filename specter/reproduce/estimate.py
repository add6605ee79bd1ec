"""How long a plan takes on this machine: each step's own measured time when one is recorded here,
else that step's time in the reference run (`results/reference/reproduce_timings.json`, when the
reference set carries one), else a per-kind model (startup + records x per-record + units x
per-unit) with constants derived from the reference run on a 2-core CPU. The runner records every
step's time in `<logs>/timings.json` and copies the plan's into `<results>/reproduce_timings.json`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from specter.reproduce.plan import Step

TIMINGS = "timings.json"


@dataclass(frozen=True)
class Cost:
    startup_s: float      # process start, imports, model load, calibration and draft (cached after the first)
    per_record_s: float   # one measured record (QUICK: 32 new tokens; scaled by max_new_tokens / 32)
    per_unit_s: float = 0.0  # per K value, batch size or benchmark run inside the step


# Derived from the shipped reference set (results/reference: QUICK=1 on a 2-core CPU, HumanEval, 19 min
# with the tiny models already trained, 73 steps): the records' own e2e times give the per-record
# cost of each kind (main 93 s over 108 records, K sweep 11 s over 9, batching 64 s over 96, trace
# 6 s over 3 at 128 tokens); the rest of the 19 min, less the benchmarks and figures, spread over
# its 68 run.py steps gives the startup (about 11 s: interpreter, torch, model load, cached
# calibration and draft). Full-protocol records are scaled by their token count.
COSTS: dict[str, Cost] = {
    "datasets": Cost(5.0, 0.0),
    "train": Cost(180.0, 0.0),        # initialization/train_tiny.py: "about 3 CPU minutes each"
    "k_sweep": Cost(11.0, 1.2, 2.0),
    "main": Cost(11.0, 0.9, 9.0),     # one cell per model x tier: each method's load, warm-up, link calibration
    "ablation": Cost(11.0, 0.9),      # main-grid runs with method.staging_buffers=0
    "batch": Cost(11.0, 0.7, 1.0),
    "trace": Cost(11.0, 0.5),
    "bench-draft-kernel": Cost(120.0, 0.0),  # --quick: 5 timed calls per point, about 2 min on 2 cores
    "bench-verify": Cost(15.0, 0.0, 15.0),   # per tiny model
    "bench-prefetch": Cost(10.0, 1.2, 3.0),  # 15 in-process runs: 19 s of records in the reference
    "project": Cost(0.0, 0.0, 420.0),       # per real model x tier: dsv2 high's rows and K profiles took 8.8 min on 2
                                            # cores under a load of 4 (its first GPTQ draft included); --batch and
                                            # --alpha add minutes to the high-tier cells that run them
    "figures": Cost(40.0, 0.0),
}
FULL_SCALE = {"bench-draft-kernel": 5.0, "bench-verify": 5.0}  # ARTIFACT.md: ~5 min each without --quick
MEASURED_ON = "2-core CPU (the reference set's run)"


def read_timings_file(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


def read_timings(logs: Path) -> dict[str, dict]:
    return read_timings_file(logs / TIMINGS)


def write_timing(logs: Path, step: Step, seconds: float, status: str) -> None:
    """Record one step's time (atomically; a torn file only loses the timings)."""
    data = read_timings(logs)
    data[step.name] = {"seconds": round(seconds, 1), "command": step.command, "status": status,
                       "records": step.records, "cpus": os.cpu_count()}
    tmp = logs / f".{TIMINGS}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, logs / TIMINGS)


def token_scale(step: Step) -> float:
    """New tokens per record over QUICK's 32 (a step without the setting runs the full protocol's 128)."""
    argv = list(step.argv)
    for i, arg in enumerate(argv):
        if arg.startswith("max_new_tokens="):
            return int(arg.split("=", 1)[1]) / 32
        if arg == "--max-new-tokens" and i + 1 < len(argv):
            return int(argv[i + 1]) / 32
    return 1.0 if "--quick" in argv or step.kind in ("train", "datasets", "figures") else 4.0


def modelled_seconds(step: Step) -> float:
    short = step.name.split(".", 1)[-1]
    cost = COSTS.get(short) or COSTS.get(step.kind) or Cost(11.0, 1.0)
    seconds = cost.startup_s + step.records * cost.per_record_s * token_scale(step) + step.units * cost.per_unit_s
    if short in FULL_SCALE and "--quick" not in step.argv and "--reps" not in step.argv:
        seconds *= FULL_SCALE[short]
    return seconds


@dataclass(frozen=True)
class Estimate:
    seconds: float
    source: str   # "measured here" | "model"


def estimate(step: Step, timings: dict[str, dict], reference: dict[str, dict] | None = None) -> Estimate:
    """A measured time of the same command on this machine, else the same step's time in the
    reference run (the same step name and records), else the per-kind model."""
    seen = timings.get(step.name)
    if seen and seen.get("command") == step.command and seen.get("status") == "reproduced":
        return Estimate(float(seen["seconds"]), "measured here")
    ref = (reference or {}).get(step.name)
    if ref and ref.get("status") == "reproduced" and ref.get("records") == step.records:
        return Estimate(float(ref["seconds"]), "reference run")
    return Estimate(modelled_seconds(step), "model")


REFERENCE_TIMINGS = "reproduce_timings.json"  # beside a result set: the step times of the run that made it


def keep_timings(logs: Path, results: Path, names: list[str]) -> Path | None:
    """Copy this plan's step times beside its results (a reference set then carries them)."""
    data = {n: v for n, v in read_timings(logs).items() if n in names}
    try:
        (results / REFERENCE_TIMINGS).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    except OSError:
        return None
    return results / REFERENCE_TIMINGS


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
