"""The tier's device budget and a request's verification scratch, in bytes: the arithmetic both a
runtime (assembly.runtime) and the real model's memory plan (assembly.plan) size themselves by, and
the largest batch a built method holds (the batch experiment, `serve`, the Python API)."""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig

from specter.offload.budget import MB, Footprint
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


def footprint_at(method: Any, B: int) -> Footprint | None:
    """A built method's device footprint at batch size B (None: no budget applies): `Method.footprint_at`
    (the method is not typed here: assembly.methods sizes its runtime by this module)."""
    return method.footprint_at(B)


def largest_batch(one: Footprint, two: Footprint, budget_bytes: int) -> int:
    """The largest B that fits, from the footprints at B=1 and B=2 (footprints are linear in B)."""
    per_request = two.total - one.total
    fixed = one.total - per_request
    return max(0, (budget_bytes - fixed) // per_request) if per_request > 0 else 10**9


def refusal(method: Any, B: int) -> str | None:
    """Why batch size B does not fit the method's memory tier (None: it fits, or no budget applies)."""
    fp = footprint_at(method, B)
    if fp is None or fp.total <= method.rt.budget_bytes:
        return None
    budget = method.rt.budget_bytes
    fits = largest_batch(footprint_at(method, 1), footprint_at(method, 2), budget)
    return (f"B={B} needs {fp.describe()} on the device, more than the budget of {budget / MB:.2f} MB; "
            f"the largest batch that fits is B={fits}")
