"""The one pure-PyTorch reference for a routed-experts MoE layer (transformers' eager loop).

Every fast path (the expert-wise offloaded target, the fused INT4 draft kernels, the Triton
kernel) is checked against `moe_reference`, and `moe_reference` itself is checked against
transformers' own experts modules for all three architectures (tests/test_reference_moe.py).

    for each expert e hit by any token, in ascending id:
        gate, up = (x[tok] @ W_gu[e]^T).chunk(2)          # [n, I] each
        y = (act(gate) * up) @ W_dn[e]^T * w[tok, slot]    # [n, H]
        out.index_add_(0, tok, y)                          # summed in ascending expert id
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ActFn = Callable[[torch.Tensor], torch.Tensor]


def expert_ffn(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act_fn: ActFn) -> torch.Tensor:
    """One expert's gated MLP: xs [n, H], gate_up [2I, H] (gate rows first), down [H, I] -> [n, H]."""
    gate, up = F.linear(xs, gate_up).chunk(2, dim=-1)  # [n, I] each
    return F.linear(act_fn(gate) * up, down)  # [n, H]


def group_by_expert(topk_idx: torch.Tensor, num_experts: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """``[(expert, token_idx [n], topk_pos [n])]`` in ascending expert id.

    Within an expert, entries are ordered by top-k position then token, i.e. the order
    ``torch.where(expert_mask[e])`` gives in HF. Index ``num_experts`` is a "no expert"
    sentinel and is skipped, as in HF. Costs one small device->host copy (the counts)."""
    T, k = topk_idx.shape
    flat = topk_idx.t().reshape(-1)  # [k*T], entry j = (pos j // T, token j % T)
    perm = torch.argsort(flat, stable=True)  # [k*T], grouped by expert, (pos, token) order kept
    counts = torch.bincount(flat, minlength=num_experts + 1)
    if counts.numel() > num_experts + 1:
        raise ValueError(f"routed expert id out of range: max {int(flat.max())}, layer has {num_experts} experts")
    groups = []
    start = 0
    for expert, n in enumerate(counts.tolist()[:num_experts]):
        if n:
            sel = perm[start : start + n]  # [n]
            groups.append((expert, sel % T, torch.div(sel, T, rounding_mode="floor")))
        start += n
    return groups


def grouped_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, num_experts: int,
                ffn: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The per-expert loop every unfused path shares: tokens grouped by expert (ascending id, HF's
    order), ``ffn(e, x[tokens of e]) -> [n, H]`` weighted by each route's weight, index-added: [T, H]."""
    out = torch.zeros_like(x)  # [T, H]
    for e, tok, pos in group_by_expert(topk_idx, num_experts):
        y = ffn(e, x[tok]) * topk_w[tok, pos, None]  # [n, H]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def moe_reference(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, gate_up_all: torch.Tensor,
                  down_all: torch.Tensor, act_fn: ActFn) -> torch.Tensor:
    """Routed experts over dense weights gate_up_all [E, 2I, H], down_all [E, H, I]: x [T, H] -> [T, H].

    The "no expert" id E (masked routes) is skipped, as transformers does.
    """
    return grouped_moe(x, topk_idx, topk_w, gate_up_all.shape[0],
                       lambda e, xs: expert_ffn(xs, gate_up_all[e], down_all[e], act_fn))
