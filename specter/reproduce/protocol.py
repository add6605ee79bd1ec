"""Protocol sizes per experiment: the QUICK overrides, else the experiment's own config file.

The sizes decide how many prompts each dataset must yield (the dataset check) and how many
records a step measures (the time estimate and the output check).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from specter.reproduce.settings import REPO


@dataclass(frozen=True)
class Protocol:
    num_prompts: int
    repeats: int
    max_new_tokens: int
    k_values: tuple[int, ...] = ()   # k_sweep only: Specter's K set, and a method's own range (method.k_range)
    batch_sizes: tuple[int, ...] = ()  # batch only
    warmup_tokens: int = 8           # the one warm-up record before a method's timed records

    def overrides(self, experiment: str) -> list[str]:
        """The run.py overrides that set this protocol (shortened sizes; the full protocol needs none)."""
        out = [f"num_prompts={self.num_prompts}", f"repeats={self.repeats}",
               f"max_new_tokens={self.max_new_tokens}", f"warmup_tokens={self.warmup_tokens}"]
        if experiment == "k_sweep":
            out.append("k_sweep.values=[" + ",".join(map(str, self.k_values)) + "]")
        if experiment == "batch":
            out = [o for o in out if not o.startswith("repeats=")]
            out.append("batch.sizes=[" + ",".join(map(str, self.batch_sizes)) + "]")
        return out


# QUICK: 1 prompt x 1 repeat per dataset, 32 new tokens; K in {4, 8, 16}; B in {1, 2, 4} over 4 prompts
# (of one dataset). Sized for < 30 min on 2 cores with all five datasets: see README, artifact.
QUICK = {
    "main": Protocol(num_prompts=1, repeats=1, max_new_tokens=32),
    "k_sweep": Protocol(num_prompts=1, repeats=1, max_new_tokens=32, k_values=(4, 8, 16)),
    "batch": Protocol(num_prompts=4, repeats=1, max_new_tokens=32, batch_sizes=(1, 2, 4)),
    "trace": Protocol(num_prompts=1, repeats=1, max_new_tokens=128),  # one window timeline: the default length
    "prefetch": Protocol(num_prompts=1, repeats=1, max_new_tokens=32),
}
# REFERENCE: the paper's record length at the least that still gives prompt-level statistics: 5 prompts per
# dataset x 2 timing repeats, 128 new tokens after a 64-token warm-up; K profiled at every tier on 2 prompts
# per dataset (6 prompts) x 128 tokens over one K set for every speculative method, reaching 96 (three
# quarters of a record): with drafts accepted at alpha ~0.95-0.99 the profile still falls at 48; the batch sweep on every dataset (32-token batches);
# the staging ablation on the first model's low tier. The size of the shipped results/reference (ARTIFACT.md
# section 5 gives its time; JOBS=2 runs two measuring steps at a time).
REFERENCE_K = (4, 8, 16, 32, 48, 64, 96)
REFERENCE = {
    "main": Protocol(num_prompts=5, repeats=2, max_new_tokens=128, warmup_tokens=64),
    "k_sweep": Protocol(num_prompts=2, repeats=1, max_new_tokens=128, k_values=REFERENCE_K, warmup_tokens=64),
    "batch": Protocol(num_prompts=32, repeats=1, max_new_tokens=32, batch_sizes=(1, 2, 4, 8, 16, 32)),
    "trace": Protocol(num_prompts=1, repeats=1, max_new_tokens=128),
    "prefetch": Protocol(num_prompts=1, repeats=1, max_new_tokens=64),
}
SHORTENED = {"quick": QUICK, "reference": REFERENCE}  # the sizes of each shortened mode
# the trace and prefetch steps are short in both modes (a timeline of one prompt; a side-by-side)
FULL_FIXED = {
    "trace": Protocol(num_prompts=1, repeats=1, max_new_tokens=128),
    "prefetch": Protocol(num_prompts=2, repeats=1, max_new_tokens=128),  # scripts/bench_methods.py defaults
}


def _yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def experiment_protocol(experiment: str, repo: Path = REPO) -> Protocol:
    """The full protocol of conf/experiment/<experiment>.yaml over conf/config.yaml's defaults."""
    base = _yaml(repo / "conf" / "config.yaml")
    exp = _yaml(repo / "conf" / "experiment" / f"{experiment}.yaml")
    merged = {**base, **exp}
    return Protocol(
        num_prompts=int(merged.get("num_prompts", 5)),
        repeats=int(merged.get("repeats", 1)),
        max_new_tokens=int(merged.get("max_new_tokens", 128)),
        k_values=tuple(int(k) for k in (exp.get("k_sweep") or {}).get("values", ())),
        batch_sizes=tuple(int(b) for b in (exp.get("batch") or {}).get("sizes", ())),
    )


def protocol(kind: str, quick: bool, repo: Path = REPO, sizes: str = "quick") -> Protocol:
    """The protocol of one kind of step: main, k_sweep, batch, trace or prefetch (`sizes`: which
    shortened protocol a `quick` run uses, QUICK's or REFERENCE's)."""
    if quick:
        return SHORTENED[sizes][kind]
    if kind in FULL_FIXED:
        return FULL_FIXED[kind]
    return experiment_protocol(kind, repo)
