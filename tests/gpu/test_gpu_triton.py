"""The Triton draft MoE compiled on a real GPU: the real models' expert shapes, no host sync, selection.

tests/test_triton_moe.py runs the same kernels in Triton's CPU interpreter (and, on a GPU, runs
its grid compiled too). Here: DeepSeek-V2-Lite / Qwen1.5-MoE (2048 x 1408) and Phi-3.5-MoE
(4096 x 6400) expert shapes, fp16 (hardware=cuda) and bf16; a CUDA-graph capture and the sync
debug mode prove there is no host synchronisation. Marlin only with SPECTER_TEST_MARLIN=1
(gptqmodel may compile its extension first).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():  # before importing the kernels: on a CPU they must stay free for the interpreter tests
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from specter.kernels import triton_moe  # noqa: E402
from specter.kernels.draft_moe import draft_moe_fused  # noqa: E402
from specter.kernels.reference import moe_reference  # noqa: E402
from specter.kernels.select import select_draft_kernel  # noqa: E402
from specter.quant.int4 import default_group_size, dequantize, quantize_rtn  # noqa: E402

if triton_moe.interpreting():
    pytest.skip("TRITON_INTERPRET=1: these tests need the compiled kernels", allow_module_level=True)

TOL = {  # as tests/test_triton_moe.py: (rtol, atol / max|ref|, rel-L2); the reason is written there
    torch.float32: (1e-5, 5e-6, 5e-6),
    torch.float16: (1e-2, 5e-3, 2e-3),
    torch.bfloat16: (5e-2, 4e-2, 1.6e-2),
}


@pytest.fixture(autouse=True)
def fp32_reductions():
    """cuBLAS may reduce fp16/bf16 GEMMs in reduced precision; the reference accumulates in fp32."""
    m = torch.backends.cuda.matmul
    saved = (m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction, m.allow_tf32)
    m.allow_fp16_reduced_precision_reduction = m.allow_bf16_reduced_precision_reduction = m.allow_tf32 = False
    yield
    m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction, m.allow_tf32 = saved


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def layer(e: int, h: int, i: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gu = quantize_rtn(torch.randn(e, 2 * i, h, generator=g) / h**0.5, default_group_size(h))  # [E, 2I, H]
    dn = quantize_rtn(torch.randn(e, h, i, generator=g) / i**0.5, default_group_size(i))  # [E, H, I]
    return gu.cuda(), dn.cuda()


def inputs(t: int, h: int, e: int, k: int, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to("cuda", dtype)  # [T, H]
    w, idx = torch.softmax(torch.randn(t, e, generator=g), dim=-1).topk(k, dim=-1)  # [T, k]
    return x, idx.cuda(), w.to("cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("h,i,e,k,tokens", [
    (2048, 1408, 64, 6, (1, 16, 128)),  # DeepSeek-V2-Lite
    (2048, 1408, 60, 4, (3, 33)),  # Qwen1.5-MoE
    (4096, 6400, 16, 2, (1, 64)),  # Phi-3.5-MoE
])
def test_real_expert_shapes(h: int, i: int, e: int, k: int, tokens: tuple[int, ...], dtype: torch.dtype) -> None:
    """Kernel vs the reference in the same dtype, and both vs fp32: the kernel is as close as the reference."""
    gu, dn = layer(e, h, i)
    w_gu, w_dn = dequantize(gu, dtype), dequantize(dn, dtype)
    w_gu32, w_dn32 = dequantize(gu, torch.float32), dequantize(dn, torch.float32)
    rtol, atol, l2 = TOL[dtype]
    for t in tokens:
        x, idx, w = inputs(t, h, e, k, dtype, seed=t)
        out = triton_moe.fused_moe_w4a16(x, idx, w, gu, dn, F.silu)
        ref = moe_reference(x, idx, w, w_gu, w_dn, F.silu)
        exact = moe_reference(x.float(), idx, w.float(), w_gu32, w_dn32, F.silu)
        assert out.dtype == dtype and out.shape == (t, h)
        scale = float(ref.float().abs().max())
        torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol * scale)
        assert rel_l2(out, ref) < l2
        assert rel_l2(out, exact) <= 1.5 * rel_l2(ref, exact) + 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_other_activation_and_kmajor_layout(dtype: torch.dtype) -> None:
    gu, dn = layer(60, 2048, 1408, seed=3)
    x, idx, w = inputs(9, 2048, 60, 4, dtype)
    act = lambda v: F.gelu(v, approximate="tanh")  # noqa: E731
    ref = moe_reference(x, idx, w, dequantize(gu, dtype), dequantize(dn, dtype), act)
    rtol, atol, l2 = TOL[dtype]
    scale = float(ref.float().abs().max())
    for g, d in ((gu, dn), (triton_moe.kmajor_layout(gu), triton_moe.kmajor_layout(dn))):
        out = triton_moe.fused_moe_w4a16(x, idx, w, g, d, act)
        torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol * scale)
        assert rel_l2(out, ref) < l2


def test_no_host_sync_and_cuda_graph() -> None:
    """Sync debug mode raises on any synchronising op; a CUDA graph cannot capture one either."""
    gu, dn = layer(64, 2048, 1408, seed=4)
    x, idx, w = inputs(1, 2048, 64, 6, torch.float16)
    eager = triton_moe.fused_moe_w4a16(x, idx, w, gu, dn, F.silu)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        triton_moe.fused_moe_w4a16(x, idx, w, gu, dn, F.silu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        triton_moe.fused_moe_w4a16(x, idx, w, gu, dn, F.silu)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = triton_moe.fused_moe_w4a16(x, idx, w, gu, dn, F.silu)
    x2, idx2, w2 = inputs(1, 2048, 64, 6, torch.float16, seed=9)
    x.copy_(x2), idx.copy_(idx2), w.copy_(w2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, triton_moe.fused_moe_w4a16(x2, idx2, w2, gu, dn, F.silu))
    assert not torch.equal(static_out, eager)


def test_auto_selects_triton_on_this_gpu() -> None:
    choice = select_draft_kernel("auto", "cuda", torch.float16)
    assert choice.selected == "triton", choice.as_dict()
    gu, dn = layer(8, 2048, 1408, seed=5)
    x, idx, w = inputs(5, 2048, 8, 2, torch.float16)
    assert torch.equal(draft_moe_fused(x, idx, w, gu, dn, F.silu, backend="triton"),
                       triton_moe.fused_moe_w4a16(x, idx, w, gu, dn, F.silu))


@pytest.mark.skipif(os.environ.get("SPECTER_TEST_MARLIN") != "1", reason="set SPECTER_TEST_MARLIN=1 (may compile)")
def test_marlin_matches_reference() -> None:
    from specter.kernels.marlin_moe import marlin_moe, marlin_unavailable, prepare_marlin
    from specter.quant.int4 import Int4ExpertLayer

    reason = marlin_unavailable(torch.device("cuda"), torch.float16)
    if reason:
        pytest.skip(reason)
    gu, dn = layer(8, 2048, 1408, seed=6)
    experts = prepare_marlin(Int4ExpertLayer(gu, dn), torch.float16, torch.device("cuda"))
    x, idx, w = inputs(16, 2048, 8, 2, torch.float16)
    ref = moe_reference(x, idx, w, dequantize(gu, torch.float16), dequantize(dn, torch.float16), F.silu)
    out = marlin_moe(x, idx, w, experts, F.silu)
    rtol, atol, l2 = TOL[torch.float16]
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol * float(ref.float().abs().max()))
    assert rel_l2(out, ref) < l2
