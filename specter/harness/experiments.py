"""What `python run.py` does, chosen explicitly by the `experiment` key (never inferred)."""

from __future__ import annotations

from collections.abc import Callable

from omegaconf import DictConfig

from specter.harness.config import ConfigError


def _run(cfg: DictConfig):
    from specter.harness.run import run

    return run(cfg)


def _k_sweep(cfg: DictConfig):
    from specter.harness.profile_k import profile_k

    return profile_k(cfg)


def _compare(cfg: DictConfig):
    from specter.harness.compare import compare

    return compare(cfg)


def _batch(cfg: DictConfig):
    from specter.harness.batch import run_batch

    return run_batch(cfg)


def _load_ratio_sweep(cfg: DictConfig):
    from specter.harness.load_ratio_sweep import load_ratio_sweep

    return load_ratio_sweep(cfg)


def _plan(cfg: DictConfig):
    from specter.harness.plan import run_plan  # config arithmetic only: no weights, no device

    return run_plan(cfg)


EXPERIMENTS: dict[str, Callable[[DictConfig], object]] = {"run": _run, "k_sweep": _k_sweep, "compare": _compare,
                                                          "batch": _batch, "plan": _plan,
                                                          "load_ratio_sweep": _load_ratio_sweep}


def register_experiment(name: str, fn: Callable[[DictConfig], object]) -> None:
    EXPERIMENTS[name] = fn


def run_experiment(cfg: DictConfig):
    from specter.harness.compose import resolve_hardware

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
