"""Shared inputs and checks for the draft-MoE kernel tests (fused CPU paths, Triton)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specter.kernels.reference import moe_reference
from specter.quant.int4 import Int4Experts, default_group_size, dequantize, quantize_rtn


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |out − ref| / max|ref|, ‖out − ref‖ / ‖ref‖)."""
    o, r = out.float().cpu(), ref.float().cpu()
    scale = float(r.abs().max()) or 1.0
    return float((o - r).abs().max()) / scale, float((o - r).norm() / r.norm().clamp_min(1e-12))


def assert_within(out: torch.Tensor, ref: torch.Tensor, tol: tuple[float, float, float]) -> None:
    """`tol` = (rtol, atol as a fraction of max|ref|, relative L2 error)."""
    rtol, atol_frac, rel_l2 = tol
    assert out.shape == ref.shape and out.dtype == ref.dtype
    o, r = out.float().cpu(), ref.float().cpu()
    scale = float(r.abs().max()) if r.numel() else 1.0
    torch.testing.assert_close(o, r, rtol=rtol, atol=atol_frac * scale)
    if r.numel() and float(r.norm()) > 0:
        assert errors(out, ref)[1] < rel_l2


@functools.lru_cache(maxsize=None)
def layer(e: int, h: int, i: int) -> tuple[Int4Experts, Int4Experts]:
    """RTN INT4 experts with the project's group size rule (128, or the largest power of two dividing K)."""
    g = torch.Generator().manual_seed(1000 * e + h + i)
    gate_up = torch.randn(e, 2 * i, h, generator=g) / h**0.5  # [E, 2I, H]
    down = torch.randn(e, h, i, generator=g) / i**0.5  # [E, H, I]
    return quantize_rtn(gate_up, default_group_size(h)), quantize_rtn(down, default_group_size(i))


@functools.lru_cache(maxsize=None)
def dequantized(e: int, h: int, i: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gu, dn = layer(e, h, i)
    return dequantize(gu, dtype), dequantize(dn, dtype)


def reference(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, e: int, h: int, i: int, act=F.silu) -> torch.Tensor:
    """`draft_moe_reference` (dequantize to x.dtype + the eager loop) with the dequantization cached."""
    return moe_reference(x, idx, w, *dequantized(e, h, i, x.dtype), act)


def routes(t: int, e: int, k: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w, idx = torch.softmax(torch.randn(t, e, generator=g), dim=-1).topk(k, dim=-1)  # [T, k]
    return w.to(dtype), idx


def inputs(t: int, h: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(t, h, generator=torch.Generator().manual_seed(seed)).to(dtype)
