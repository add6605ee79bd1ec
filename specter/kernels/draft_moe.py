"""Fused multi-expert W4A16 MoE for the INT4 draft: reference and CPU fast paths.

Routing math (identical to transformers' eager experts loop):

    for each expert e in ascending id, for its tokens x [n, H]:
        gate, up = F.linear(x, W_gu[e]).chunk(2, -1)        # [n, I] each
        y = F.linear(act(gate) * up, W_down[e]) * w[:, None]  # [n, H]
        out.index_add_(0, token_ids, y)                      # summed in ascending expert id

Pipeline of `draft_moe_fused` (one call per projection for all active experts):

    topk_idx [T,k] ──flatten──► sort by expert ──► counts [E] ──► active experts [A], offsets [A]
                                   │
    x [T,H] ──gather rows─────────►│ xs [S,H]      (S = routed (token, expert) pairs, expert-major)
                                   ▼
    INT4 gate_up[active] ──unpack+scale──► W [A,2I,H] ──grouped GEMM on offsets──► h [S,2I]
                                                                    act(gate)·up ► a [S,I]
    INT4 down[active]    ──unpack+scale──► W [A,H,I]  ──grouped GEMM on offsets──► y [S,H]
                                                                    · topk_w     ► y [S,H]
    y ──back to (token, slot)──► per token, ascending expert id ──► k adds ──► out [T,H]

Backends:
  "grouped" : the pipeline above; the grouped GEMM is `torch._grouped_mm` where the device
              supports it for the dtype, else `torch.bmm` on zero-padded groups. Any device.
  "int4mm"  : CPU only. Dense over the active experts with torch's CPU INT4 GEMM
              (`_weight_int4pack_mm_for_cpu`, which reads packed nibbles directly):
                  h = x @ [W_gu[a0]; W_gu[a1]; ...]^T          # [T, A·2I], one call
                  z[t, a] = w_{t,a} · act(gate)·up  (0 if t is not routed to a)  # [T, A·I]
                  out = z @ [W_down[a0] | W_down[a1] | ...]^T    # [T, H], one call
              The expert sum happens inside the second GEMM (fp32 accumulation). It spends A/k
              times the needed FLOPs but no gather, sort, scatter or dequantization pass, which
              wins when few tokens share few experts (decode, small K). Uses weights converted
              once by `prepare_int4mm` (group sizes 32..256, output dims divisible by 32).
              Given only the int4mm layout (the CPU draft keeps no other), "grouped" dequantizes the
              active experts from it (`dequantize_int4pack`): the batched-draft path, where T·A
              outgrows int4mm (fp32: 0.2 s at T=16 against 12 ms grouped, H=I=128, E=64).
  "auto"    : "int4mm" on CPU for bf16 activations when prepared weights are given and
              T·A is small (see `choose_backend`), else "grouped". torch's CPU INT4 GEMM is
              only fast for bf16 on this AVX2 build (fp32/fp16 measured 4-40x slower).

  "triton"  : CUDA (or CPU under TRITON_INTERPRET=1). `triton_moe.fused_moe_w4a16`: one launch per
              projection for all experts, nibbles unpacked in registers, no host sync. Never
              picked by "auto" here: `kernels/select.py` chooses the draft's kernel per device.

"grouped" and "int4mm" make one host sync per call (the number of active experts sizes the buffers).
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from specter.kernels.reference import expert_ffn, grouped_moe, moe_reference
from specter.quant.int4 import ZERO_POINT, Int4Experts, dequantize, unpack_codes

ActFn = Callable[[torch.Tensor], torch.Tensor]
Backend = Literal["auto", "grouped", "int4mm", "triton"]
GroupedMatmul = Literal["auto", "grouped_mm", "bmm"]


# ----------------------------------------------------------------------------- reference


def draft_moe_reference(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, gate_up: Int4Experts,
                        down: Int4Experts, act_fn: ActFn) -> torch.Tensor:
    """Slow reference: dequantize every expert to x.dtype, then HF's eager per-expert loop."""
    return moe_reference(x, topk_idx, topk_w, dequantize(gate_up, x.dtype), dequantize(down, x.dtype), act_fn)


def draft_moe_unfused(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, gate_up: Int4Experts,
                      down: Int4Experts, act_fn: ActFn) -> torch.Tensor:
    """Unfused INT4 baseline: HF's per-expert loop, dequantizing each active expert when it is used."""

    def ffn(e: int, xs: torch.Tensor) -> torch.Tensor:
        one = torch.tensor([e], device=x.device)
        return expert_ffn(xs, dequantize_active(gate_up, one, x.dtype)[0], dequantize_active(down, one, x.dtype)[0],
                          act_fn)  # [2I, H] and [H, I] weights -> [n, H]

    return grouped_moe(x, topk_idx, topk_w, gate_up.num_experts, ffn)


# ----------------------------------------------------------------------------- shared pieces


@dataclass
class DequantWorkspace:
    """Reusable dequantization buffers (one per projection) so steady-state calls do not allocate."""

    gate_up: torch.Tensor | None = None
    down: torch.Tensor | None = None

    def take(self, name: str, rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = getattr(self, name)
        if buf is None or buf.dtype != dtype or buf.device != device or buf.shape[0] < rows \
                or buf.shape[1:] != (n, k):
            buf = torch.empty(rows, n, k, dtype=dtype, device=device)
            setattr(self, name, buf)
        return buf[:rows]


def dequantize_active(packed: Int4Experts, experts: torch.Tensor, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize only `experts` ([A] ids) into [A, N, K] of `dtype`, vectorized over experts."""
    a, n, k, gs = experts.numel(), packed.out_features, packed.in_features, packed.group_size
    if out is None:
        out = torch.empty(a, n, k, dtype=dtype, device=packed.qweight.device)
    qw = packed.qweight.index_select(0, experts)  # [A, N, K/8] int32: only the active experts' bytes
    sc = packed.scales.index_select(0, experts).to(dtype).unsqueeze(-1)  # [A, N, G, 1]
    if sys.byteorder == "little":
        b = qw.view(torch.uint8)  # [A, N, K/2]: low nibble = even column, high nibble = odd column
        pairs = out.view(a, n, k // 2, 2)
        pairs[..., 0].copy_(b & 0xF)
        pairs[..., 1].copy_(b >> 4)
    else:
        out.copy_(unpack_codes(qw))
    out.view(a, n, k // gs, gs).sub_(ZERO_POINT).mul_(sc)  # (code - 8) * scale
    return out


def _grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm") or dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] >= 9
    return False


def grouped_linear(xs: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor,
                   matmul: GroupedMatmul = "auto") -> torch.Tensor:
    """Rows of `xs` [S, K] grouped contiguously by expert (sizes `counts` [A]) times w[a]^T ([A, N, K]) -> [S, N]."""
    if matmul == "auto":
        matmul = "grouped_mm" if _grouped_mm_supported(xs.device, xs.dtype) else "bmm"
    if matmul == "grouped_mm":
        return torch._grouped_mm(xs, w.transpose(1, 2), offs=offsets)  # [S, N]
    # padded batched GEMM: scatter rows into [A, max_n, K], one bmm, gather back
    a, s = counts.numel(), xs.shape[0]
    max_n = int(counts.max())
    starts = offsets - counts  # [A]
    expert_of_row = torch.repeat_interleave(torch.arange(a, device=xs.device), counts)  # [S]
    pos = torch.arange(s, device=xs.device) - starts.long()[expert_of_row]  # [S] row within its group
    padded = xs.new_zeros(a, max_n, xs.shape[1])  # [A, max_n, K]
    padded[expert_of_row, pos] = xs
    y = torch.bmm(padded, w.transpose(1, 2))  # [A, max_n, N]
    return y[expert_of_row, pos]  # [S, N]


# ----------------------------------------------------------------------------- grouped backend


@dataclass
class Routing:
    """(token, slot) pairs sorted by expert id, and the active expert groups."""

    order: torch.Tensor  # [S] indices into the flattened [T*k] routes, expert-major (stable)
    tokens: torch.Tensor  # [S] token id of each sorted route
    active: torch.Tensor  # [A] active expert ids, ascending
    counts: torch.Tensor  # [A] routes per active expert
    offsets: torch.Tensor  # [A] int32 cumulative counts (end of each group)


def sort_routes(topk_idx: torch.Tensor, num_experts: int) -> Routing:
    t, k = topk_idx.shape
    flat = topk_idx.reshape(-1).long()  # [T*k]
    valid = (flat >= 0) & (flat < num_experts)
    keyed = torch.where(valid, flat, torch.full_like(flat, num_experts))  # invalid routes sort last
    order = torch.argsort(keyed, stable=True)  # [T*k]
    per_expert = torch.bincount(keyed, minlength=num_experts + 1)[:num_experts]  # [E]
    active = per_expert.nonzero().flatten()  # [A]
    counts = per_expert[active]  # [A]
    s = int(counts.sum())
    order = order[:s]
    return Routing(order, order // k, active, counts, counts.cumsum(0).to(torch.int32))


def _combine_ascending(y: torch.Tensor, order: torch.Tensor, topk_idx: torch.Tensor, num_experts: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """Per token, add its experts' outputs in ascending expert id, as HF's index_add_ loop does."""
    t, k = topk_idx.shape
    h = y.shape[-1]
    slots = y.new_zeros(t * k, h, dtype=dtype)  # [T*k, H], masked routes stay 0
    slots[order] = y.to(dtype)
    slots = slots.view(t, k, h)
    keyed = torch.where((topk_idx >= 0) & (topk_idx < num_experts), topk_idx.long(),
                        torch.full_like(topk_idx, num_experts, dtype=torch.long))
    rank = torch.argsort(keyed, dim=1, stable=True)  # [T, k] slot order by expert id
    ys = slots.gather(1, rank.unsqueeze(-1).expand(t, k, h))  # [T, k, H]
    out = ys[:, 0].clone()  # [T, H]
    for j in range(1, k):
        out += ys[:, j]
    return out


def _fused_grouped(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, gate_up: Int4Experts,
                   down: Int4Experts, act_fn: ActFn, workspace: DequantWorkspace | None,
                   matmul: GroupedMatmul) -> torch.Tensor:
    e = gate_up.num_experts
    r = sort_routes(topk_idx, e)
    if r.active.numel() == 0:
        return torch.zeros_like(x)
    a = r.active.numel()
    ws = workspace or DequantWorkspace()
    w_gu = dequantize_active(gate_up, r.active, x.dtype,
                             ws.take("gate_up", a, gate_up.out_features, gate_up.in_features, x.dtype, x.device))
    xs = x.index_select(0, r.tokens)  # [S, H]
    h = grouped_linear(xs, w_gu, r.counts, r.offsets, matmul)  # [S, 2I]
    gate, up = h.chunk(2, dim=-1)  # [S, I] each
    act = act_fn(gate) * up  # [S, I]
    w_dn = dequantize_active(down, r.active, x.dtype,
                             ws.take("down", a, down.out_features, down.in_features, x.dtype, x.device))
    y = grouped_linear(act, w_dn, r.counts, r.offsets, matmul)  # [S, H]
    y = y * topk_w.reshape(-1)[r.order, None]  # [S, H], promoted like HF's `y * w[:, None]`
    return _combine_ascending(y, r.order, topk_idx, e, x.dtype)


# ----------------------------------------------------------------------------- int4mm backend (CPU)


@functools.lru_cache(maxsize=None)
def _int4pack_block_n() -> int:
    """Output rows per block of torch's CPU int4 packed layout [N/BN, K, BN/2] (depends on the ISA)."""
    n, k = 128, 64
    probe = torch.zeros(n, k, dtype=torch.int32)
    probe[0, 1] = 1
    flat = torch._convert_weight_to_int4pack_for_cpu(probe, 2).reshape(-1)
    bn = 2 * int(flat.nonzero()[0])
    # the blocked view is only a guess until concatenating along K reproduces a direct conversion
    g = torch.Generator().manual_seed(0)
    parts = [torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g) for _ in range(2)]
    whole = torch._convert_weight_to_int4pack_for_cpu(torch.cat(parts, 1), 2)
    cat = torch.cat([torch._convert_weight_to_int4pack_for_cpu(p, 2).view(n // bn, k, bn // 2) for p in parts], 1)
    if bn <= 0 or not torch.equal(whole, cat.reshape(n, -1)):
        raise RuntimeError("unrecognised layout of torch's CPU int4 packed weights")
    return bn


@dataclass
class Int4mmWeights:
    """Per-expert weights in torch's CPU int4 layout, arranged so active experts concatenate cheaply."""

    gate_up: torch.Tensor  # [E, 2I, H/2] uint8: experts concatenate along output rows
    gate_up_sz: torch.Tensor  # [E, H/gs, 2I, 2] scales and zeros (zero = 0: symmetric)
    down: torch.Tensor  # [E, H/BN, I, BN/2] uint8: experts concatenate along the input dim
    down_sz: torch.Tensor  # [E, I/gs, H, 2]
    group_size_gu: int
    group_size_dn: int
    dtype: torch.dtype
    block_n: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate_up, self.gate_up_sz, self.down, self.down_sz))


def int4mm_nbytes(experts: int, out_features: int, in_features: int, group_size: int, dtype: torch.dtype) -> int:
    """What `Int4mmWeights.nbytes` counts for one projection of these shapes: codes [E, N, K/2] uint8 plus
    scales-and-zeros [E, K/gs, N, 2] in `dtype`."""
    itemsize = torch.finfo(dtype).bits // 8
    return experts * out_features * (in_features // 2 + in_features // group_size * 2 * itemsize)


def _to_int4pack(packed: Int4Experts, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # one expert's codes at a time: a whole layer's int32 codes are 4 bytes per weight
    w = torch.stack([torch._convert_weight_to_int4pack_for_cpu(unpack_codes(qw).to(torch.int32), 2)
                     for qw in packed.qweight])  # [E, N, K/2]
    s = packed.scales.to(dtype).transpose(1, 2)  # [E, G, N]
    sz = torch.stack((s, torch.zeros_like(s)), dim=-1).contiguous()  # [E, G, N, 2]
    return w, sz


def prepare_int4mm(gate_up: Int4Experts, down: Int4Experts, dtype: torch.dtype = torch.bfloat16) -> Int4mmWeights:
    """Convert a layer's INT4 experts to torch's CPU int4 GEMM layout (once, at load time)."""
    bn = _int4pack_block_n()
    hidden, inter = down.out_features, down.in_features
    for p in (gate_up, down):
        if p.group_size not in (32, 64, 128, 256):
            raise ValueError(f"torch's CPU int4 GEMM supports group sizes 32..256, not {p.group_size}")
    if hidden % bn or gate_up.out_features % bn:
        raise ValueError(f"int4mm needs output dims divisible by {bn}, got H={hidden}, 2I={gate_up.out_features}")
    gu, gu_sz = _to_int4pack(gate_up, dtype)
    dn, dn_sz = _to_int4pack(down, dtype)
    dn = dn.view(down.num_experts, hidden // bn, inter, bn // 2)
    return Int4mmWeights(gu, gu_sz, dn, dn_sz, gate_up.group_size, down.group_size, dtype, bn)


@functools.lru_cache(maxsize=None)
def _int4pack_nibble_rows() -> bool:
    """Check the nibble order of torch's CPU int4 layout: within a block of BN output rows, byte j at
    input column k holds row j (low nibble) and row j + BN/2 (high nibble). Probed, as the block size is."""
    bn = _int4pack_block_n()
    n, k = 2 * bn, 64
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    blk = torch._convert_weight_to_int4pack_for_cpu(codes, 2).view(n // bn, k, bn // 2)
    rows = torch.cat([blk & 0xF, blk >> 4], dim=2).permute(0, 2, 1).reshape(n, k).to(torch.int32)
    if not torch.equal(rows, codes):
        raise RuntimeError("unrecognised nibble order of torch's CPU int4 packed weights")
    return True


def dequantize_int4pack(w: torch.Tensor, sz: torch.Tensor, group_size: int, block_n: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """Weights ``[A, N, K]`` of A experts from torch's CPU int4 layout: ``w [A, N/BN, K, BN/2]`` uint8
    (any view of that size), ``sz [A, K/gs, N, 2]`` (scale, zero); value = (code − 8)·scale + zero."""
    _int4pack_nibble_rows()
    a, g, n, _ = sz.shape
    k = g * group_size
    blk = w.reshape(a, n // block_n, k, block_n // 2)
    codes = torch.cat([blk & 0xF, blk >> 4], dim=3).permute(0, 1, 3, 2).reshape(a, n, g, group_size)  # [A, N, G, gs]
    scale = sz[..., 0].to(dtype).transpose(1, 2).unsqueeze(-1)  # [A, N, G, 1]
    zero = sz[..., 1].to(dtype).transpose(1, 2).unsqueeze(-1)  # [A, N, G, 1]
    return ((codes.to(dtype) - ZERO_POINT) * scale + zero).reshape(a, n, k)


def _fused_grouped_int4pack(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, prepared: Int4mmWeights,
                            act_fn: ActFn, matmul: GroupedMatmul) -> torch.Tensor:
    """The grouped pipeline on weights dequantized from the int4mm layout (active experts only)."""
    e, inter2, _ = prepared.gate_up.shape
    r = sort_routes(topk_idx, e)
    if r.active.numel() == 0:
        return torch.zeros_like(x)
    bn = prepared.block_n
    w_gu = dequantize_int4pack(prepared.gate_up.index_select(0, r.active), prepared.gate_up_sz.index_select(0, r.active),
                               prepared.group_size_gu, bn, x.dtype)  # [A, 2I, H]
    xs = x.index_select(0, r.tokens)  # [S, H]
    gate, up = grouped_linear(xs, w_gu, r.counts, r.offsets, matmul).chunk(2, dim=-1)  # [S, I] each
    act = act_fn(gate) * up  # [S, I]
    w_dn = dequantize_int4pack(prepared.down.index_select(0, r.active), prepared.down_sz.index_select(0, r.active),
                               prepared.group_size_dn, bn, x.dtype)  # [A, H, I]
    y = grouped_linear(act, w_dn, r.counts, r.offsets, matmul)  # [S, H]
    y = y * topk_w.reshape(-1)[r.order, None]  # [S, H]
    return _combine_ascending(y, r.order, topk_idx, e, x.dtype)


# torch's CPU int4 GEMM is fast in bf16 only: one token through [1024, 128] weights took 351 us with
# fp32 activations and scales against 12 us in bf16 (AVX-512, one thread). Its inputs are rounded to
# bf16 whatever the model's dtype; the activation between the two GEMMs stays in the model's dtype.
INT4MM_COMPUTE = torch.bfloat16


def dense_routes(topk_idx: torch.Tensor, topk_w: torch.Tensor, num_experts: int):
    """``(active [A], weights [T, A] fp32, routed [T, A] bool)``: the routed experts in ascending id,
    each token's weight per active expert and whether it routed there (unrouted pairs weigh 0)."""
    t = topk_idx.shape[0]
    idx = topk_idx.long()
    valid = (idx >= 0) & (idx < num_experts)
    present = torch.zeros(num_experts + 1, dtype=torch.bool, device=idx.device)
    present[torch.where(valid, idx, num_experts).reshape(-1)] = True
    active = present[:num_experts].nonzero().flatten()  # [A]
    a = active.numel()
    col = torch.full((num_experts + 1,), a, dtype=torch.long, device=idx.device)
    col[active] = torch.arange(a, device=idx.device)
    dense_w = torch.zeros(t, a + 1, dtype=torch.float32, device=idx.device)  # [T, A+1]; column A absorbs invalid
    dense_w.scatter_(1, col[torch.where(valid, idx, num_experts)], topk_w.float())
    routed = torch.zeros(t, a + 1, dtype=torch.bool, device=idx.device)
    routed.scatter_(1, col[torch.where(valid, idx, num_experts)], True)
    return active, dense_w[:, :a], routed[:, :a]


def one_token_routes(topk_idx: torch.Tensor, topk_w: torch.Tensor, num_experts: int):
    """`dense_routes` for one token routed to k distinct valid experts (a draft step) in 3 ops
    instead of 20, with ``routed=None`` (every pair routed); None when the routes are not that."""
    if topk_idx.shape[0] != 1:
        return None
    active, order = topk_idx[0].long().sort()  # [k] ascending
    if not (bool((active >= 0).all()) and bool((active < num_experts).all()) and bool((active[1:] != active[:-1]).all())):
        return None
    return active, topk_w[0, order].float()[None], None  # [k], [1, k]


def _fused_int4mm(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, prepared: Int4mmWeights,
                  act_fn: ActFn) -> torch.Tensor:
    num_experts, inter2, _ = prepared.gate_up.shape
    inter, hidden = inter2 // 2, x.shape[1]
    t = x.shape[0]
    active, dense_w, routed = (one_token_routes(topk_idx, topk_w, num_experts)
                               or dense_routes(topk_idx, topk_w, num_experts))
    a = active.numel()
    if a == 0:
        return torch.zeros_like(x)

    cdt = INT4MM_COMPUTE
    w_gu = prepared.gate_up.index_select(0, active).reshape(a * inter2, -1)  # [A*2I, H/2]
    sz_gu = prepared.gate_up_sz.index_select(0, active).permute(1, 0, 2, 3).reshape(-1, a * inter2, 2).to(cdt)
    h = torch._weight_int4pack_mm_for_cpu(x.to(cdt), w_gu, prepared.group_size_gu, sz_gu).to(x.dtype)  # [T, A*2I]
    gate, up = h.view(t, a, inter2).chunk(2, dim=-1)  # [T, A, I] each
    z = act_fn(gate) * up  # [T, A, I]
    z = z * dense_w.unsqueeze(-1).to(z.dtype)
    if routed is not None:  # mask, not multiply: an unrouted pair may overflow and inf * 0 would poison the sum
        z = torch.where(routed.unsqueeze(-1), z, torch.zeros((), dtype=z.dtype))
    w_dn = prepared.down.index_select(0, active).permute(1, 0, 2, 3).reshape(hidden, a * inter // 2)  # [H, A*I/2]
    sz_dn = prepared.down_sz.index_select(0, active).reshape(-1, hidden, 2).to(cdt)  # [A*I/gs, H, 2]
    out = torch._weight_int4pack_mm_for_cpu(z.reshape(t, a * inter).to(cdt), w_dn, prepared.group_size_dn, sz_dn)
    return out.to(x.dtype)  # [T, H]


# ----------------------------------------------------------------------------- entry point

# int4mm spends T·A token-expert products (every token meets every active expert) where the
# grouped path spends T·k plus sorting, gathering and dequantizing the active experts. Below this
# T·A the int4mm path was measured faster for bf16 on CPU (scripts/bench_draft_kernel.py: H=I=128 and
# H=I=512, E=64; the two paths cross between T·A ≈ 1000 and 2000).
INT4MM_MAX_TOKEN_EXPERTS = 1024


def choose_backend(x: torch.Tensor, topk_idx: torch.Tensor, prepared: Int4mmWeights | None) -> str:
    """"int4mm" only where it was measured faster: CPU, bf16 (torch's fp16/fp32 CPU int4 GEMM is slow)."""
    if prepared is None or x.device.type != "cpu" or x.dtype != torch.bfloat16 or prepared.dtype != x.dtype:
        return "grouped"
    num_active = int(torch.unique(topk_idx).numel())
    return "int4mm" if x.shape[0] * num_active <= INT4MM_MAX_TOKEN_EXPERTS else "grouped"


def draft_moe_fused(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, gate_up: Int4Experts,
                    down: Int4Experts, act_fn: ActFn, *, backend: Backend = "auto",
                    prepared: Int4mmWeights | None = None, workspace: DequantWorkspace | None = None,
                    matmul: GroupedMatmul = "auto") -> torch.Tensor:
    """Routed-expert MoE of the INT4 draft: x [T, H], topk_idx/topk_w [T, k] -> [T, H] in x.dtype."""
    if backend == "auto":
        backend = choose_backend(x, topk_idx, prepared)
    if backend == "triton":
        from specter.kernels.triton_moe import fused_moe_w4a16  # imports triton: only on this path

        return fused_moe_w4a16(x, topk_idx, topk_w, gate_up, down, act_fn)
    if backend == "int4mm":
        if prepared is None:
            prepared = prepare_int4mm(gate_up, down, x.dtype)
        return _fused_int4mm(x, topk_idx, topk_w, prepared, act_fn)
    if backend != "grouped":
        raise ValueError(f"unknown backend {backend!r}")
    if gate_up is None and prepared is not None:  # only the int4mm layout is resident
        return _fused_grouped_int4pack(x, topk_idx, topk_w, prepared, act_fn, matmul)
    return _fused_grouped(x, topk_idx, topk_w, gate_up, down, act_fn, workspace, matmul)
