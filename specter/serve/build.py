"""One Method for interactive use, built as `python run.py` builds it: the same config groups, the
same typed schema and checks, the same warm-up outside any timing, the same link calibration."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from specter.assembly.config import ConfigError

MAX_BATCH = 32  # the largest batch the batched decoders are tested at (tests/test_batched.py)


@dataclass
class Served:
    """A loaded method with what serving it needs."""

    cfg: DictConfig
    checkpoint: Path
    method: Any  # specter.assembly.methods.Method
    tokenizer: Any  # a transformers tokenizer
    context_length: int
    max_batch: int  # requests decoded together: the tier's largest fitting batch, at most MAX_BATCH

    @property
    def name(self) -> str:
        """The model name clients send (`model` field): the config's model name."""
        return str(self.cfg.model.name)

    def close(self) -> None:
        self.method.close()


def compose_checked(overrides: list[str]) -> DictConfig:
    """The run configuration of `overrides`, refused with a one-line ConfigError as run.py refuses it."""
    from specter.assembly.compose import check_optional_groups
    from specter.assembly.compose import compose
    from specter.assembly.config import check_home, resident_experts, unknown_keys, validate
    from specter.assembly.errors import composition_error
    from specter.assembly.runtime import device_and_dtype

    try:
        cfg = compose(overrides) if overrides else _plain_config()
    except Exception as err:  # noqa: BLE001 - Hydra/OmegaConf raise many types for a bad override
        raise composition_error(err) from None
    check_optional_groups(overrides)
    unknown = unknown_keys(cfg)  # `+typo=1` would be accepted and never used
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown}: not in the configuration schema "
                          "(specter/assembly/schema.py); check the spelling")
    check_home()  # SPECTER_HOME a file: one line, not a NotADirectoryError from deep in a build
    validate(cfg)
    resident_experts(cfg)
    device_and_dtype(cfg)
    return cfg


def _plain_config() -> DictConfig:
    """conf/config.yaml with no override: `compose([])` would give run.py's default job (the comparison)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from specter.assembly.compose import CONF_DIR, resolve_hardware
    from specter.assembly.schema import register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return resolve_hardware(hydra_compose(config_name="config", overrides=[]))


def largest_fitting_batch(method: Any, cap: int = MAX_BATCH) -> int:
    """The memory plan's number: the largest B whose footprint fits the tier's budget (experiment=batch
    refuses larger ones with the same number), at most ``cap``; ``cap`` where no budget applies."""
    from specter.assembly.sizing import footprint_at, largest_batch

    rt = method.rt
    one = footprint_at(method, 1)
    if rt is None or one is None:
        return cap
    fits = largest_batch(one, footprint_at(method, 2), rt.budget_bytes)
    if fits < 1:
        raise ConfigError(f"method {method.name!r}: not even one request fits the budget of "
                          f"{rt.budget_bytes / 2**20:.2f} MB")
    return int(min(cap, fits))


def load(overrides: list[str], *, max_batch: int = MAX_BATCH, warm: bool = True) -> Served:
    """Compose, build the method, warm it up (outside timing) and re-time an emulated link, as run.py does."""
    from transformers import AutoTokenizer

    from specter.assembly.load_ratio import calibrate_after_warmup
    from specter.assembly.methods import build_method
    from specter.assembly.runtime import model_checkpoint
    from specter.quiet import quiet_loggers, set_verbose
    from specter.speculative.sampling import make_generator

    cfg = compose_checked(overrides)
    if cfg.hardware.get("threads"):
        torch.set_num_threads(int(cfg.hardware.threads))
    checkpoint = model_checkpoint(cfg)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    if cfg.verbose:
        set_verbose(True)
    else:
        quiet_loggers()
    method = build_method(cfg, checkpoint)
    try:
        batch = largest_fitting_batch(method, max_batch)
        if warm and cfg.warmup_tokens > 0:  # kernels, allocator, caches, the planner's estimates
            ids = tokenizer("def warm_up(x):", add_special_tokens=False).input_ids or [1]
            method.generate(torch.tensor([ids], device=method.device), int(cfg.warmup_tokens),
                            make_generator(method.device, 0))
            method.warmed()
            calibrate_after_warmup(cfg, checkpoint, method)
            method.reset()
    except BaseException:
        method.close()
        raise
    return Served(cfg, checkpoint, method, tokenizer, int(cfg.model.context_length), batch)
