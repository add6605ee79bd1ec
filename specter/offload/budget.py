"""Device-footprint accounting against a memory tier's budget.

footprint = non-expert weights + expert-cache slots + resident INT4 draft experts + KV cache for
the longest sequence + scratch (verification activations and logits). A configuration that does
not fit is refused before decoding starts, with the breakdown in the message.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


MB = 1 << 20


class BudgetError(ValueError):
    """The configuration does not fit the memory tier's device budget."""


@dataclass(frozen=True)
class Footprint:
    non_expert: int
    cache_slots: int
    draft_experts: int
    kv_cache: int
    scratch: int

    @property
    def total(self) -> int:
        return self.non_expert + self.cache_slots + self.draft_experts + self.kv_cache + self.scratch

    def describe(self) -> str:
        parts = ", ".join(f"{k.replace('_', ' ')} {v / MB:.2f} MB" for k, v in asdict(self).items())
        return f"{self.total / MB:.2f} MB ({parts})"


def check_budget(footprint: Footprint, budget_bytes: int, what: str) -> None:
    if footprint.total > budget_bytes:
        larger = "" if "memory=high" in what else "a larger tier (memory=high), "  # high is the largest tier
        raise BudgetError(
            f"{what} needs {footprint.describe()} on the device, more than the memory tier's budget of "
            f"{budget_bytes / MB:.2f} MB. Use {larger}fewer resident experts "
            f"(+memory.resident_experts=N), or a larger budget (memory.budget_mb=...)."
        )


def kv_bytes_per_token(model, device, dtype) -> int:
    """Measured, not modelled: one token through the model, then the cache's bytes."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), cache=cache, use_cache=True)
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total
