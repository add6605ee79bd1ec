"""Whether a step's outputs exist and are valid: a step counts as done by what it left, not by its marker.

Each check returns None when the output is sound, else why not (for the log and the summary).
Run folders are read with the harness's validated record reader (torn or invalid rows do not count).
"""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import yaml

from specter.reproduce.plan import Check, Step


def _csv_rows(path: Path) -> tuple[int, str | None]:
    """Data rows of a CSV file (plain, or gzip-compressed when its name ends in .gz), or a problem."""
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8", newline="") as fh:
            rows = list(csv.reader(fh))
    except FileNotFoundError:
        return 0, f"{path} is missing"
    except (OSError, EOFError, UnicodeDecodeError, csv.Error) as err:
        return 0, f"{path} cannot be read ({err})"
    if not rows:
        return 0, f"{path} is empty"
    width = len(rows[0])
    bad = [i + 1 for i, r in enumerate(rows[1:], start=1) if len(r) != width]
    if bad:
        return 0, f"{path} line {bad[0]} has the wrong number of fields"
    if len(rows) < 2:
        return 0, f"{path} holds no rows"
    return len(rows) - 1, None


def _csv_problem(path: Path) -> str | None:
    return _csv_rows(path)[1]


def _run_problem(folder: Path, datasets: tuple[str, ...]) -> str | None:
    """A run folder holds every record its config asks for, over the datasets the plan names."""
    from specter.datasets import expand_datasets
    from specter.records.output import finished_records

    if not folder.is_dir():
        return f"{folder} is missing"
    try:
        cfg = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))
        ran = expand_datasets(cfg["dataset"]["name"])
        expected = len(ran) * int(cfg["num_prompts"]) * int(cfg["repeats"])
    except FileNotFoundError:
        return f"{folder}/config.yaml is missing"
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError, ValueError) as err:
        return f"{folder}/config.yaml cannot be read ({type(err).__name__})"
    if datasets and set(ran) != set(datasets):
        return f"{folder} ran {', '.join(ran)}, not {', '.join(datasets)}"
    done = finished_records(folder)
    if done < expected:
        return f"{folder}/records.csv holds {done} of {expected} records"
    return None


def recorded_datasets(folder: Path) -> tuple[str, ...] | None:
    """The datasets a run folder's config.yaml names, or None when it has no readable config."""
    from specter.datasets import expand_datasets

    try:
        cfg = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))
        return tuple(expand_datasets(cfg["dataset"]["name"]))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return None


def set_aside_other_datasets(step: Step, now: str) -> list[str]:
    """Move aside run folders of `step` made for other datasets (the harness refuses to resume a run
    folder under a changed config); returns a line per folder moved. Nothing is deleted."""
    moved = []
    for check in step.checks:
        if check.kind not in ("run", "trace") or not check.datasets or not check.path.is_dir():
            continue
        before = recorded_datasets(check.path)
        if before is not None and set(before) != set(check.datasets):
            dest = check.path.with_name(f"{check.path.name}.{'+'.join(before)}-{now}")
            check.path.rename(dest)
            moved.append(f"{check.path} measured {', '.join(before)}, not {', '.join(check.datasets)}: moved to {dest}")
    return moved


def _k_sweep_problem(folder: Path) -> str | None:
    try:
        profile = json.loads((folder / "k_profile.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"{folder}/k_profile.json is missing"
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return f"{folder}/k_profile.json cannot be read ({type(err).__name__})"
    K = profile.get("K") if isinstance(profile, dict) else None
    if not isinstance(K, int) or isinstance(K, bool) or K < 1:
        return f"{folder}/k_profile.json names no K"
    return _csv_problem(folder / "k_sweep.csv")


def _trained_problem(folder: Path) -> str | None:
    from specter.models.tiny_train import trained_problem

    if not folder.is_dir():
        return f"{folder} is missing"
    problem = trained_problem(folder)
    return f"{folder}: {problem}" if problem else None


def check_problem(check: Check) -> str | None:
    """Why this output does not prove its step done, or None."""
    if check.kind == "trained":
        return _trained_problem(check.path)
    if check.kind == "run":
        return _run_problem(check.path, check.datasets)
    if check.kind == "trace":
        from specter.records.artifacts import side_path

        return _run_problem(check.path, check.datasets) or _csv_problem(side_path(check.path, "trace"))
    if check.kind == "k_sweep":
        return _k_sweep_problem(check.path)
    if check.kind == "batch":
        return _csv_problem(check.path / "batch_summary.csv")
    if check.kind == "csv":
        return _csv_problem(check.path)
    raise ValueError(f"unknown output check {check.kind!r}")


def outputs_problem(step: Step) -> str | None:
    """The first output of `step` that is missing or invalid, or None when all are sound.

    A step without checks (the dataset check, the figures) is never done: it runs every time.
    """
    if not step.checks:
        return "runs every time"
    for check in step.checks:
        problem = check_problem(check)
        if problem:
            return problem
    return None
