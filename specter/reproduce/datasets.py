"""The dataset decision: run with the requested datasets that are present, or stop with one message.

"Present" is what a run would find with the hub left out: `specter.datasets.load_prompt_set`
with `allow_hub=False` (the same check `initialization/prepare_datasets.py` verifies its files with)
reads the assets folder, then any copy the loader knows without a network (a bundled one). A
dataset must yield as many prompts as the largest step asks of it; the batch steps may ask more than
the others and then run on the datasets that have enough.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specter.datasets import (
    ABBREVIATIONS,
    DATASETS,
    SPECS,
    DatasetFormatError,
    DatasetUnavailable,
    expand_datasets,
    expected_asset_path,
    load_prompt_set,
)

PREPARE = "python -m initialization.prepare_datasets"


def label(names: tuple[str, ...] | list[str]) -> str:
    """'c4 (C4), humaneval (HE)'."""
    return ", ".join(f"{n} ({ABBREVIATIONS[n]})" for n in names)


def unavailable_reason(name: str, num_prompts: int, assets_dir: str) -> str | None:
    """None when `name` yields `num_prompts` prompts without the hub; else the loader's message."""
    try:
        load_prompt_set(name, num_prompts, assets_dir, allow_hub=False)
    except (DatasetUnavailable, DatasetFormatError, ValueError) as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class DatasetDecision:
    requested: tuple[str, ...]
    ready: tuple[str, ...]                       # enough prompts for every step but batching
    batch_ready: tuple[str, ...]                 # enough prompts for the batch steps too
    missing: dict[str, str] = field(default_factory=dict)  # dataset -> the loader's message
    assets_dir: str = "assets"
    batch_prompts: int = 0

    @property
    def narrowed(self) -> bool:
        return self.ready != self.requested

    def summary(self) -> str:
        """One line: what the runs use and what was left out."""
        if not self.ready:
            return f"datasets: none of {label(self.requested)} is present"
        line = f"datasets: {label(self.ready)}"
        if self.narrowed:
            line += f" (not present: {label([n for n in self.requested if n not in self.ready])})"
        if self.batch_ready != self.ready:
            short = [n for n in self.ready if n not in self.batch_ready]
            line += f"; batching: {label(self.batch_ready) or 'none'} ({label(short)}: fewer than " \
                    f"{self.batch_prompts} prompts)"
        return line

    def how_to_add(self) -> list[str]:
        """Where each missing file goes and the command that places it."""
        lines = [f"  {n} ({ABBREVIATIONS[n]}): {expected_asset_path(n, self.assets_dir)}  <- {SPECS[n].how_to_get}"
                 for n in self.requested if n not in self.ready]
        if lines:
            lines.append(f"  or run `{PREPARE} --assets {self.assets_dir}` on a machine with internet "
                         "(--from-dir DIR copies files you already have), then rerun")
        return lines


def decide(requested: str, assets_dir: str, prompts: int, batch_prompts: int) -> DatasetDecision:
    """Which of `requested` (a DATASET value: 'all', 'c4,HE', ...) the runs can use."""
    names = tuple(expand_datasets(requested))
    missing: dict[str, str] = {}
    ready: list[str] = []
    batch_ready: list[str] = []
    for name in names:
        reason = unavailable_reason(name, prompts, assets_dir)
        if reason is not None:
            missing[name] = reason
            continue
        ready.append(name)
        if batch_prompts <= prompts or unavailable_reason(name, batch_prompts, assets_dir) is None:
            batch_ready.append(name)
    return DatasetDecision(names, tuple(ready), tuple(batch_ready), missing, assets_dir, batch_prompts)


def dataset_overrides(names: tuple[str, ...]) -> list[str]:
    """run.py overrides that select exactly `names` (recorded in each run's config.yaml and provenance)."""
    if set(names) == set(DATASETS):
        return ["dataset=all"]
    if len(names) == 1:
        return [f"dataset={names[0]}"]
    return ["dataset=all", "dataset.name=" + "\\,".join(names)]  # Hydra: an escaped comma is no sweep
