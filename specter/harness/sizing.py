"""The tier's device budget and a request's verification scratch, in bytes: the arithmetic both a
runtime (harness.runtime) and the real model's memory plan (harness.plan) size themselves by."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from specter.spec import BudgetSpec

GB = 1e9


def budget_spec(cfg: DictConfig) -> BudgetSpec:
    """The tier's device budget: `memory.budget_mb` if given, else the model's own tier entry."""
    mem = cfg.memory
    tier = (cfg.model.get("tiers") or {}).get(mem.name) or {}
    if mem.get("budget_mb") is not None:
        return BudgetSpec(bytes=int(float(mem.budget_mb) * (1 << 20)))
    if tier.get("budget_gb") is not None:
        return BudgetSpec(bytes=int(float(tier.budget_gb) * GB))
    return BudgetSpec(fraction=float(tier.get("budget_fraction", 1.0)))


def budget_bytes(cfg: DictConfig, full_bytes: int) -> int:
    """The tier's budget in bytes for a model of `full_bytes` (engine baselines place their own weights)."""
    return budget_spec(cfg).resolve(full_bytes)


def scratch_bytes(model_config, K: int, batch_size: int, dtype: torch.dtype) -> int:
    """Verification activations (a few [K+1, H] buffers per layer) and logits [K+1, V], per request."""
    return batch_size * (K + 1) * (model_config.hidden_size * 8 + model_config.vocab_size) * torch.finfo(dtype).bits // 8
