"""Compose the run configuration outside `run.py` (benchmarks, tools, tests), exactly as the CLI does."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from specter.config_error import ConfigError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# What `python run.py` with no arguments runs, and so what `compose([])` gives: the comparison the
# project exists for (conf/experiment/compare.yaml). Any override selects from conf/config.yaml instead.
DEFAULT_JOB = ("experiment=compare",)


def job_overrides(overrides: list[str] | tuple[str, ...]) -> list[str]:
    """The overrides a job runs with: DEFAULT_JOB when none are given."""
    return list(overrides) if overrides else list(DEFAULT_JOB)


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The config `python run.py <overrides>` would run with (no overrides: the default job)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from specter.assembly.schema import register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=job_overrides(overrides))
    return resolve_hardware(cfg)


def resolve_hardware(cfg: DictConfig) -> DictConfig:
    """Replace `hardware=auto` by the profile it stands for: cuda when a GPU is visible, else cpu.

    Keys the user overrode on top of `auto` (e.g. hardware.threads=2) are kept."""
    if cfg.hardware.name != "auto":
        return cfg
    import torch
    from omegaconf import OmegaConf, open_dict

    from specter.assembly.schema import HardwareConfig

    pick = "cuda" if torch.cuda.is_available() else "cpu"
    auto = hardware_defaults("auto")
    user = {k: v for k, v in cfg.hardware.items() if v != auto.get(k)}  # what the user set on top of auto
    with open_dict(cfg):
        cfg.hardware = OmegaConf.merge(OmegaConf.structured(HardwareConfig), hardware_defaults(pick), user)
    return cfg


def hardware_defaults(option: str) -> dict:
    """A hardware option's values before any user override (schema defaults + its YAML file)."""
    from omegaconf import OmegaConf

    from specter.assembly.schema import HardwareConfig

    data = OmegaConf.load(CONF_DIR / "hardware" / f"{option}.yaml")
    data.pop("defaults", None)
    return dict(OmegaConf.merge(OmegaConf.structured(HardwareConfig), data))


def check_optional_groups(argv: list[str]) -> None:
    """Hydra silently skips a missing option of an optional group (`experiment=typo` would run the
    plain protocol); refuse it like any unknown option."""
    for arg in argv:
        group, eq, value = arg.lstrip("+").partition("=")
        folder = CONF_DIR / group
        if not (eq and "." not in group and folder.is_dir()) or "(" in value:  # sweep functions: Hydra checks
            continue
        options = sorted(p.stem for p in folder.glob("*.yaml"))
        for option in value.split(","):  # a multirun sweep (-m group=a,b) lists several
            if option not in ("null", "") and option not in options:
                raise ConfigError(f"unknown {group}={option!r}; choose one of {options}")
