"""Triton W4A16 draft MoE vs the pure reference, in Triton's CPU interpreter (on a GPU: compiled).

Without CUDA this module sets TRITON_INTERPRET=1 before the kernel module is imported, so CI
checks the kernels' arithmetic on the CPU. Tolerances (kernel vs `draft_moe_reference`, which
dequantizes to x.dtype and runs transformers' eager loop), as (rtol, atol / max|ref|, rel-L2):

  fp32  (1e-5, 5e-6, 5e-6). Both sides use the same exactly dequantized weights ((code − 8)·scale
        is exact in fp32) and accumulate in fp32; only the summation order differs (K tiles, the
        k experts summed at once): a few ulps (2^-24 ≈ 6e-8) times √K. Worst measured over this
        file's grid: 6.9e-7 / 5.3e-7.
  fp16  (1e-2, 5e-3, 2e-3). The kernel rounds to fp16 wherever the reference does (gate, up,
        silu, act·up, y, y·w) but sums the k expert outputs in fp32 and rounds once, where the
        reference adds them one by one in fp16 (k − 1 more roundings of ≤ 2^-11 ≈ 4.9e-4), and a
        one-ulp difference in an intermediate can flip later roundings: ≈ k half-ulps of the output
        scale for k ≤ 6. Worst measured: 1.3e-3 / 5.0e-4 (measured against float64, the kernel is
        as close as the reference is).
  bf16  (5e-2, 4e-2, 1.6e-2): the fp16 bound scaled by bf16's 8x larger ulp (2^-8). In the
        interpreter the kernel computes in fp32 and rounds to bf16 by hand (its bf16 arithmetic
        is wrong and its cast truncates). Worst measured: 7.7e-3 / 3.9e-3.

All are >= 6x below the gap between these INT4 weights and the FP weights they quantize
(rel-L2 ≈ 0.1), and a single misrouted (token, slot) fails them (test_tolerance_catches_errors).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined (at import)
pytest.importorskip("triton")

from specter.kernels import triton_moe  # noqa: E402

import triton.language as tl  # noqa: E402

if not torch.cuda.is_available() and not (triton_moe.interpreting() and type(tl.zeros).__name__ == "InterpretedFunction"):
    # triton's own jit helpers (tl.zeros, ...) must be interpreted too: triton imported first cannot be reloaded
    pytest.skip("triton was imported before this module set TRITON_INTERPRET=1 (run with TRITON_INTERPRET=1)",
                allow_module_level=True)

from kernel_cases import assert_within, errors, inputs, layer, reference, routes  # noqa: E402
from specter.kernels.draft_moe import draft_moe_fused  # noqa: E402
from specter.kernels.reference import moe_reference  # noqa: E402
from specter.kernels.triton_moe import (TritonMoEConfig, align_routes, fused_moe_w4a16,  # noqa: E402
                                        kmajor_layout, max_padded_rows)
from specter.quant.int4 import Int4Experts, dequantize, quantize_rtn  # noqa: E402

DEVICE = torch.device("cpu" if triton_moe.interpreting() else "cuda")

TOL = {  # dtype: (rtol, atol as a fraction of max|ref|, rel-L2)
    torch.float32: (1e-5, 5e-6, 5e-6),
    torch.float16: (1e-2, 5e-3, 2e-3),
    torch.bfloat16: (5e-2, 4e-2, 1.6e-2),
}


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert_within(out, ref, TOL[ref.dtype])


def on_device(e: int, h: int, i: int) -> tuple[Int4Experts, Int4Experts]:
    gu, dn = layer(e, h, i)
    return gu.to(DEVICE), dn.to(DEVICE)


def run_case(t: int, e: int, k: int, h: int, i: int, dtype: torch.dtype, seed: int = 0, act=F.silu,
             **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, reference) for one shape; the reference runs on the CPU."""
    x = inputs(t, h, dtype, seed + t)
    w, idx = routes(t, e, k, seed + 7 * t + k, dtype)
    gu, dn = on_device(e, h, i)
    out = fused_moe_w4a16(x.to(DEVICE), idx.to(DEVICE), w.to(DEVICE), gu, dn, act, **kw)
    return out, reference(x, idx, w, e, h, i, act)


# ----------------------------------------------------------------------------- routing (pure torch)


@pytest.mark.parametrize("t,e,k,bm", [(1, 8, 1, 16), (3, 60, 4, 16), (16, 64, 6, 16), (33, 8, 2, 32),
                                      (33, 64, 6, 64), (512, 64, 6, 16), (7, 4, 4, 16)])
def test_align_routes_invariants(t: int, e: int, k: int, bm: int) -> None:
    """Every route appears once, in its expert's block, expert-major and stable; padding fills the rest."""
    _, idx = routes(t, e, k, 3 * t + e, torch.float32)
    r = align_routes(idx, e, bm)
    s = t * k
    assert r.max_rows == max_padded_rows(s, e, bm) and r.max_rows % bm == 0
    ids = r.sorted_ids.long()
    real = ids[ids < s]
    assert sorted(real.tolist()) == list(range(s))
    flat = idx.reshape(-1)
    block_of_row = torch.arange(r.max_rows) // bm
    expert_of_row = r.block_expert.long()[block_of_row]
    assert torch.equal(flat[real], expert_of_row[ids < s])  # each route sits in a block of its expert
    assert real.tolist() == sorted(real.tolist(), key=lambda j: (int(flat[j]), j))  # expert-major, stable
    used = r.block_expert >= 0
    assert not bool(used[int(used.sum()):].any())  # active blocks first, idle blocks after
    counts = torch.bincount(flat, minlength=e)
    assert int(used.sum()) == int(((counts + bm - 1) // bm).sum())  # each expert: exactly ⌈n/BM⌉ blocks
    assert bool((ids[~used[block_of_row]] == s).all())


def test_align_routes_drops_masked_routes() -> None:
    idx = torch.tensor([[3, 1], [1, -1], [8, 2]])  # -1 and E=8 are "no expert"
    r = align_routes(idx, 8, 16)
    ids = r.sorted_ids.long()
    assert sorted(ids[ids < 6].tolist()) == [0, 1, 2, 5]
    assert r.block_expert.tolist()[:3] == [1, 2, 3]
    assert r.block_expert.tolist()[3:] == [-1] * (r.block_expert.numel() - 3)


def test_align_routes_needs_no_host_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """No `.item()`, `.tolist()`, truth test, nonzero/unique/bincount: buffer sizes come from shapes only."""
    def forbidden(*args, **kwargs):
        raise AssertionError("host synchronisation in align_routes")

    _, idx = routes(16, 64, 6, 1, torch.float32)
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "unique", "bincount",
                 "repeat_interleave", "masked_select"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for name in ("nonzero", "unique", "bincount", "repeat_interleave", "masked_select"):
        monkeypatch.setattr(torch, name, forbidden)
    r = align_routes(idx, 64, 16)
    monkeypatch.undo()
    assert r.sorted_ids.numel() == max_padded_rows(96, 64, 16)


# ----------------------------------------------------------------------------- the interpreter grid

GRID_T = [1, 3, 16, 33]
GRID_E = [8, 60, 64]
GRID_K = [1, 2, 4, 6]


@pytest.mark.parametrize("dtype,e", [(torch.float16, e) for e in GRID_E] + [(torch.float32, 8), (torch.float32, 60)],
                         ids=[f"fp16-E{e}" for e in GRID_E] + ["fp32-E8", "fp32-E60"])
@pytest.mark.parametrize("k", GRID_K)
def test_grid_tiny(e: int, k: int, dtype: torch.dtype) -> None:
    """T in {1, 3, 16, 33} x E x k at the tiny models' expert shape (H = I = 128): every combination
    in fp16 (the GPU draft's dtype); fp32 at E = 8 and 60 (E = 64 in fp32: the ratio grid below)."""
    for t in GRID_T:
        assert_matches(*run_case(t, e, k, 128, 128, dtype, seed=e))


# (H, I): tiny Phi (I = 2H); DeepSeek-V2-Lite / Qwen1.5-MoE 2048 x 1408 scaled by 1/8 (gs 128 / 16);
# Phi-3.5-MoE 4096 x 6400 scaled by 1/16 (gs 128 / 16). N is no multiple of the N tile there.
RATIO_DIMS = [(128, 256), (256, 176), (256, 400)]
RATIO_CASES = [(1, 64, 6), (3, 60, 4), (16, 8, 2), (33, 64, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("h,i", RATIO_DIMS)
def test_grid_model_ratios(h: int, i: int, dtype: torch.dtype) -> None:
    for t, e, k in RATIO_CASES:
        assert_matches(*run_case(t, e, k, h, i, dtype, seed=h + i))


@pytest.mark.slow
@pytest.mark.parametrize("h,i,t,e,k", [(1024, 704, 3, 8, 2), (512, 800, 5, 16, 2)])
def test_larger_model_ratio(h: int, i: int, t: int, e: int, k: int) -> None:
    """The two larger cases: DSV2/Qwen ratio at 1/2 scale (gs 128 / 64), Phi ratio at 1/8 (gs 128 / 32)."""
    assert_matches(*run_case(t, e, k, h, i, torch.float16, seed=5))


@pytest.mark.parametrize("t,e,k,h,i", [(1, 64, 6, 128, 128), (16, 60, 4, 128, 128), (3, 8, 2, 256, 176)])
def test_bf16(t: int, e: int, k: int, h: int, i: int) -> None:
    """bf16 (the interpreter computes in fp32 with bf16 rounding emulated; a GPU runs bf16 dots)."""
    assert_matches(*run_case(t, e, k, h, i, torch.bfloat16, seed=11))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_other_activation_runs_between_launches(dtype: torch.dtype) -> None:
    """Non-SiLU experts: the first launch writes [gate | up], torch applies the activation."""
    def gelu(v: torch.Tensor) -> torch.Tensor:
        return F.gelu(v, approximate="tanh")

    assert not triton_moe.is_silu(gelu)
    for t, e, k in [(3, 8, 2), (16, 64, 6)]:
        assert_matches(*run_case(t, e, k, 128, 256, dtype, seed=3, act=gelu))


def test_silu_recognised() -> None:
    from transformers.activations import ACT2FN

    assert triton_moe.is_silu(F.silu) and triton_moe.is_silu(torch.nn.SiLU()) and triton_moe.is_silu(ACT2FN["silu"])
    assert not triton_moe.is_silu(F.gelu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_masked_routes_and_empty_batch(dtype: torch.dtype) -> None:
    e, h, i = 16, 128, 128
    x = inputs(6, h, dtype, 8)
    w, idx = routes(6, e, 4, 9, dtype)
    masked = idx.clone()
    masked[0, 1] = e
    masked[3, :] = e
    masked[5, 0] = -1
    gu, dn = on_device(e, h, i)
    out = fused_moe_w4a16(x.to(DEVICE), masked.to(DEVICE), w.to(DEVICE), gu, dn, F.silu)
    ref = reference(x, masked.clamp(min=0).masked_fill(masked < 0, e), w, e, h, i)
    assert_matches(out, ref)
    assert torch.equal(out[3].cpu(), torch.zeros(h, dtype=dtype))
    empty = fused_moe_w4a16(x[:0].to(DEVICE), idx[:0].to(DEVICE), w[:0].to(DEVICE), gu, dn, F.silu)
    assert empty.shape == (0, h)


@pytest.mark.parametrize("cfg", [TritonMoEConfig(16, 32, 32, 1, 1), TritonMoEConfig(32, 64, 64, 4, 2)],
                         ids=["bm16-bn32-bk32", "bm32-bn64-bk64"])
def test_tile_sizes_and_kmajor_layout(cfg: TritonMoEConfig) -> None:
    """GPU-like tiles (K tile inside one group, several N tiles, BM = 32) give the same result;
    so does the N-contiguous weight storage (strides only)."""
    e, h, i = 8, 128, 256
    x = inputs(5, h, torch.float16, 1)
    w, idx = routes(5, e, 2, 2, torch.float16)
    gu, dn = on_device(e, h, i)
    ref = reference(x, idx, w, e, h, i)
    args = (x.to(DEVICE), idx.to(DEVICE), w.to(DEVICE))
    assert_matches(fused_moe_w4a16(*args, gu, dn, F.silu, config=cfg), ref)
    gu_t, dn_t = kmajor_layout(gu), kmajor_layout(dn)
    assert gu_t.qweight.stride(-1) != 1 and torch.equal(dequantize(gu_t), dequantize(gu))
    assert_matches(fused_moe_w4a16(*args, gu_t, dn_t, F.silu, config=cfg), ref)


def test_draft_moe_fused_dispatches_to_triton() -> None:
    e, h, i = 8, 128, 128
    x = inputs(3, h, torch.float32, 4).to(DEVICE)
    w, idx = (v.to(DEVICE) for v in routes(3, e, 2, 5, torch.float32))
    gu, dn = on_device(e, h, i)
    direct = fused_moe_w4a16(x, idx, w, gu, dn, F.silu)
    assert torch.equal(draft_moe_fused(x, idx, w, gu, dn, F.silu, backend="triton"), direct)


def test_tolerance_catches_errors() -> None:
    """The fp16 tolerance rejects a one-route mistake and the INT4-vs-FP gap: it is not vacuous."""
    e, h, i, t, k = 64, 128, 128, 16, 6
    out, ref = run_case(t, e, k, h, i, torch.float16, seed=2)
    x = inputs(t, h, torch.float16, 2 + t)
    w, idx = routes(t, e, k, 2 + 7 * t + k, torch.float16)
    wrong = idx.clone()
    wrong[4, 2] = (wrong[4, 2] + 1) % e  # one route sent to the neighbouring expert
    with pytest.raises(AssertionError):
        assert_matches(out, reference(x, wrong, w, e, h, i))
    g = torch.Generator().manual_seed(1000 * e + h + i)  # the FP weights `layer` quantized
    fp = (torch.randn(e, 2 * i, h, generator=g) / h**0.5, torch.randn(e, h, i, generator=g) / i**0.5)
    fp_out = moe_reference(x, idx, w, fp[0].half(), fp[1].half(), F.silu)
    assert errors(out, fp_out)[1] > 10 * TOL[torch.float16][2]


def test_rejects_what_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    gu, dn = on_device(8, 128, 128)
    x = torch.zeros(2, 128, device=DEVICE)
    w, idx = (v.to(DEVICE) for v in routes(2, 8, 2, 1, torch.float32))
    with pytest.raises(ValueError, match="block_k"):
        fused_moe_w4a16(x, idx, w, gu, dn, F.silu, config=TritonMoEConfig(16, 64, 48))
    with pytest.raises(ValueError, match="dtype"):
        fused_moe_w4a16(x.double(), idx, w, gu, dn, F.silu)
    odd = quantize_rtn(torch.randn(2, 32, 48), 24)  # group size 24: not a power of two
    assert "group size" in triton_moe.supports(torch.zeros(1, 48, device=DEVICE), odd,
                                               quantize_rtn(torch.randn(2, 48, 16), 16))
    if DEVICE.type == "cpu":
        monkeypatch.setattr(triton_moe, "INTERPRETED", False)  # as if imported without the interpreter
        assert "TRITON_INTERPRET" in triton_moe.supports(x.cpu(), gu, dn)
