"""GPTQ (symmetric INT4, group-wise, desc_act=False) for one MoE layer's routed experts.

Each expert's two linears are quantized from the tokens routed to it:
  gate_up [2I, H] from x_e [n_e, H];
  down    [H, I]  from act(gate)·up of the same tokens — computed with the already quantized
          gate_up when `sequential` (as gptqmodel's true-sequential mode does), so the down
          projection compensates for the error the draft actually sees.
Experts that received no calibration tokens fall back to round-to-nearest (counted in
`Int4Experts.rtn_fallback_experts`).

Two engines produce the same format:
  "gptqmodel" : gptqmodel's own `GPTQ` class (Hessian accumulation + quantization of one linear),
                driven directly on a plain `nn.Linear`, CPU or GPU.
  "builtin"   : `gptq_reference`, a short transcription of the algorithm (H = 2XᵀX/n, dampening,
                Cholesky of H⁻¹, column-by-column quantization with error feedback, a group's
                scales fixed when its first column is reached). Used to cross-check gptqmodel.
"""
from __future__ import annotations

import os
from typing import Callable, Literal, Sequence

import torch
import torch.nn as nn

from specter.quant.int4 import (MAXQ, ZERO_POINT, Int4Experts, Int4ExpertLayer, codes_from_dequantized,
                                concat_experts, default_group_size, dequantize, pack_codes, quantize_rtn)

Engine = Literal["gptqmodel", "builtin"]
DRAFT_BITS = (2, 3, 4)  # the paper's draft is 4; fewer bits are a calibration of a proxy's acceptance
ActFn = Callable[[torch.Tensor], torch.Tensor]


def _sym_scale(w: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """GPTQ's symmetric scale per row of w [N, gs]: 2·absmax/(2^bits - 1) (1 for all-zero rows)."""
    amax = w.abs().amax(dim=1)
    return torch.where(amax > 0, amax * (2.0 / (2**bits - 1)), torch.ones_like(amax))  # [N]


def check_bits(bits: int) -> int:
    """Draft precision: GPTQ's symmetric grid of 2^bits levels, stored in the INT4 layout (codes
    centred on the INT4 zero point 8), so every kernel runs any of them unchanged."""
    if bits not in DRAFT_BITS:
        raise ValueError(f"draft bits must be one of {DRAFT_BITS}, got {bits!r}")
    return bits


def gptq_reference(w: torch.Tensor, x: torch.Tensor, group_size: int = 128, damp_percent: float = 0.01,
                   block_size: int = 128, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ of one linear w [N, K] from inputs x [n, K] -> (codes [N, K] in [0, 15], scales [N, K/gs] fp32).

    With bits < 4 the codes use 2^bits levels around the INT4 zero point (8 - 2^(bits-1) .. 8 + 2^(bits-1) - 1)."""
    maxq, zero = 2**check_bits(bits) - 1, 2 ** (bits - 1)
    n_out, k = w.shape
    W = w.detach().float().clone()  # [N, K], updated in place by the error feedback
    X = x.detach().float().reshape(-1, k)  # [n, K]
    H = X.t() @ X * (2.0 / X.shape[0])  # [K, K]
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H.diagonal().add_(damp_percent * torch.mean(torch.diag(H)))
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)  # [K, K]
    codes = torch.zeros(n_out, k, dtype=torch.uint8, device=W.device)
    scales = torch.zeros(n_out, k // group_size, device=W.device)
    scale = torch.ones(n_out, device=W.device)
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        W1 = W[:, b0:b1].clone()  # [N, B]
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if col % group_size == 0:  # as in GPTQ: scales from W as updated up to this block's start
                scale = _sym_scale(W[:, col:col + group_size], bits)
                scales[:, col // group_size] = scale
            wcol = W1[:, i]
            q = torch.clamp(torch.round(wcol / scale) + zero, 0, maxq)  # [N], on the 2^bits grid
            codes[:, col] = (q - zero + ZERO_POINT).to(torch.uint8)
            err = (wcol - (q - zero) * scale) / Hinv1[i, i]  # [N]
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, b1:] -= Err1 @ Hinv[b0:b1, b1:]
    return codes, scales


def gptqmodel_linear(w: torch.Tensor, x: torch.Tensor, group_size: int, damp_percent: float,
                     act_group_aware: bool, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """gptqmodel's GPTQ on one linear; same return convention as `gptq_reference`."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    from specter.quiet import quiet_import

    with quiet_import():  # its banner and environment notices stay out of the run's output (verbose=true shows them)
        from gptqmodel.quantization.config import QuantizeConfig
        from gptqmodel.quantization.gptq import GPTQ

    n_out, k = w.shape
    linear = nn.Linear(k, n_out, bias=False, device=w.device)
    linear.weight.data = w.detach().float().clone()
    qcfg = QuantizeConfig(bits=check_bits(bits), group_size=group_size, sym=True, desc_act=False, damp_percent=damp_percent,
                          act_group_aware=act_group_aware, fallback=None, offload_to_disk=False)
    task = GPTQ(linear, qcfg)
    task.quantizer.configure(perchannel=True)
    task.add_batch(x.detach().float().reshape(-1, k), None)
    q, scale, zero, g_idx, *_ = task.quantize(blocksize=128)  # q [N, K] on the grid, scale/zero [N, G]
    expected = torch.arange(k, device=g_idx.device) // group_size
    if not torch.equal(g_idx.long(), expected) or not bool((zero == 2 ** (bits - 1)).all()):
        raise RuntimeError("gptqmodel returned a non-symmetric or reordered quantization")
    codes = codes_from_dequantized(q, scale, group_size)
    return codes.to(torch.uint8).to(w.device), scale.float().to(w.device)


def _pack_one(codes: torch.Tensor, scales: torch.Tensor, group_size: int, scale_dtype: torch.dtype) -> Int4Experts:
    """Codes [N, K] and fp32 scales [N, G] -> a one-expert stack.

    The grid is re-anchored on the stored (rounded) scales: codes stay, only the scale dtype changes.
    """
    return Int4Experts(pack_codes(codes).unsqueeze(0), scales.to(scale_dtype).unsqueeze(0), group_size,
                       method="gptq")


def quantize_linear(w: torch.Tensor, x: torch.Tensor, group_size: int, damp_percent: float = 0.01,
                    engine: Engine = "gptqmodel", act_group_aware: bool = False,
                    scale_dtype: torch.dtype = torch.float16, bits: int = 4) -> Int4Experts:
    """GPTQ of one linear w [N, K] from inputs x [n, K] -> a one-expert `Int4Experts`."""
    x = x.to(w.device)
    if engine == "gptqmodel":
        codes, scales = gptqmodel_linear(w, x, group_size, damp_percent, act_group_aware, bits)
    elif engine == "builtin":
        codes, scales = gptq_reference(w, x, group_size, damp_percent, bits=bits)
    else:
        raise ValueError(f"unknown engine {engine!r}")
    return _pack_one(codes, scales, group_size, scale_dtype)


def gptq_quantize_experts(gate_up: Sequence[torch.Tensor], down: Sequence[torch.Tensor],
                          inputs_per_expert: Sequence[torch.Tensor],
                          act_fn: ActFn, group_size: int = 128, *, damp_percent: float = 0.01,
                          engine: Engine = "gptqmodel", sequential: bool = True, act_group_aware: bool = False,
                          scale_dtype: torch.dtype = torch.float16, bits: int = 4) -> Int4ExpertLayer:
    """GPTQ INT4 (or `bits` < 4 in the INT4 layout) of a layer's routed experts.

    gate_up[e] [2I, H] (gate rows first), down[e] [H, I]: stacked tensors or per-expert views (one
    expert is quantized at a time); inputs_per_expert[e] = the hidden states [n_e, H] routed to
    expert e (n_e may be 0). `group_size` shrinks only when a dim forces it.
    """
    num_experts, hidden = len(gate_up), gate_up[0].shape[1]
    if len(inputs_per_expert) != num_experts:
        raise ValueError(f"{len(inputs_per_expert)} input sets for {num_experts} experts")
    gs_gu = default_group_size(hidden, group_size)
    gs_dn = default_group_size(down[0].shape[1], group_size)
    gu_parts: list[Int4Experts] = []
    dn_parts: list[Int4Experts] = []
    fallback: list[int] = []
    for e in range(num_experts):
        x_e = inputs_per_expert[e].reshape(-1, hidden)
        if x_e.shape[0] == 0:
            fallback.append(e)
            gu_parts.append(quantize_rtn(gate_up[e][None], gs_gu, scale_dtype, bits))
            dn_parts.append(quantize_rtn(down[e][None], gs_dn, scale_dtype, bits))
            continue
        gu_q = quantize_linear(gate_up[e], x_e, gs_gu, damp_percent, engine, act_group_aware, scale_dtype, bits)
        w_gu = dequantize(gu_q, torch.float32)[0] if sequential else gate_up[e].float()  # [2I, H]
        gate, up = (x_e.float() @ w_gu.t().to(x_e.device)).chunk(2, dim=-1)  # [n_e, I] each
        a_e = act_fn(gate) * up  # [n_e, I]: the down projection's inputs
        gu_parts.append(gu_q)
        dn_parts.append(quantize_linear(down[e], a_e, gs_dn, damp_percent, engine, act_group_aware, scale_dtype, bits))
    return Int4ExpertLayer(concat_experts(gu_parts, "gptq", tuple(fallback)), concat_experts(dn_parts, "gptq", tuple(fallback)))


