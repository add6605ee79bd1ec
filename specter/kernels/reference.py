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


def moe_reference(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, gate_up_all: torch.Tensor,
                  down_all: torch.Tensor, act_fn: ActFn) -> torch.Tensor:
    """Routed experts over dense weights gate_up_all [E, 2I, H], down_all [E, H, I]: x [T, H] -> [T, H].

    Out-of-range expert ids (masked routes) are skipped, as transformers does.
    """
    num_experts = gate_up_all.shape[0]
    out = torch.zeros_like(x)  # [T, H]
    mask = F.one_hot(topk_idx.long().clamp(0, num_experts), num_classes=num_experts + 1)  # [T, k, E+1]
    mask = mask.permute(2, 1, 0)  # [E+1, k, T]
    for e in (mask.sum(dim=(-1, -2)) > 0).nonzero().flatten().tolist():
        if e == num_experts:
            continue
        slot, tok = torch.where(mask[e])
        y = expert_ffn(x[tok], gate_up_all[e], down_all[e], act_fn) * topk_w[tok, slot, None]  # [n, H]
        out.index_add_(0, tok, y.to(out.dtype))
    return out
