"""Triton W4A16 fused MoE for the INT4 draft: two launches per layer, no host synchronisation.

Weights are the symmetric INT4 stacks of `specter.quant.int4` (qweight [E, N, K/8] int32,
scales [E, N, K/gs]); the kernels unpack nibbles in registers, so no dequantized copy exists.
Activations are fp16 / bf16 (the GPU draft) or fp32 (tests).

    topk_idx [T,k] ──align_routes (device ops, fixed max size P)──► sorted_ids [P]  route id t*k+j, or S = pad
                                                                    block_expert [P/BM]  expert, or -1 = idle block
    x [T,H] ──► launch 1: gate_up kernel, grid (P/BM, ⌈I/BN⌉)
                  rows = x[sorted_ids // k]            [BM, H]  (pad rows load 0)
                  gate = rows @ W_gu[e, n]^T,  up = rows @ W_gu[e, I+n]^T   (INT4 unpacked per K-tile)
                  a = silu(gate) · up  ─────────────────────────► a [P, I]   (other act: h [P, 2I], act in torch)
            ──► launch 2: down kernel, grid (P/BM, ⌈H/BN⌉)
                  y = a[block rows] @ W_dn[e]^T · topk_w[route]  (router weight in the epilogue)
                  stored at row `route` ────────────────────────► y [S, H]   (S = T·k; masked routes stay 0)
    y.view(T, k, H).sum(1) ─────────────────────────────────────► out [T, H]

Routes are grouped by expert into blocks of BLOCK_M rows (each expert's group padded to a
multiple of BLOCK_M, as vLLM's fused MoE does). The padded length is bounded by
P = S + min(E, S)·(BLOCK_M − 1) using shapes alone, so every buffer is sized without reading
a device value; idle blocks (block_expert = −1) return at once.

Numerics follow `draft_moe_reference`: each weight is (code − 8)·scale in the activation dtype,
products accumulate in fp32, gate/up and the activation are rounded to the activation dtype
where the reference rounds them. fp32 activations use IEEE fp32 dots (not TF32).

On a CPU the kernels run only in Triton's interpreter (`TRITON_INTERPRET=1`, set before this
module is imported). The interpreter's bf16 dot is wrong, so there bf16 operands are upcast to
fp32 inside the kernel (`COMPUTE`); on a GPU bf16 goes to the tensor cores as bf16.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specter.quant.int4 import Int4Experts

ActFn = Callable[[torch.Tensor], torch.Tensor]

_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at import time)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def is_silu(act_fn: ActFn) -> bool:
    """The kernel fuses SiLU only; any other activation runs in torch between the two launches."""
    return act_fn is F.silu or isinstance(act_fn, torch.nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"


# ----------------------------------------------------------------------------- routing


@dataclass
class AlignedRoutes:
    """Routes grouped by expert, each group padded to a multiple of `block_m` rows (all on the device)."""

    sorted_ids: torch.Tensor  # [P] int32 route id t*k + j, expert-major (stable); `num_routes` marks padding
    block_expert: torch.Tensor  # [P / block_m] int32 expert of each block, -1 for idle blocks
    num_routes: int  # S = T*k
    top_k: int
    block_m: int

    @property
    def max_rows(self) -> int:
        return self.sorted_ids.numel()


def max_padded_rows(num_routes: int, num_experts: int, block_m: int) -> int:
    """Upper bound P on the padded route count: S + min(E, S)·(BM − 1), rounded up to BM."""
    p = num_routes + min(num_experts, num_routes) * (block_m - 1)
    return max(block_m, triton.cdiv(p, block_m) * block_m)


def align_routes(topk_idx: torch.Tensor, num_experts: int, block_m: int) -> AlignedRoutes:
    """Sort (token, slot) routes by expert and pad each expert to whole blocks, with device ops only.

    Routes to ids outside [0, E) (masked routes) are dropped, as transformers' loop skips them.
    """
    t, k = topk_idx.shape
    s = t * k
    dev = topk_idx.device
    p = max_padded_rows(s, num_experts, block_m)
    flat = topk_idx.reshape(-1).long()  # [S]
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))  # [S], invalid routes -> E
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))  # [E+1] (bincount would sync to size its output)
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m  # [E]
    pad_end = padded.cumsum(0)  # [E] end row of each expert's padded group
    pad_start = pad_end - padded  # [E]
    order = torch.argsort(key, stable=True)  # [S] route ids, expert-major
    skey = key[order]  # [S]
    first = counts.cumsum(0) - counts  # [E+1] first sorted position of each key
    rank = torch.arange(s, device=dev) - first[skey]  # [S] position within its expert
    dest = torch.where(skey < num_experts, pad_start[skey.clamp(max=num_experts - 1)] + rank,
                       torch.full_like(skey, p))  # [S]; invalid routes go to the dump row P
    sorted_ids = torch.full((p + 1,), s, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    block_start = torch.arange(0, p, block_m, device=dev)  # [P/BM]
    block_expert = torch.searchsorted(pad_end, block_start, right=True)  # [P/BM] in [0, E]
    block_expert = torch.where(block_expert < num_experts, block_expert, torch.full_like(block_expert, -1))
    return AlignedRoutes(sorted_ids[:p], block_expert.to(torch.int32), s, k, block_m)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _int4_dot(acc, a_ptrs, a_mask, stride_ak, w_ptrs, stride_wk, s_ptrs, stride_sg, n_mask, K,
              GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, COMPUTE: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """acc [BM, BN] += A [BM, K] @ W^T [K, BN], W read as INT4 codes and group scales, unpacked here.

    a_ptrs [BM, 1] point at column 0 of the rows, w_ptrs [1, BN] at word 0 of the weight rows,
    s_ptrs [BN] at group 0 of the scales. BLOCK_K divides GROUP_SIZE, so one scale per K-tile.
    """
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k  # [BK]
        a = tl.load(a_ptrs + kk[None, :] * stride_ak, mask=a_mask, other=0.0)  # [BM, BK]
        words = tl.load(w_ptrs + (kk // 8)[:, None] * stride_wk, mask=n_mask[None, :], other=0)  # [BK, BN] int32
        codes = (words >> ((kk % 8) * 4)[:, None]) & 0xF  # [BK, BN] in [0, 15]
        scale = tl.load(s_ptrs + (k0 // GROUP_SIZE) * stride_sg, mask=n_mask, other=0.0)  # [BN]
        w = (codes - 8).to(COMPUTE) * scale.to(COMPUTE)[None, :]  # [BK, BN]: (code - 8)·scale, as dequantize()
        acc = tl.dot(a.to(COMPUTE), w, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _gate_up_kernel(x_ptr, qw_ptr, sc_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
                    I, K, num_routes, top_k,
                    stride_xt, stride_xk, stride_qe, stride_qn, stride_qk, stride_se, stride_sn, stride_sg,
                    stride_om, stride_on,
                    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, FUSE_SILU: tl.constexpr, COMPUTE: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """One [BM rows × BN intermediate columns] tile of gate and up for one expert block."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    x_dtype = x_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] padded row
    route = tl.load(sorted_ids_ptr + offs_m)  # [BM]
    row_ok = route < num_routes
    token = tl.where(row_ok, route // top_k, 0)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] intermediate column
    n_ok = offs_n < I
    a_ptrs = x_ptr + token[:, None] * stride_xt  # [BM, 1]
    a_mask = row_ok[:, None]
    qw = qw_ptr + expert.to(tl.int64) * stride_qe
    sc = sc_ptr + expert.to(tl.int64) * stride_se
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_g = _int4_dot(acc_g, a_ptrs, a_mask, stride_xk, qw + offs_n[None, :] * stride_qn, stride_qk,
                      sc + offs_n * stride_sn, stride_sg, n_ok, K, GROUP_SIZE, BLOCK_K, COMPUTE,
                      DOT_PRECISION)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = _int4_dot(acc_u, a_ptrs, a_mask, stride_xk, qw + (I + offs_n)[None, :] * stride_qn, stride_qk,
                      sc + (I + offs_n) * stride_sn, stride_sg, n_ok, K, GROUP_SIZE, BLOCK_K, COMPUTE,
                      DOT_PRECISION)
    # round where the reference's F.linear rounds (to the activation dtype), then act in fp32
    gate = acc_g.to(x_dtype).to(tl.float32)
    up = acc_u.to(x_dtype).to(tl.float32)
    o_rows = out_ptr + offs_m[:, None].to(tl.int64) * stride_om
    if FUSE_SILU:
        act = (gate / (1.0 + tl.exp(-gate))).to(x_dtype).to(tl.float32)  # silu, rounded as F.silu's output
        tl.store(o_rows + offs_n[None, :] * stride_on, (act * up).to(x_dtype), mask=n_ok[None, :])
    else:  # h = [gate | up], the activation runs in torch
        tl.store(o_rows + offs_n[None, :] * stride_on, gate.to(x_dtype), mask=n_ok[None, :])
        tl.store(o_rows + (I + offs_n)[None, :] * stride_on, up.to(x_dtype), mask=n_ok[None, :])


@triton.jit
def _down_kernel(a_ptr, qw_ptr, sc_ptr, y_ptr, sorted_ids_ptr, block_expert_ptr, topk_w_ptr,
                 H, K, num_routes,
                 stride_am, stride_ak, stride_qe, stride_qn, stride_qk, stride_se, stride_sn, stride_sg,
                 stride_ym, stride_yn,
                 GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, COMPUTE: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """One [BM routes × BN hidden columns] tile of the down projection, router weight in the epilogue."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    a_dtype = a_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] padded row = row of `a`
    route = tl.load(sorted_ids_ptr + offs_m)  # [BM]
    row_ok = route < num_routes
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] hidden column
    n_ok = offs_n < H
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = _int4_dot(acc, a_ptr + offs_m[:, None].to(tl.int64) * stride_am, row_ok[:, None], stride_ak,
                    qw_ptr + expert.to(tl.int64) * stride_qe + offs_n[None, :] * stride_qn, stride_qk,
                    sc_ptr + expert.to(tl.int64) * stride_se + offs_n * stride_sn, stride_sg, n_ok, K,
                    GROUP_SIZE, BLOCK_K, COMPUTE, DOT_PRECISION)
    # like the reference: y rounded to the activation dtype, then times the router weight
    w = tl.load(topk_w_ptr + route, mask=row_ok, other=0.0).to(tl.float32)  # [BM]
    y = acc.to(a_dtype).to(tl.float32) * w[:, None]
    safe_route = tl.where(row_ok, route, 0).to(tl.int64)
    tl.store(y_ptr + safe_route[:, None] * stride_ym + offs_n[None, :] * stride_yn, y.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


# ----------------------------------------------------------------------------- launch


@dataclass(frozen=True)
class TritonMoEConfig:
    """Tile sizes of both launches. BLOCK_K must divide both projections' group sizes."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def default_config(num_routes: int, num_experts: int, group_size: int, interpret: bool | None = None
                   ) -> TritonMoEConfig:
    """Tiles by regime: decode (few routes per expert) wants BM=16; prefill wants taller tiles.

    Under the interpreter each program is a Python call, so it uses wide N tiles to launch fewer
    programs (tile sizes do not change the arithmetic, only the summation order within fp32).
    """
    interpret = interpreting() if interpret is None else interpret
    block_k = min(64, group_size)
    if interpret:
        return TritonMoEConfig(block_m=16, block_n=128, block_k=min(128, group_size), num_warps=1, num_stages=1)
    per_expert = num_routes / max(1, min(num_experts, num_routes))  # mean routes per active expert
    if per_expert <= 16:
        return TritonMoEConfig(16, 64, block_k, 4, 3)
    if per_expert <= 48:
        return TritonMoEConfig(32, 64, block_k, 4, 3)
    return TritonMoEConfig(64, 128, block_k, 8, 3)


def supports(x: torch.Tensor, gate_up: Int4Experts, down: Int4Experts) -> str | None:
    """None when the Triton kernel can run this call, else the reason it cannot."""
    if x.dtype not in _TL_DTYPE:
        return f"activation dtype {x.dtype} (needs fp16, bf16 or fp32)"
    if not x.is_cuda and not interpreting():
        return "a CPU tensor outside TRITON_INTERPRET=1"
    if min(gate_up.group_size, down.group_size) < 16:
        return f"group size {min(gate_up.group_size, down.group_size)} < 16 (tl.dot needs K tiles of 16)"
    if gate_up.out_features != 2 * down.in_features or gate_up.in_features != down.out_features:
        return "gate_up [E, 2I, H] and down [E, H, I] do not match"
    return None


def _compute_dtype(dtype: torch.dtype) -> tl.dtype:
    """Dtype of the unpacked weights and of the dot operands: the activation dtype, except bf16 in the
    interpreter, whose bf16 arithmetic and dot are wrong (its fp32 -> bf16 cast also truncates)."""
    if dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return _TL_DTYPE[dtype]


def fused_moe_w4a16(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, gate_up: Int4Experts,
                    down: Int4Experts, act_fn: ActFn, *, config: TritonMoEConfig | None = None) -> torch.Tensor:
    """Routed-expert MoE of the INT4 draft in two Triton launches: x [T, H], topk [T, k] -> [T, H] in x.dtype."""
    reason = supports(x, gate_up, down)
    if reason is not None:
        raise ValueError(f"Triton draft MoE cannot run: {reason}")
    t, hidden = x.shape
    k = topk_idx.shape[1]
    inter = down.in_features
    num_experts = gate_up.num_experts
    if t == 0 or k == 0:
        return torch.zeros_like(x)
    cfg = config or default_config(t * k, num_experts, min(gate_up.group_size, down.group_size))
    if gate_up.group_size % cfg.block_k or down.group_size % cfg.block_k or cfg.block_k % 8:
        raise ValueError(f"block_k={cfg.block_k} must be a multiple of 8 dividing the group sizes "
                         f"({gate_up.group_size}, {down.group_size})")
    r = align_routes(topk_idx, num_experts, cfg.block_m)
    p = r.max_rows
    compute = _compute_dtype(x.dtype)
    precision = "ieee" if compute == tl.float32 else "tf32"  # fp32: no TF32 rounding; fp16/bf16 ignore it
    launch = {} if interpreting() else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    fuse = is_silu(act_fn)
    h = torch.empty(p, inter if fuse else 2 * inter, dtype=x.dtype, device=x.device)  # [P, I] or [P, 2I]
    qg, sg = gate_up.qweight, gate_up.scales
    grid = (p // cfg.block_m, triton.cdiv(inter, cfg.block_n))
    _gate_up_kernel[grid](
        x, qg, sg, h, r.sorted_ids, r.block_expert, inter, hidden, r.num_routes, k,
        x.stride(0), x.stride(1), qg.stride(0), qg.stride(1), qg.stride(2), sg.stride(0), sg.stride(1), sg.stride(2),
        h.stride(0), h.stride(1),
        GROUP_SIZE=gate_up.group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        FUSE_SILU=fuse, COMPUTE=compute, DOT_PRECISION=precision, **launch)
    a = h if fuse else act_fn(h[:, :inter]) * h[:, inter:]  # [P, I]
    y = torch.zeros(r.num_routes, hidden, dtype=x.dtype, device=x.device)  # [S, H]; masked routes stay 0
    w = topk_w.reshape(-1)  # [S]
    w = w if w.is_contiguous() else w.contiguous()
    qd, sd = down.qweight, down.scales
    grid = (p // cfg.block_m, triton.cdiv(hidden, cfg.block_n))
    _down_kernel[grid](
        a, qd, sd, y, r.sorted_ids, r.block_expert, w, hidden, inter, r.num_routes,
        a.stride(0), a.stride(1), qd.stride(0), qd.stride(1), qd.stride(2), sd.stride(0), sd.stride(1), sd.stride(2),
        y.stride(0), y.stride(1),
        GROUP_SIZE=down.group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        COMPUTE=compute, DOT_PRECISION=precision, **launch)
    return y.view(t, k, hidden).sum(dim=1)  # [T, H]: fp32 accumulation inside torch's sum, rounded once


def kmajor_layout(packed: Int4Experts) -> Int4Experts:
    """Same values, stored [E, K/8, N] / [E, G, N] (N contiguous) and viewed back as [E, N, ·].

    The kernels read any strides; this storage makes a warp's weight and scale loads contiguous
    along N (GPTQ's layout) instead of along K. For the Triton path only: the CPU paths of
    `draft_moe` need the native layout. Which is faster on a GPU is for bench_draft_kernel.py.
    """
    qw = packed.qweight.transpose(1, 2).contiguous().transpose(1, 2)  # [E, N, K/8], strides of [E, K/8, N]
    sc = packed.scales.transpose(1, 2).contiguous().transpose(1, 2)  # [E, N, G], strides of [E, G, N]
    return Int4Experts(qw, sc, packed.group_size, packed.sym, packed.method, packed.rtn_fallback_experts)
