"""Fused INT4 draft MoE vs the dequantized reference (and the reference vs transformers' own loop)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specter.kernels.draft_moe import (INT4MM_COMPUTE, DequantWorkspace, choose_backend, dequantize_active,
                                       draft_moe_fused, draft_moe_reference, draft_moe_unfused, grouped_linear,
                                       prepare_int4mm, sort_routes)
from kernel_cases import assert_within, inputs, layer, reference, routes
from specter.quant.int4 import dequantize, quantize_rtn

# Tolerances (output vs reference): elementwise rtol with an atol relative to the output's scale,
# plus a relative L2 bound on the whole output.
TOL = {  # dtype: (rtol, atol as a fraction of max|ref|, rel-L2)
    torch.float32: (1e-4, 1e-5, 1e-5),
    torch.float16: (2e-2, 2e-2, 1.5e-2),
    torch.bfloat16: (2e-2, 2e-2, 1.5e-2),
}


def assert_matches(out: torch.Tensor, ref: torch.Tensor, compute: torch.dtype | None = None) -> None:
    """``compute``: the dtype the kernel computed in, when not the inputs' (the CPU int4 GEMM's bf16)."""
    assert_within(out, ref, TOL[compute or ref.dtype])


GRID_T = [1, 3, 16, 64]
GRID_E = [4, 16, 60, 64]
GRID_K = [1, 2, 4, 6]
GRID_HI = [(128, 128), (256, 128), (128, 256)]


def _grid_case(h: int, i: int, e: int, k: int, dtype: torch.dtype, tokens: list[int]) -> None:
    gu, dn = layer(e, h, i)
    ws = DequantWorkspace()  # shared across T: buffers grow and are reused
    for t in tokens:
        x = inputs(t, h, dtype, t)
        w, idx = routes(t, e, k, 7 * t + k, dtype)
        ref = reference(x, idx, w, e, h, i)
        assert_matches(draft_moe_fused(x, idx, w, gu, dn, F.silu, backend="grouped", workspace=ws), ref)


@pytest.mark.parametrize("h,i", GRID_HI)
@pytest.mark.parametrize("e", GRID_E)
@pytest.mark.parametrize("k", GRID_K)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_grouped_matches_reference(h: int, i: int, e: int, k: int, dtype: torch.dtype) -> None:
    """The full grid: T in {1, 3, 16, 64} x E x k x (H, I), fp32 and fp16."""
    if k > e:
        pytest.skip("top-k larger than the expert count")
    _grid_case(h, i, e, k, dtype, GRID_T)


@pytest.mark.parametrize("h,i,e,k", [(128, 128, 4, 4), (256, 128, 16, 2), (128, 256, 64, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_other_paths_match_reference(h: int, i: int, e: int, k: int, dtype: torch.dtype) -> None:
    """Padded-bmm grouped GEMM, the CPU int4mm backend, auto, and the unfused loop."""
    gu, dn = layer(e, h, i)
    prepared = prepare_int4mm(gu, dn, dtype)
    for t in [1, 5, 64]:
        x = inputs(t, h, dtype, 100 + t)
        w, idx = routes(t, e, k, 200 + t, dtype)
        ref = reference(x, idx, w, e, h, i)
        assert_matches(draft_moe_fused(x, idx, w, gu, dn, F.silu, backend="grouped", matmul="bmm"), ref)
        assert_matches(draft_moe_fused(x, idx, w, gu, dn, F.silu, backend="int4mm", prepared=prepared), ref,
                       compute=INT4MM_COMPUTE)
        assert_matches(draft_moe_fused(x, idx, w, gu, dn, F.silu, prepared=prepared), ref)
        assert_matches(draft_moe_unfused(x, idx, w, gu, dn, F.silu), ref)


def test_reference_equals_transformers_eager_loop() -> None:
    """The reference is HF's Qwen2MoeExperts loop run on the dequantized weights, bit for bit."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

    e, h, i, k, t = 16, 128, 256, 4, 9
    gu, dn = layer(e, h, i)
    cfg = Qwen2MoeConfig(num_experts=e, hidden_size=h, moe_intermediate_size=i, hidden_act="silu")
    experts = Qwen2MoeExperts(cfg)
    experts.gate_up_proj.data = dequantize(gu, torch.float32)
    experts.down_proj.data = dequantize(dn, torch.float32)
    x = inputs(t, h, torch.float32, 3)
    w, idx = routes(t, e, k, 4, torch.float32)
    with torch.no_grad():
        theirs = experts(x, idx, w)
    assert torch.equal(draft_moe_reference(x, idx, w, gu, dn, F.silu), theirs)
    assert torch.equal(reference(x, idx, w, e, h, i), theirs)


def test_routing_math_against_dense_einsum() -> None:
    """out[t] = Σ_j w[t,j] · W_down[e_tj] (act(W_gate[e_tj] x_t) · W_up[e_tj] x_t), computed without any loop."""
    e, h, i, k, t = 16, 128, 128, 3, 11
    gu, dn = layer(e, h, i)
    x = inputs(t, h, torch.float64, 5)
    w, idx = routes(t, e, k, 6, torch.float64)
    w_gu, w_dn = dequantize(gu, torch.float64)[idx], dequantize(dn, torch.float64)[idx]  # [T, k, 2I, H], [T, k, H, I]
    gate, up = torch.einsum("tkoh,th->tko", w_gu, x).chunk(2, dim=-1)  # [T, k, I]
    expected = torch.einsum("tk,tkhi,tki->th", w, w_dn, F.silu(gate) * up)  # [T, H]
    for out in (draft_moe_reference(x, idx, w, gu, dn, F.silu),
                draft_moe_fused(x, idx, w, gu, dn, F.silu, backend="grouped")):
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


def test_masked_routes_and_empty_batch() -> None:
    """Expert id E (HF's "no expert" marker) contributes nothing; T=0 returns an empty output."""
    e, h, i = 16, 128, 128
    gu, dn = layer(e, h, i)
    x = inputs(6, h, torch.float32, 8)
    w, idx = routes(6, e, 4, 9, torch.float32)
    masked = idx.clone()
    masked[0, 1] = e
    masked[3, :] = e
    keep = (masked < e).float()
    ref = draft_moe_reference(x, masked, w, gu, dn, F.silu)
    assert torch.equal(ref[3], torch.zeros(h))
    # dropping a route equals giving it zero weight
    assert_matches(ref, draft_moe_reference(x, idx, w * keep, gu, dn, F.silu))
    prepared = prepare_int4mm(gu, dn, torch.float32)
    for backend in ("grouped", "int4mm"):
        assert_matches(draft_moe_fused(x, masked, w, gu, dn, F.silu, backend=backend, prepared=prepared), ref,
                       compute=INT4MM_COMPUTE if backend == "int4mm" else None)
        empty = draft_moe_fused(x[:0], idx[:0], w[:0], gu, dn, F.silu, backend=backend, prepared=prepared)
        assert empty.shape == (0, h)


def test_sort_routes_groups_by_ascending_expert() -> None:
    idx = torch.tensor([[3, 1], [1, 0], [3, 2]])
    r = sort_routes(idx, 5)
    assert r.active.tolist() == [0, 1, 2, 3] and r.counts.tolist() == [1, 2, 1, 2]
    assert r.offsets.tolist() == [1, 3, 4, 6]
    assert idx.reshape(-1)[r.order].tolist() == [0, 1, 1, 2, 3, 3]
    assert r.tokens.tolist() == [1, 0, 1, 2, 0, 2]  # stable: token order kept within an expert


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequantize_active_matches_full(dtype: torch.dtype) -> None:
    gu, _ = layer(16, 128, 256)
    experts = torch.tensor([9, 2, 15])
    out = torch.full((5, gu.out_features, gu.in_features), float("nan"), dtype=dtype)
    got = dequantize_active(gu, experts, dtype, out=out[:3])
    assert torch.equal(got, dequantize(gu, dtype)[experts])


@pytest.mark.parametrize("matmul", ["grouped_mm", "bmm"])
def test_grouped_linear(matmul: str) -> None:
    g = torch.Generator().manual_seed(10)
    counts = torch.tensor([2, 1, 5])
    xs = torch.randn(8, 32, generator=g)
    w = torch.randn(3, 16, 32, generator=g)
    expected = torch.cat([xs[0:2] @ w[0].t(), xs[2:3] @ w[1].t(), xs[3:8] @ w[2].t()])
    got = grouped_linear(xs, w, counts, counts.cumsum(0).to(torch.int32), matmul)
    torch.testing.assert_close(got, expected)


def test_choose_backend() -> None:
    gu, dn = layer(64, 128, 128)
    prepared = prepare_int4mm(gu, dn, torch.bfloat16)
    _, idx = routes(1, 64, 6, 11, torch.float32)
    assert choose_backend(torch.zeros(1, 128, dtype=torch.bfloat16), idx, prepared) == "int4mm"
    assert choose_backend(torch.zeros(1, 128, dtype=torch.bfloat16), idx, None) == "grouped"
    assert choose_backend(torch.zeros(1, 128), idx, prepared_fp32 := prepare_int4mm(gu, dn, torch.float32)) == "grouped"
    assert prepared_fp32.nbytes > 0
    _, idx64 = routes(64, 64, 6, 12, torch.float32)
    assert choose_backend(torch.zeros(64, 128, dtype=torch.bfloat16), idx64, prepared) == "grouped"
    small_groups = quantize_rtn(torch.randn(2, 64, 128), 16)
    with pytest.raises(ValueError, match="group sizes"):
        prepare_int4mm(small_groups, small_groups, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_on_cuda_matches_cpu_reference(dtype: torch.dtype) -> None:
    e, h, i, k = 64, 256, 128, 6
    gu, dn = layer(e, h, i)
    gu_d, dn_d = gu.to("cuda"), dn.to("cuda")
    for t in [1, 17, 64]:
        x = inputs(t, h, dtype, 300 + t)
        w, idx = routes(t, e, k, 400 + t, dtype)
        ref = draft_moe_reference(x, idx, w, gu, dn, F.silu)
        out = draft_moe_fused(x.cuda(), idx.cuda(), w.cuda(), gu_d, dn_d, F.silu)
        assert_matches(out.cpu(), ref)


def test_one_token_routes_equal_the_dense_routes() -> None:
    """The one-token shortcut of the CPU int4mm path gives `dense_routes`' experts and weights exactly,
    and declines what it does not cover (several tokens, a repeated or out-of-range expert)."""
    from specter.kernels.draft_moe import dense_routes, one_token_routes

    g = torch.Generator().manual_seed(3)
    for e, k in [(4, 1), (16, 2), (60, 4), (64, 6), (8, 8)]:
        for _ in range(20):
            idx = torch.randperm(e, generator=g)[:k][None]  # [1, k] distinct
            w = torch.rand(1, k, generator=g, dtype=torch.bfloat16)
            active, dense_w, routed = dense_routes(idx, w, e)
            fast = one_token_routes(idx, w, e)
            assert fast is not None and fast[2] is None and bool(routed.all())
            assert torch.equal(fast[0], active) and torch.equal(fast[1], dense_w)
    assert one_token_routes(torch.tensor([[1, 2], [3, 4]]), torch.ones(2, 2), 8) is None
    assert one_token_routes(torch.tensor([[2, 2]]), torch.ones(1, 2), 8) is None
    assert one_token_routes(torch.tensor([[1, 8]]), torch.ones(1, 2), 8) is None
