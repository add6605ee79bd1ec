"""Compose the run configuration outside `run.py` (benchmarks, tools, tests), exactly as the CLI does."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The config `python run.py <overrides>` would run with."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from specter.harness.schema import register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))
