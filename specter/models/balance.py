"""Load-balancing losses for training the tiny MoE models, computed per MoE layer.

Real MoE models are trained with one: DeepSeek-V2 with its expert-level balance loss (Dai et al.,
DeepSeek-V2 report, eq. 12-14), Qwen2-MoE and PhiMoE with the Switch Transformer auxiliary loss.
Both are the same quantity up to a constant:

    L = sum_i f_i * P_i,  f_i = E / (k T) * #{t : i in topk(t)},  P_i = 1/T * sum_t softmax(s_t)_i

which is 1 when routing is uniform and grows as it collapses onto few experts (DeepSeek-V2 scales
it by alpha_1; transformers' Switch form for Qwen2-MoE / PhiMoE equals k * L). DeepSeek-V2's
device- and communication-level losses balance across GPUs and have no meaning on one device.

Why per layer: transformers' `load_balancing_loss_func` pools every layer's router logits before
counting, and with near-uniform router probabilities it barely sees one layer's imbalance (a tiny
Qwen2-MoE trained with it at 50x its default coefficient kept 11-22 of 60 experts idle per
layer); transformers' DeepSeek-V2 adds no balance loss at all. Averaging L over layers makes each
layer answer for its own routing.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


def expert_balance_loss(router_logits: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2's expert-level balance loss of one layer (without its alpha_1).

    router_logits [T, E] (the router's scores before softmax), topk_idx [T, k] (the chosen
    experts). f_i counts choices (no gradient); P_i carries the gradient to the router.
    """
    T, E = router_logits.shape
    k = topk_idx.shape[-1]
    counts = torch.bincount(topk_idx.reshape(-1), minlength=E).to(router_logits.dtype)  # [E]
    f = counts * (E / (k * T))  # [E]; mean 1 when uniform
    P = router_logits.float().softmax(dim=-1).mean(dim=0)  # [E]; sums to 1
    return (f.detach() * P).sum()


def expert_balance_loss_reference(router_logits: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """The same loss written token by token, expert by expert, as the paper states it."""
    T, E = router_logits.shape
    k = topk_idx.shape[-1]
    probs = torch.softmax(router_logits.float(), dim=-1)
    total = router_logits.new_zeros((), dtype=torch.float32)
    for i in range(E):
        chosen = sum(1.0 for t in range(T) if i in topk_idx[t].tolist())
        f_i = E / (k * T) * chosen
        P_i = sum(probs[t, i] for t in range(T)) / T
        total = total + f_i * P_i
    return total


class RouterTap:
    """Collects each MoE layer's (router logits, top-k ids) during a forward pass, with gradients.

    Every router of the three architectures returns (logits [T, E], top-k weights [T, k],
    top-k ids [T, k]); a forward hook keeps the first and last.
    """

    def __init__(self, routers: dict[int, torch.nn.Module]):
        self.routers = routers
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @contextmanager
    def attached(self) -> Iterator["RouterTap"]:
        hooks = [router.register_forward_hook(
            lambda mod, args, out, layer=layer: self.seen.__setitem__(layer, (out[0], out[2])))
            for layer, router in self.routers.items()]
        try:
            yield self
        finally:
            for hook in hooks:
                hook.remove()

    def balance_loss(self) -> torch.Tensor:
        """Mean over MoE layers of each layer's expert-level balance loss; clears what it read."""
        losses = [expert_balance_loss(logits.reshape(-1, logits.shape[-1]), idx.reshape(-1, idx.shape[-1]))
                  for logits, idx in self.seen.values()]
        self.seen.clear()
        return torch.stack(losses).mean()


def routers_of(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """MoE layer index -> its router module (`MoEArch.router_attr`: `gate` in DeepSeek-V2 / Qwen2-MoE,
    `router` in PhiMoE)."""
    from specter.models.arch import arch_for, moe_blocks

    attr = arch_for(model.config.model_type).router_attr
    return {layer: getattr(block, attr) for layer, block in moe_blocks(model).items()}
