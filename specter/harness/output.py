"""Result folders: never overwrite a finished record, resume an interrupted run."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specter.harness.config import ConfigError

VOLATILE_KEYS = ("progress", "output_dir", "allow_hub", "assets_dir")  # may differ between resumed runs
PACKAGES = ("torch", "transformers", "gptqmodel", "hydra-core", "safetensors", "tokenizers", "datasets", "numpy")


def comparable(cfg: DictConfig) -> dict[str, Any]:
    data = OmegaConf.to_container(cfg, resolve=True)
    for key in VOLATILE_KEYS:
        data.pop(key, None)
    data.pop("hydra", None)
    return data


def open_output_dir(cfg: DictConfig) -> Path:
    """Create `output_dir` or check that it holds this same run (then it resumes)."""
    out = Path(cfg.output_dir)
    saved = out / "config.yaml"
    if saved.exists():
        previous = comparable(OmegaConf.load(saved))
        if previous != comparable(cfg):
            changed = sorted(k for k in set(previous) | set(comparable(cfg)) if previous.get(k) != comparable(cfg).get(k))
            raise ConfigError(
                f"{out} already holds a run with a different configuration (differs in: {changed}). "
                "Finished records are never overwritten: choose another output_dir=..., or rerun the "
                "original command to resume it."
            )
    elif out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists, is not empty and holds no Specter run: choose another output_dir")
    out.mkdir(parents=True, exist_ok=True)
    if not saved.exists():
        saved.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return out


def _git_sha() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parents[2],
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def environment_info(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    import torch

    versions = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    info: dict[str, Any] = {
        "packages": versions,
        "python": platform.python_version(),
        "git_sha": _git_sha(),
        "cpu": {"processor": platform.processor() or platform.machine(), "count": os.cpu_count(),
                "torch_threads": torch.get_num_threads()},
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    info.update(extra or {})
    return info


def write_environment(out: Path, extra: dict[str, Any] | None = None) -> None:
    """env.json of the first run; a resumed run adds env.resume-N.json beside it."""
    path = out / "env.json"
    n = 1
    while path.exists():
        path = out / f"env.resume-{n}.json"
        n += 1
    path.write_text(json.dumps(environment_info(extra), indent=1, sort_keys=True, default=str))
