"""Packed symmetric INT4 storage for one MoE layer's routed-expert linears.

Layout (one `Int4Experts` per projection stack, e.g. all experts' `gate_up_proj`):

    weight   [E, N, K]        N = out_features, K = in_features (HF `F.linear` layout)
    qweight  [E, N, K/8]      int32; nibble j (bits 4j..4j+3) of word w holds input column 8w + j
    scales   [E, N, K/gs]     one scale per (expert, output row, group of gs input columns)
    w[e, n, k] = (code[e, n, k] - 8) * scales[e, n, k // gs],   code in [0, 15]

The grid is the one GPTQ uses for `sym=True` (zero point 8, scale = 2·absmax/15), so
round-to-nearest and GPTQ results share one format. On little-endian hosts the int32
words can be read as bytes: byte b holds column 2b in its low nibble and 2b+1 in its
high nibble, which the CPU kernel exploits.

gptqmodel stores one linear as `qweight [K/8, N]` (packed along the input dim, one
column per output row), `qzeros [G, N/8]` (packed along the output dim), `scales [G, N]`
and `g_idx [K]`; `from_gptq_tensors` / `to_gptq_tensors` convert between the two.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch

BITS = 4
PACK = 32 // BITS  # codes per int32 word
MAXQ = 2**BITS - 1  # 15
ZERO_POINT = (MAXQ + 1) // 2  # 8: symmetric zero point
_SHIFTS = torch.arange(PACK, dtype=torch.int32) * BITS  # [8]: 0, 4, ..., 28

Method = Literal["rtn", "gptq"]


@dataclass
class Int4Experts:
    """One projection of every routed expert of a layer, symmetric INT4 with group-wise scales."""

    qweight: torch.Tensor  # [E, N, K/8] int32
    scales: torch.Tensor  # [E, N, K/gs] fp16 or fp32
    group_size: int
    sym: bool = True
    method: Method = "rtn"
    rtn_fallback_experts: tuple[int, ...] = field(default_factory=tuple)  # gptq only: experts without calibration

    def __post_init__(self) -> None:
        if not self.sym:
            raise ValueError("only symmetric INT4 (zero point 8) is supported")
        if self.qweight.dtype != torch.int32 or self.qweight.dim() != 3:
            raise ValueError(f"qweight must be int32 [E, N, K/8], got {self.qweight.dtype} {tuple(self.qweight.shape)}")
        e, n, kw = self.qweight.shape
        k = kw * PACK
        if k % self.group_size:
            raise ValueError(f"in_features {k} is not a multiple of group_size {self.group_size}")
        if tuple(self.scales.shape) != (e, n, k // self.group_size):
            raise ValueError(f"scales shape {tuple(self.scales.shape)} != {(e, n, k // self.group_size)}")

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[2] * PACK

    @property
    def nbytes(self) -> int:
        """Exact bytes of the packed weights and scales (E·N·K/2 + scale bytes)."""
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * self.scales.element_size()

    def to(self, device: torch.device | str) -> "Int4Experts":
        return Int4Experts(self.qweight.to(device), self.scales.to(device), self.group_size, self.sym,
                           self.method, self.rtn_fallback_experts)


@dataclass
class Int4ExpertLayer:
    """The draft's routed experts of one MoE layer: `gate_up [E, 2I, H]` and `down [E, H, I]`."""

    gate_up: Int4Experts
    down: Int4Experts

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    @property
    def rtn_fallback_experts(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.gate_up.rtn_fallback_experts) | set(self.down.rtn_fallback_experts)))


def packed_nbytes(experts: int, out_features: int, in_features: int, group_size: int, scale_itemsize: int = 2) -> int:
    """What `Int4Experts.nbytes` reports for these shapes, without building them: int32 words of 8
    codes [E, N, K/8] plus one scale per group [E, N, K/gs]."""
    return experts * out_features * (in_features // PACK * 4 + in_features // group_size * scale_itemsize)


def default_group_size(in_features: int, preferred: int = 128) -> int:
    """`preferred` unless the input dim forces a smaller power-of-two group."""
    gs = preferred
    while gs > PACK and in_features % gs:
        gs //= 2
    if in_features % gs or gs % PACK:
        raise ValueError(f"no INT4 group size divides in_features={in_features}")
    return gs


# ----------------------------------------------------------------------------- packing


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Integer codes [..., K] in [0, 15] -> int32 words [..., K/8], packed along the last dim."""
    if codes.shape[-1] % PACK:
        raise ValueError(f"last dim {codes.shape[-1]} is not a multiple of {PACK}")
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], -1, PACK)  # [..., K/8, 8]
    if c.numel() and (c.min() < 0 or c.max() > MAXQ):
        raise ValueError("codes must lie in [0, 15]")
    words = (c << _SHIFTS.to(c.device, torch.int64)).sum(-1)  # [..., K/8] in [0, 2^32)
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as signed int32
    return words.to(torch.int32)


def unpack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """int32 words [..., K/8] -> codes [..., K] as uint8 (slow, obvious reference)."""
    c = (qweight.unsqueeze(-1) >> _SHIFTS.to(qweight.device)) & MAXQ  # [..., K/8, 8]
    return c.reshape(*qweight.shape[:-1], -1).to(torch.uint8)



# ----------------------------------------------------------------------------- quantize / dequantize


def _round_scale_up(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast fp32 scales to `dtype` rounding up, so |w| <= 7.5·scale still holds after the cast."""
    s = scale.to(dtype)
    low = s.float() < scale
    if low.any():
        s = torch.where(low, torch.nextafter(s, torch.full_like(s, float("inf"))), s)
    return s


def concat_experts(parts: Sequence[Int4Experts], method: Method = "rtn", rtn_fallback_experts: tuple[int, ...] = ()
                   ) -> Int4Experts:
    """Expert stacks quantized apart (one expert, or a few, at a time), as one stack in their order."""
    return Int4Experts(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
                       parts[0].group_size, method=method, rtn_fallback_experts=tuple(rtn_fallback_experts))


# elements quantized at once: the temporaries (fp32 groups, int64 codes while packing) stay at a few
# hundred MB even for Phi-3.5-MoE's 4096 x 6400 experts, where a whole layer at once needs > 20 GB
RTN_BLOCK_ELEMENTS = 1 << 24


def quantize_rtn(w: torch.Tensor, group_size: int = 128, scale_dtype: torch.dtype = torch.float16,
                 bits: int = BITS) -> Int4Experts:
    """Round-to-nearest symmetric INT4 of an expert stack `w [E, N, K]` (K % group_size == 0).

    Per group: scale = 2·absmax/15 (GPTQ's symmetric grid), code = clamp(round(w/scale) + 8, 0, 15).
    Every weight is within scale/2 of its dequantized value. `bits` < 4 uses 2^bits levels around the
    same zero point (scale = 2·absmax/(2^bits - 1)), in the same layout. Rows are quantized in blocks of about
    RTN_BLOCK_ELEMENTS (groups never straddle rows, so the result does not depend on the block).
    """
    if w.dim() != 3:
        raise ValueError(f"expected [E, N, K], got {tuple(w.shape)}")
    e, n, k = w.shape
    if k % group_size or group_size % PACK:
        raise ValueError(f"K={k} must be a multiple of group_size={group_size}, itself a multiple of {PACK}")
    rows = max(1, RTN_BLOCK_ELEMENTS // max(k, 1))
    if e * n <= rows:
        return _quantize_rtn_rows(w, group_size, scale_dtype, bits)
    flat = w.reshape(1, e * n, k)
    parts = [_quantize_rtn_rows(flat[:, r:r + rows], group_size, scale_dtype, bits) for r in range(0, e * n, rows)]
    return Int4Experts(torch.cat([p.qweight for p in parts], 1).reshape(e, n, -1),
                       torch.cat([p.scales for p in parts], 1).reshape(e, n, -1), group_size, method="rtn")


def _quantize_rtn_rows(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype, bits: int = BITS) -> Int4Experts:
    e, n, k = w.shape
    maxq, zero = 2**bits - 1, 2 ** (bits - 1)
    wg = w.detach().float().reshape(e, n, k // group_size, group_size)  # [E, N, G, gs]
    amax = wg.abs().amax(-1)  # [E, N, G]
    scale = torch.where(amax > 0, amax * (2.0 / maxq), torch.ones_like(amax))
    scale = _round_scale_up(scale, scale_dtype)  # [E, N, G]
    q = torch.clamp(torch.round(wg / scale.float().unsqueeze(-1)) + zero, 0, maxq)  # [E, N, G, gs] on the 2^bits grid
    codes = q - zero + ZERO_POINT  # the INT4 layout's codes
    return Int4Experts(pack_codes(codes.reshape(e, n, k)), scale, group_size, method="rtn")


def codes_from_dequantized(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """Recover integer codes from weights that already lie on the grid: q [N, K], scale [N, G]."""
    s = scale.float().repeat_interleave(group_size, dim=-1)  # [N, K]
    return torch.clamp(torch.round(q.float() / s) + ZERO_POINT, 0, MAXQ)


def dequantize(packed: Int4Experts, dtype: torch.dtype | None = None,
               experts: torch.Tensor | None = None) -> torch.Tensor:
    """Weights [E, N, K] (or [len(experts), N, K]) in `dtype` (default: the scales' dtype)."""
    dtype = dtype or packed.scales.dtype
    qw, sc = packed.qweight, packed.scales
    if experts is not None:
        qw, sc = qw.index_select(0, experts), sc.index_select(0, experts)
    e, n, _ = qw.shape
    codes = unpack_codes(qw).to(dtype) - ZERO_POINT  # [E, N, K], small integers: exact in fp16
    w = codes.reshape(e, n, -1, packed.group_size) * sc.to(dtype).unsqueeze(-1)  # [E, N, G, gs]
    return w.reshape(e, n, -1)



# ----------------------------------------------------------------------------- gptqmodel layout


def from_gptq_tensors(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                      group_size: int, qzeros_format: int = 2, method: Method = "gptq") -> Int4Experts:
    """Convert one gptqmodel INT4 linear to a one-expert `Int4Experts`.

    qweight [K/8, N] int32, qzeros [G, N/8] int32, scales [G, N], g_idx [K].
    `qzeros_format` 2 stores the zero point itself (gptqmodel in memory, 8 for sym);
    format 1 (GPTQ checkpoints on disk) stores zero - 1 (7 for sym).
    Only sym with trivial g_idx (desc_act=False) maps onto this format.
    """
    k = qweight.shape[0] * PACK
    n = qweight.shape[1]
    g = scales.shape[0]
    if g * group_size != k or scales.shape[1] != n:
        raise ValueError(f"scales {tuple(scales.shape)} inconsistent with K={k}, N={n}, group_size={group_size}")
    expected = torch.arange(k, device=g_idx.device, dtype=torch.int64) // group_size
    if not torch.equal(g_idx.to(torch.int64), expected):
        raise ValueError("g_idx is not arange(K) // group_size (desc_act=True is not supported)")
    zeros = unpack_codes(qzeros).to(torch.int64)[:, :n] + (1 if qzeros_format == 1 else 0)  # [G, N]
    if not bool((zeros == ZERO_POINT).all()):
        raise ValueError(f"qzeros are not the symmetric zero point {ZERO_POINT} (asymmetric GPTQ is not supported)")
    ours = qweight.t().contiguous().to(torch.int32)  # [N, K/8]: same words, output rows first
    return Int4Experts(ours.unsqueeze(0), scales.t().contiguous().unsqueeze(0), group_size, method=method)


def to_gptq_tensors(packed: Int4Experts, expert: int, qzeros_format: int = 2
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One expert in gptqmodel's layout: (qweight [K/8, N], qzeros [G, N/8], scales [G, N], g_idx [K])."""
    n, k, gs = packed.out_features, packed.in_features, packed.group_size
    if n % PACK:
        raise ValueError(f"out_features {n} is not a multiple of {PACK}")
    # word [n, w] holds columns 8w..8w+7 of row n in both layouts: only the axes differ
    qweight = packed.qweight[expert].t().contiguous()  # [K/8, N]
    zero = ZERO_POINT - (1 if qzeros_format == 1 else 0)
    qzeros = pack_codes(torch.full((k // gs, n), zero, dtype=torch.int64, device=qweight.device))  # [G, N/8]
    scales = packed.scales[expert].t().contiguous()  # [G, N]
    g_idx = torch.arange(k, dtype=torch.int32, device=qweight.device) // gs
    return qweight, qzeros, scales, g_idx
