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
products accumulate in fp32, and gate, up, silu, act·up, y and y·w are rounded to the
activation dtype where the reference rounds them; only the k expert outputs are summed in fp32
and rounded once (the reference adds them one by one). fp32 uses IEEE dots, not TF32.

On a CPU the kernels run only in Triton's interpreter (`TRITON_INTERPRET=1` when this module
is imported). There the dot operands, already rounded to the activation dtype, are held in fp32
(`COMPUTE`: the same products and fp32 sums, and numpy has no fast fp16 matmul), and bf16
rounding is done by hand (`RNE_BF16`: the interpreter's bf16 arithmetic is wrong and its
fp32 → bf16 cast truncates). On a GPU the dots run in fp16 / bf16 on the tensor cores.
"""
from __future__ import annotations

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
    """True when this module's kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return INTERPRETED


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
    sorted_ids.scatter_(0, dest, order.to(torch.int32))  # [P+1]; row P collects the dropped routes
    block_start = torch.arange(0, p, block_m, device=dev)  # [P/BM]
    block_expert = torch.searchsorted(pad_end, block_start, right=True)  # [P/BM] in [0, E]
    block_expert = torch.where(block_expert < num_experts, block_expert, torch.full_like(block_expert, -1))
    return AlignedRoutes(sorted_ids[:p], block_expert.to(torch.int32), s, k, block_m)


# ----------------------------------------------------------------------------- kernels
#
# Both kernels walk K in tiles of BLOCK_K: activations [BM, BK] (fp16/bf16/fp32) and, per weight
# row block, int32 words [BK, BN] (word k // 8 of each row, nibble k % 8), unpacked and scaled to
# the compute dtype in registers: w = (code − 8)·scale, exactly `dequantize`'s value. Either
# BLOCK_K divides the group size (one scale per row per tile) or the group size divides BLOCK_K
# (a scale per element). Helpers are inlined by hand: Triton's interpreter re-patches the
# language on every nested jit call, which would dominate its run time.


@triton.jit
def _rne_bf16(x):
    """fp32 x rounded to bf16 (nearest even) and kept in fp32. Interpreter only: its own fp32 -> bf16
    cast truncates and its bf16 arithmetic is wrong; casting the result to bf16 later is exact."""
    bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF  # the fp32 bits, unsigned, in int64
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def _gate_up_kernel(x_ptr, qw_ptr, sc_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
                    I, K, num_routes, top_k,
                    stride_xt, stride_xk, stride_qe, stride_qn, stride_qk, stride_se, stride_sn, stride_sg,
                    stride_om, stride_on,
                    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, FUSE_SILU: tl.constexpr, COMPUTE: tl.constexpr,
                    RNE_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Program (m, n): rows of block m (one expert) × intermediate columns n..n+BN of gate and of up."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:  # idle block past the last expert's padding
        return
    x_dtype = x_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] padded row
    route = tl.load(sorted_ids_ptr + offs_m)  # [BM] t*k + j, or num_routes for padding
    row_ok = route < num_routes
    token = tl.where(row_ok, route // top_k, 0).to(tl.int64)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] intermediate column (gate row n, up row I + n)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xk  # [BM, BK]
    g_ptrs = qw_ptr + expert * stride_qe + offs_n[None, :] * stride_qn + (offs_k // 8)[:, None] * stride_qk  # [BK, BN]
    u_ptrs = g_ptrs + I * stride_qn
    gs_ptrs = sc_ptr + expert * stride_se + offs_n * stride_sn  # [BN] group 0 of the gate rows
    us_ptrs = gs_ptrs + I * stride_sn
    shifts = ((offs_k % 8) * 4)[:, None]  # [BK, 1]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0  # [BK]
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(COMPUTE)  # [BM, BK]
        w_mask = k_ok[:, None] & n_ok[None, :]  # [BK, BN]
        g_codes = (tl.load(g_ptrs, mask=w_mask, other=0) >> shifts) & 0xF  # [BK, BN] in [0, 15]
        u_codes = (tl.load(u_ptrs, mask=w_mask, other=0) >> shifts) & 0xF
        if BLOCK_K <= GROUP_SIZE:  # one group per tile: [1, BN] scales
            g_scale = tl.load(gs_ptrs + (k0 // GROUP_SIZE) * stride_sg, mask=n_ok, other=0.0)[None, :]
            u_scale = tl.load(us_ptrs + (k0 // GROUP_SIZE) * stride_sg, mask=n_ok, other=0.0)[None, :]
        else:  # several groups per tile: [BK, BN] scales
            g_off = ((k0 + offs_k) // GROUP_SIZE)[:, None] * stride_sg
            g_scale = tl.load(gs_ptrs[None, :] + g_off, mask=w_mask, other=0.0)
            u_scale = tl.load(us_ptrs[None, :] + g_off, mask=w_mask, other=0.0)
        if RNE_BF16:  # bf16 under the interpreter: bf16-rounded scale and weight, held in fp32
            w_g = _rne_bf16((g_codes - 8).to(tl.float32) * _rne_bf16(g_scale.to(tl.float32)))
            w_u = _rne_bf16((u_codes - 8).to(tl.float32) * _rne_bf16(u_scale.to(tl.float32)))
        else:  # exactly dequantize()'s value in x's dtype, then COMPUTE (fp32 in the interpreter)
            w_g = ((g_codes - 8).to(x_dtype) * g_scale.to(x_dtype)).to(COMPUTE)  # [BK, BN]
            w_u = ((u_codes - 8).to(x_dtype) * u_scale.to(x_dtype)).to(COMPUTE)
        acc_g = tl.dot(a, w_g, acc_g, input_precision=DOT_PRECISION)  # [BM, BN] fp32
        acc_u = tl.dot(a, w_u, acc_u, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_xk
        g_ptrs += (BLOCK_K // 8) * stride_qk
        u_ptrs += (BLOCK_K // 8) * stride_qk
    # epilogue in fp32, rounded to x's dtype wherever the reference rounds
    if RNE_BF16:
        gate = _rne_bf16(acc_g)
        up = _rne_bf16(acc_u)
    else:
        gate = acc_g.to(x_dtype).to(tl.float32)  # F.linear's output
        up = acc_u.to(x_dtype).to(tl.float32)
    o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on  # [BM, BN]
    if FUSE_SILU:
        act = gate / (1.0 + tl.exp(-gate))  # silu
        if RNE_BF16:
            h = _rne_bf16(_rne_bf16(act) * up)
        else:
            h = act.to(x_dtype).to(tl.float32) * up  # F.silu's output, then act·up
        tl.store(o_ptrs, h.to(x_dtype), mask=n_ok[None, :])  # padding rows store 0 (their loads were 0)
    else:  # h = [gate | up]; the activation runs in torch
        tl.store(o_ptrs, gate.to(x_dtype), mask=n_ok[None, :])
        tl.store(o_ptrs + I * stride_on, up.to(x_dtype), mask=n_ok[None, :])


@triton.jit
def _down_kernel(a_ptr, qw_ptr, sc_ptr, y_ptr, sorted_ids_ptr, block_expert_ptr, topk_w_ptr,
                 H, K, num_routes,
                 stride_am, stride_ak, stride_qe, stride_qn, stride_qk, stride_se, stride_sn, stride_sg,
                 stride_ym, stride_yn,
                 GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, COMPUTE: tl.constexpr, RNE_BF16: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """Program (m, n): rows of block m (one expert) × hidden columns n..n+BN, router weight in the epilogue."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    a_dtype = a_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] padded row = row of `a`
    route = tl.load(sorted_ids_ptr + offs_m)  # [BM]
    row_ok = route < num_routes
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] hidden column
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak  # [BM, BK]
    w_ptrs = qw_ptr + expert * stride_qe + offs_n[None, :] * stride_qn + (offs_k // 8)[:, None] * stride_qk
    s_ptrs = sc_ptr + expert * stride_se + offs_n * stride_sn  # [BN]
    shifts = ((offs_k % 8) * 4)[:, None]  # [BK, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(COMPUTE)  # [BM, BK]
        w_mask = k_ok[:, None] & n_ok[None, :]
        codes = (tl.load(w_ptrs, mask=w_mask, other=0) >> shifts) & 0xF  # [BK, BN]
        if BLOCK_K <= GROUP_SIZE:
            scale = tl.load(s_ptrs + (k0 // GROUP_SIZE) * stride_sg, mask=n_ok, other=0.0)[None, :]  # [1, BN]
        else:
            scale = tl.load(s_ptrs[None, :] + ((k0 + offs_k) // GROUP_SIZE)[:, None] * stride_sg, mask=w_mask,
                            other=0.0)  # [BK, BN]
        if RNE_BF16:
            w = _rne_bf16((codes - 8).to(tl.float32) * _rne_bf16(scale.to(tl.float32)))
        else:
            w = ((codes - 8).to(a_dtype) * scale.to(a_dtype)).to(COMPUTE)  # [BK, BN]
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += (BLOCK_K // 8) * stride_qk
    # like the reference: y = F.linear(...) rounded, then y·w rounded
    w_route = tl.load(topk_w_ptr + route, mask=row_ok, other=0.0).to(tl.float32)  # [BM]
    if RNE_BF16:
        y = _rne_bf16(_rne_bf16(acc) * w_route[:, None])
    else:
        y = acc.to(a_dtype).to(tl.float32) * w_route[:, None]  # [BM, BN]
    y_rows = tl.where(row_ok, route, 0).to(tl.int64)  # [BM] output row = route id
    tl.store(y_ptr + y_rows[:, None] * stride_ym + offs_n[None, :] * stride_yn, y.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


# triton.jit returns an interpreter object when TRITON_INTERPRET was set at decoration time
INTERPRETED = type(_gate_up_kernel).__name__ == "InterpretedFunction"


# ----------------------------------------------------------------------------- launch


@dataclass(frozen=True)
class TritonMoEConfig:
    """Tile sizes of both launches. block_k: a power of two >= 16; it divides or is a multiple of each group size."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def default_config(num_routes: int, num_experts: int, interpret: bool | None = None) -> TritonMoEConfig:
    """Tiles by regime: decode (few routes per expert) wants BM=16; prefill wants taller tiles.

    Under the interpreter each program is a Python call, so it uses wide tiles to launch fewer
    programs and loop less (tile sizes do not change the arithmetic, only the fp32 summation order).
    These GPU tiles are a first guess, not tuned: no GPU was available while writing them.
    """
    interpret = interpreting() if interpret is None else interpret
    block_k = 64
    if interpret:
        return TritonMoEConfig(block_m=16, block_n=256, block_k=128, num_warps=1, num_stages=1)
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
    for gs in (gate_up.group_size, down.group_size):
        if gs & (gs - 1):
            return f"group size {gs} is not a power of two (K tiles hold whole groups or whole tiles)"
    if gate_up.out_features != 2 * down.in_features or gate_up.in_features != down.out_features:
        return "gate_up [E, 2I, H] and down [E, H, I] do not match"
    return None


def _compute_dtype(dtype: torch.dtype) -> tuple[tl.dtype, bool]:
    """(dtype of the dot operands, emulate bf16 rounding).

    On a GPU the dot runs in the activation dtype (tensor cores, fp32 accumulation). In the
    interpreter the operands (already rounded to the activation dtype) are held in fp32, which
    gives the same products and fp32 sums: numpy has no fast fp16 matmul, and the interpreter's
    bf16 arithmetic is wrong and its fp32 -> bf16 cast truncates, so bf16 rounding is done by hand.
    """
    if interpreting():
        return tl.float32, dtype == torch.bfloat16
    return _TL_DTYPE[dtype], False


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
    cfg = config or default_config(t * k, num_experts)
    for gs in (gate_up.group_size, down.group_size):
        if cfg.block_k < 16 or cfg.block_k & (cfg.block_k - 1) or (gs % cfg.block_k and cfg.block_k % gs):
            raise ValueError(f"block_k={cfg.block_k} must be a power of two >= 16 that divides or is a multiple "
                             f"of the group sizes ({gate_up.group_size}, {down.group_size})")
    r = align_routes(topk_idx, num_experts, cfg.block_m)
    p = r.max_rows
    compute, rne_bf16 = _compute_dtype(x.dtype)
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
        FUSE_SILU=fuse, COMPUTE=compute, RNE_BF16=rne_bf16, DOT_PRECISION=precision, **launch)
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
        COMPUTE=compute, RNE_BF16=rne_bf16, DOT_PRECISION=precision, **launch)
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
