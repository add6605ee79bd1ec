"""Device-footprint accounting against a memory tier's budget.

footprint = non-expert weights + expert-cache slots + staging buffers + resident INT4 draft experts
(+ a separate draft's copy of the non-expert weights) + KV cache for the longest sequence + scratch
(verification activations and logits). A configuration that does not fit is refused before
decoding starts, with the breakdown in the message.

The resource rule every cache-owning method follows (`staging_buffers`): the tier's budget is
spent first on what the method's design holds (its slots, its draft, its KV and scratch), and the
staging buffers are a runtime facility on top of that, sized by one rule for every method.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass


MB = 1 << 20


class BudgetError(ValueError):
    """The configuration does not fit the memory tier's device budget."""


@dataclass(frozen=True)
class Footprint:
    """Device bytes by component (what env.json records under footprint_bytes)."""

    non_expert: int
    cache_slots: int  # the layers' own M slots
    draft_experts: int  # INT4 draft experts
    kv_cache: int  # target KV (and a separate draft's) for the longest sequence
    scratch: int  # verification activations and logits
    staging: int = 0  # staging buffers shared by all layers
    draft_non_expert: int = 0  # a separate draft's own copy of the non-expert weights

    @property
    def total(self) -> int:
        return (self.non_expert + self.cache_slots + self.staging + self.draft_experts + self.draft_non_expert
                + self.kv_cache + self.scratch)

    def record(self, budget_bytes: int | None = None) -> dict[str, int | None]:
        """Every component, the total and the budget (env.json's footprint_bytes)."""
        return {**asdict(self), "total": self.total, "budget": budget_bytes}

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


STAGING_PER_LAYER = 1.2  # the paper's artifact: 32 staging buffers for DeepSeek-V2-Lite's 26 MoE layers


def staging_buffers(requested: int | None, footprint: Footprint, budget_bytes: int, expert_bytes: int,
                    moe_layers: int, per_layer: float = STAGING_PER_LAYER, per_request_bytes: int = 0,
                    batch_sizes: Sequence[int] = (1,)) -> int:
    """Staging buffers of a cache-owning method: the one rule every such method is given.

    `requested` (method.staging_buffers, e.g. the ablation 0) when set; else the whole experts the
    budget still holds beyond `footprint` (the method's design without staging), at most
    round(`per_layer` x MoE layers). With several batch sizes (experiment=batch) the headroom is
    what is left beside the KV and scratch (`per_request_bytes` each) of the largest size that
    fits, so one device layout serves every size."""
    if requested is not None:
        if requested < 0:
            raise ValueError(f"staging buffers must be >= 0, got {requested}")
        return int(requested)
    fits = [b for b in batch_sizes if footprint.total + (b - 1) * per_request_bytes <= budget_bytes]
    headroom = budget_bytes - footprint.total - (max(fits, default=1) - 1) * per_request_bytes
    return max(0, min(round(per_layer * moe_layers), headroom // expert_bytes))


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
