"""What `python run.py` does, chosen explicitly by the `experiment` key (never inferred)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from omegaconf import DictConfig

from specter.assembly.config import ConfigError


def _lazy(module: str, name: str) -> Callable[[DictConfig], object]:
    """The runner `module.name`, imported when it runs (each pulls in torch and transformers; `plan`
    is config arithmetic only: no weights, no device)."""

    def runner(cfg: DictConfig):
        return getattr(importlib.import_module(module), name)(cfg)

    runner.__qualname__ = f"{module}.{name}"
    return runner


EXPERIMENTS: dict[str, Callable[[DictConfig], object]] = {
    "run": _lazy("specter.experiments.run", "run"),
    "k_sweep": _lazy("specter.experiments.profile_k", "profile_k"),
    "compare": _lazy("specter.experiments.compare", "compare"),
    "batch": _lazy("specter.experiments.batch", "run_batch"),
    "plan": _lazy("specter.experiments.plan", "run_plan"),
    "load_ratio_sweep": _lazy("specter.experiments.load_ratio_sweep", "load_ratio_sweep"),
    "project": _lazy("specter.experiments.project", "run_project"),
    "cell": _lazy("specter.experiments.cell", "run_cell"),
}


def register_experiment(name: str, fn: Callable[[DictConfig], object]) -> None:
    EXPERIMENTS[name] = fn


def run_experiment(cfg: DictConfig):
    from specter.assembly.compose import resolve_hardware

    cfg = resolve_hardware(cfg)
    _quiet_third_parties(cfg)
    kind = cfg.experiment
    if kind not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment={kind!r}; choose one of {sorted(EXPERIMENTS)}")
    return EXPERIMENTS[kind](cfg)


def _quiet_third_parties(cfg: DictConfig) -> None:
    """Third-party banners and log lines stay out of the output unless `verbose=true` (or SPECTER_VERBOSE=1)."""
    from specter.quiet import quiet_loggers, set_verbose

    if cfg.get("verbose"):
        set_verbose(True)
    else:
        quiet_loggers()
