"""INT4 packing, round-to-nearest, gptqmodel layout conversion and GPTQ of MoE experts."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from specter.kernels.draft_moe import draft_moe_fused, draft_moe_reference
from specter.quant.gptq import gptq_quantize_experts, gptq_reference, quantize_linear
from specter.quant.int4 import (Int4Experts, default_group_size, dequantize, from_gptq_tensors, pack_codes,
                                quantize_rtn, to_gptq_tensors, unpack_codes)

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- packing


def test_pack_layout_by_hand() -> None:
    codes = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 15, 15, 15, 15, 15, 15, 15, 8]])
    words = pack_codes(codes)
    assert words.dtype == torch.int32 and words.shape == (1, 2)
    assert int(words[0, 0]) == 0x76543210
    assert int(words[0, 1]) & 0xFFFFFFFF == 0x8FFFFFFF  # top nibble set: a negative int32
    assert torch.equal(unpack_codes(words), codes.to(torch.uint8))


@pytest.mark.parametrize("shape", [(1, 8), (3, 5, 64), (2, 16, 256)])
def test_pack_unpack_exact(shape: tuple[int, ...]) -> None:
    codes = torch.randint(0, 16, shape, generator=_gen(1), dtype=torch.uint8)
    words = pack_codes(codes)
    assert words.shape == (*shape[:-1], shape[-1] // 8)
    assert torch.equal(unpack_codes(words), codes)


def test_pack_rejects_out_of_range() -> None:
    with pytest.raises(ValueError):
        pack_codes(torch.tensor([[16, 0, 0, 0, 0, 0, 0, 0]]))
    with pytest.raises(ValueError):
        pack_codes(torch.zeros(1, 12, dtype=torch.int64))


# ----------------------------------------------------------------------------- RTN


@pytest.mark.parametrize("e,n,k,gs", [(1, 16, 128, 128), (4, 256, 128, 128), (3, 128, 256, 128), (2, 32, 256, 64)])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rtn_round_trip_error_bound(e: int, n: int, k: int, gs: int, scale_dtype: torch.dtype) -> None:
    w = torch.randn(e, n, k, generator=_gen(2)) * torch.rand(e, n, 1, generator=_gen(3)) * 3
    w[0, 0, :gs] = 0.0  # an all-zero group must come back exactly
    packed = quantize_rtn(w, gs, scale_dtype)
    assert packed.scales.dtype == scale_dtype and packed.method == "rtn"
    assert packed.qweight.shape == (e, n, k // 8) and packed.scales.shape == (e, n, k // gs)
    w_hat = dequantize(packed, torch.float32)
    step = packed.scales.float().repeat_interleave(gs, dim=-1)  # [E, N, K]
    err = (w_hat - w).abs()
    assert bool((err <= step / 2 * (1 + 1e-6)).all()), float((err / step).max())
    assert torch.equal(w_hat[0, 0, :gs], torch.zeros(gs))
    codes = unpack_codes(packed.qweight)  # the grid's full range is used
    assert int(codes.min()) <= 1 and int(codes.max()) == 15


@pytest.mark.parametrize("e,n,k,gs,block", [(3, 16, 64, 32, 64), (2, 48, 128, 128, 256), (4, 8, 256, 64, 10**9),
                                             (1, 33, 128, 64, 128)])
def test_rtn_in_blocks_equals_the_whole_stack(e: int, n: int, k: int, gs: int, block: int, monkeypatch) -> None:
    """Blocks of rows (Phi-3.5-MoE's bounded temporaries) give the bits of one pass over the stack."""
    from specter.quant import int4

    w = torch.randn(e, n, k, generator=_gen(e * n + k))
    monkeypatch.setattr(int4, "RTN_BLOCK_ELEMENTS", e * n * k)
    whole = quantize_rtn(w, gs)  # the reference: one block of every weight at once
    monkeypatch.setattr(int4, "RTN_BLOCK_ELEMENTS", block)
    blocked = quantize_rtn(w, gs)
    assert torch.equal(blocked.qweight, whole.qweight) and torch.equal(blocked.scales, whole.scales)


def test_draft_layer_from_views_equals_the_stacked_layer() -> None:
    """One expert at a time (views of the host store, never stacked) packs the same INT4 layer, and
    the int4mm layout built expert by expert dequantizes to it."""
    from specter.kernels.draft_moe import dequantize_int4pack, prepare_int4mm
    from specter.quant.draft import quantize_layer_rtn

    E, H, I = 5, 64, 96
    gu = [torch.randn(2 * I, H, generator=_gen(10 + j)) for j in range(E)]
    dn = [torch.randn(H, I, generator=_gen(20 + j)) for j in range(E)]
    layer = quantize_layer_rtn(gu, dn, 32)
    stacked = (quantize_rtn(torch.stack(gu), 32), quantize_rtn(torch.stack(dn), 32))
    for got, want in zip((layer.gate_up, layer.down), stacked):
        assert torch.equal(got.qweight, want.qweight) and torch.equal(got.scales, want.scales)
    prepared = prepare_int4mm(layer.gate_up, layer.down, torch.float32)
    w = dequantize_int4pack(prepared.gate_up, prepared.gate_up_sz, prepared.group_size_gu, prepared.block_n,
                            torch.float32)  # [E, 2I, H]
    assert torch.allclose(w, dequantize(layer.gate_up, torch.float32), atol=1e-6)


def test_rtn_matches_gptq_grid() -> None:
    """One group: scale = 2·absmax/15, code = clamp(round(w/scale) + 8, 0, 15)."""
    w = torch.zeros(1, 1, 8)
    w[0, 0, :5] = torch.tensor([1.5, 0.25, 0.75, -0.61, -1.45])
    packed = quantize_rtn(w, 8, torch.float32)
    assert torch.allclose(packed.scales, torch.tensor(0.2))
    assert unpack_codes(packed.qweight)[0, 0].tolist() == [15, 9, 12, 5, 1, 8, 8, 8]


@pytest.mark.parametrize("e,n,k,gs", [(1, 16, 128, 128), (5, 256, 128, 128), (2, 128, 256, 64)])
def test_nbytes_exact(e: int, n: int, k: int, gs: int) -> None:
    for scale_dtype, scale_bytes in ((torch.float16, 2), (torch.float32, 4)):
        packed = quantize_rtn(torch.randn(e, n, k, generator=_gen(4)), gs, scale_dtype)
        assert packed.nbytes == e * n * k // 2 + e * n * (k // gs) * scale_bytes


def test_group_size_and_validation() -> None:
    assert default_group_size(128) == 128
    assert default_group_size(1408) == 128
    assert default_group_size(192) == 64
    assert default_group_size(200) == 8
    with pytest.raises(ValueError):
        default_group_size(12)
    with pytest.raises(ValueError):
        Int4Experts(torch.zeros(2, 4, 16, dtype=torch.int32), torch.ones(2, 4, 2), 128)  # K=128 -> 1 group
    with pytest.raises(ValueError):
        Int4Experts(torch.zeros(2, 4, 16, dtype=torch.int32), torch.ones(2, 4, 1), 128, sym=False)


def output_error(w: torch.Tensor, packed: Int4Experts, x) -> float:
    """Squared output error ||x Wᵀ - x Ŵᵀ||² summed over experts; w [E, N, K], x per expert [n_e, K] or shared."""
    w_hat = dequantize(packed, torch.float32)  # [E, N, K]
    total = 0.0
    for e in range(w.shape[0]):
        x_e = x[e] if isinstance(x, (list, tuple)) else x
        if x_e.shape[0]:
            total += float(((x_e.float() @ (w[e].float() - w_hat[e]).t()) ** 2).sum())
    return total


# ----------------------------------------------------------------------------- gptqmodel layout


@pytest.fixture(scope="module")
def gptqmodel_torch_linear():
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    return TorchLinear


def _pack_with_gptqmodel(torch_linear, w: torch.Tensor, gs: int):
    """Quantize w [N, K] by RTN on our grid and let gptqmodel pack it into its own tensors."""
    n, k = w.shape
    ours = quantize_rtn(w.unsqueeze(0), gs, torch.float32)
    dq = dequantize(ours, torch.float32)[0]
    ql = torch_linear(bits=4, group_size=gs, sym=True, desc_act=False, in_features=k, out_features=n)
    lin = nn.Linear(k, n, bias=False)
    lin.weight.data = dq.clone()
    scale = ours.scales[0].float()  # [N, G]
    ql.pack(lin, scale, torch.full_like(scale, 8.0), torch.arange(k, dtype=torch.int32) // gs)
    return ours, ql


@pytest.mark.parametrize("n,k,gs", [(64, 128, 128), (256, 256, 128), (32, 256, 64)])
def test_from_gptqmodel_layout(gptqmodel_torch_linear, n: int, k: int, gs: int) -> None:
    w = torch.randn(n, k, generator=_gen(7))
    ours, ql = _pack_with_gptqmodel(gptqmodel_torch_linear, w, gs)
    assert ql.qweight.shape == (k // 8, n) and ql.qzeros.shape == (k // gs, n // 8)
    conv = from_gptq_tensors(ql.qweight, ql.qzeros, ql.scales, ql.g_idx, gs, qzeros_format=2)
    assert torch.equal(conv.qweight, ours.qweight)
    ql.post_init()
    theirs = ql.dequantize_weight().float()  # [K, N]
    torch.testing.assert_close(dequantize(conv, torch.float32)[0], theirs.t(), rtol=1e-3, atol=1e-3)
    # and back: our export equals gptqmodel's own packing
    qweight, qzeros, scales, g_idx = to_gptq_tensors(conv, 0, qzeros_format=2)
    assert torch.equal(qweight, ql.qweight) and torch.equal(qzeros, ql.qzeros)
    assert torch.equal(scales, ql.scales) and torch.equal(g_idx, ql.g_idx)


def test_gptq_layout_v1_zeros_and_rejections() -> None:
    packed = quantize_rtn(torch.randn(2, 32, 256, generator=_gen(8)), 128)
    qweight, qzeros, scales, g_idx = to_gptq_tensors(packed, 1, qzeros_format=1)
    assert int(qzeros[0, 0]) == 0x77777777  # on-disk GPTQ stores zero - 1
    back = from_gptq_tensors(qweight, qzeros, scales, g_idx, 128, qzeros_format=1)
    assert torch.equal(back.qweight[0], packed.qweight[1]) and torch.equal(back.scales[0], packed.scales[1])
    with pytest.raises(ValueError, match="symmetric"):
        from_gptq_tensors(qweight, qzeros, scales, g_idx, 128, qzeros_format=2)  # 7 read as a v2 zero
    with pytest.raises(ValueError, match="g_idx"):
        from_gptq_tensors(qweight, qzeros, scales, g_idx.flip(0), 128, qzeros_format=1)


# ----------------------------------------------------------------------------- GPTQ


def _calibration(n: int, k: int, seed: int) -> torch.Tensor:
    """Correlated, anisotropic inputs (as real activations are), where GPTQ's Hessian matters."""
    g = _gen(seed)
    basis = torch.randn(k, k, generator=g) * torch.logspace(0, -1.5, k).unsqueeze(1)  # [K, K]
    return torch.randn(n, k, generator=g) @ basis + 0.5 * torch.randn(1, k, generator=g)


def test_builtin_gptq_agrees_with_gptqmodel() -> None:
    w = torch.randn(128, 256, generator=_gen(9)) / 16
    x = _calibration(96, 256, 10)
    ours, ours_scales = gptq_reference(w, x, 128)
    theirs = quantize_linear(w, x, 128, engine="gptqmodel", scale_dtype=torch.float32)
    assert float((unpack_codes(theirs.qweight[0]) == ours).float().mean()) > 0.99
    torch.testing.assert_close(theirs.scales[0], ours_scales, rtol=1e-5, atol=1e-7)
    # gptqmodel's group-aware reordering keeps groups contiguous, so it maps onto the same format
    gar = quantize_linear(w, x, 128, engine="gptqmodel", act_group_aware=True)
    rtn = quantize_rtn(w.unsqueeze(0), 128)
    assert output_error(w.unsqueeze(0), gar, x) < output_error(w.unsqueeze(0), rtn, x)


@pytest.mark.parametrize("engine", ["gptqmodel", "builtin"])
def test_gptq_beats_rtn_on_calibration(engine: str) -> None:
    e, h, i = 4, 128, 256
    gate_up = torch.randn(e, 2 * i, h, generator=_gen(11)) / h**0.5
    down = torch.randn(e, h, i, generator=_gen(12)) / i**0.5
    inputs = [_calibration(n, h, 20 + j) for j, n in enumerate([64, 0, 32, 5])]
    layer = gptq_quantize_experts(gate_up, down, inputs, F.silu, 128, engine=engine)
    assert layer.gate_up.method == "gptq" and layer.rtn_fallback_experts == (1,)
    assert layer.gate_up.rtn_fallback_experts == (1,) and layer.down.rtn_fallback_experts == (1,)
    rtn_gu, rtn_dn = quantize_rtn(gate_up, 128), quantize_rtn(down, 128)
    # the fallback expert is exactly RTN
    assert torch.equal(layer.gate_up.qweight[1], rtn_gu.qweight[1])
    err_gptq = output_error(gate_up, layer.gate_up, inputs)
    err_rtn = output_error(gate_up, rtn_gu, inputs)
    assert err_gptq < 0.9 * err_rtn, (err_gptq, err_rtn)
    # down inputs: act(gate)*up of the same tokens through the quantized gate_up (sequential)
    gu_hat = dequantize(layer.gate_up, torch.float32)
    acts = []
    for j, x in enumerate(inputs):
        gate, up = (x @ gu_hat[j].t()).chunk(2, dim=-1)
        acts.append(F.silu(gate) * up)
    err_gptq_dn = output_error(down, layer.down, acts)
    err_rtn_dn = output_error(down, rtn_dn, acts)
    assert err_gptq_dn < 0.9 * err_rtn_dn, (err_gptq_dn, err_rtn_dn)
    # the kernels accept the result
    x = torch.randn(5, h, generator=_gen(13))
    w, idx = torch.softmax(torch.randn(5, e, generator=_gen(14)), -1).topk(2, -1)
    ref = draft_moe_reference(x, idx, w, layer.gate_up, layer.down, F.silu)
    out = draft_moe_fused(x, idx, w, layer.gate_up, layer.down, F.silu)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert layer.nbytes == e * (2 * i * h + h * i) // 2 + e * (2 * i * (h // 128) + h * (i // 128)) * 2
