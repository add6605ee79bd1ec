"""Decoding methods behind one interface, so the harness measures them all the same way.

A method owns its model instance. `generate` is timed by the caller's commit clock;
`reset` runs between measured records, outside timing (e.g. restoring the expert cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig

from specter.decode.autoregressive import generate_autoregressive
from specter.metrics import CommitClock
from specter.spec.sampling import SamplingParams

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class Generation:
    tokens: list[int]
    clock: CommitClock
    stats: dict[str, Any] = field(default_factory=dict)  # extra record columns (acceptance, I/O, ...)


class Method:
    """Base class: a named decoding method over one loaded model."""

    name = "base"

    def __init__(self, cfg: DictConfig, checkpoint: Path):
        self.cfg = cfg
        self.checkpoint = checkpoint
        self.device = torch.device(cfg.hardware.device)
        self.dtype = DTYPES[cfg.hardware.dtype]
        self.params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)

    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, generator: torch.Generator) -> Generation:
        raise NotImplementedError

    def reset(self) -> None:
        """Restore per-record state outside timing."""

    def static_fields(self) -> dict[str, Any]:
        """Record columns that are the same for every record of this method."""
        return {}

    def environment(self) -> dict[str, Any]:
        """Parameters worth recording in env.json (e.g. the emulated link)."""
        return {}

    def close(self) -> None:
        pass


def load_full_model(checkpoint: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The plain transformers model, every weight on the device (HF's eager experts loop)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, experts_implementation="eager")
    return model.to(device).eval()


class TargetOnly(Method):
    """Reference decoding: the full target model, autoregressive, no offloading."""

    name = "target_only"

    def __init__(self, cfg: DictConfig, checkpoint: Path):
        super().__init__(cfg, checkpoint)
        self.model = load_full_model(checkpoint, self.dtype, self.device)

    def generate(self, prompt_ids, max_new_tokens, generator):
        clock = CommitClock()
        tokens = generate_autoregressive(self.model, prompt_ids, max_new_tokens, self.params, generator, clock)
        return Generation(tokens, clock)


METHODS: dict[str, Callable[[DictConfig, Path], Method]] = {"target_only": TargetOnly}


def register(name: str, factory: Callable[[DictConfig, Path], Method]) -> None:
    METHODS[name] = factory


def build_method(cfg: DictConfig, checkpoint: Path) -> Method:
    name = cfg.method.name
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(METHODS)}")
    return METHODS[name](cfg, checkpoint)
