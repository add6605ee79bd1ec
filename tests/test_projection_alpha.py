"""Drafts of several precisions (specter/projection/drafts.py) and the α curve (alpha.py): a b-bit draft lies on
the b-bit grid inside the INT4 container, 4-bit RTN and GPTQ are the project's own, the batched GPTQ is the
reference transcription step for step, an installed draft is the one the engine drafts with, and the curve
has one row per method and draft at the acceptance reached."""

from __future__ import annotations

import pytest
import torch

from conftest import compose


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_rtn_codes_lie_on_the_b_bit_grid(bits):
    from specter.projection.drafts import rtn_bits
    from specter.quant.int4 import dequantize, quantize_rtn, unpack_codes

    w = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(bits))
    q = rtn_bits(w, bits, 32)
    codes = unpack_codes(q.qweight)
    half = 2 ** (bits - 1)
    assert int(codes.min()) >= 8 - half and int(codes.max()) <= 8 + half - 1  # b-bit levels around the zero point 8
    err = (dequantize(q, torch.float32) - w).abs()
    step = q.scales.float().repeat_interleave(32, dim=-1)
    assert bool((err <= step / 2 + 1e-6).all())  # round to nearest: within half a step
    if bits == 4:
        ref = quantize_rtn(w, 32)
        assert torch.equal(q.qweight, ref.qweight) and torch.equal(q.scales, ref.scales)


def test_batched_gptq_is_the_reference_transcription_at_4_bits():
    from specter.projection.drafts import gptq_batched
    from specter.quant.gptq import gptq_reference

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 64, 128, generator=g)
    xs = [torch.randn(n, 128, generator=g) for n in (3, 40, 200)]
    xs[1][:, 5] = 0  # a column no token exercises
    codes, scales = gptq_batched(w, xs, 4, 32)
    for e in range(3):
        c, s = gptq_reference(w[e], xs[e], 32)
        assert torch.equal(c, codes[e]) and torch.allclose(s, scales[e], rtol=1e-6, atol=0)


def test_lower_bits_cost_accuracy():
    """GPTQ at fewer bits reproduces a linear's outputs worse, and GPTQ beats RTN at the same bits."""
    from specter.projection.drafts import _packed, gptq_batched, rtn_bits
    from specter.quant.int4 import dequantize

    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(1, 64, 128, generator=g), torch.randn(300, 128, generator=g)

    def out_err(q):
        return float((x @ dequantize(q, torch.float32)[0].t() - x @ w[0].t()).pow(2).mean())

    gptq = {b: out_err(_packed(*gptq_batched(w, [x], b, 32), b, 32)) for b in (2, 3, 4)}
    assert gptq[4] < gptq[3] < gptq[2]
    assert all(gptq[b] < out_err(rtn_bits(w, b, 32)) for b in (2, 3, 4))


def test_parse_draft():
    from specter.projection.drafts import PAPER_DRAFT, DraftSpec, parse_draft

    assert parse_draft("GPTQ3g64") == DraftSpec("gptq", 3, 64) and parse_draft("rtn2g32").name == "RTN INT2 g32"
    assert PAPER_DRAFT.name == "GPTQ INT4 g128"
    for bad in ("gptq1g128", "gptq4g100", "awq4g128", "gptq4", "gptq4g4"):
        with pytest.raises(ValueError, match="expected <gptq|rtn>"):
            parse_draft(bad)


@pytest.fixture(scope="module")
def curve():
    from specter.experiments.project import method_slots
    from specter.projection.cost_model import cost_model
    from specter.projection.steps import Proxy, alpha_step

    cfg = compose(["experiment=project", "model=dsv2", "memory=high", "project.quant=rtn", "project.prompts=1",
                   "project.new_tokens=16", "project.warmup_tokens=4", "project.alpha_drafts=[rtn4g128,rtn2g32]",
                   "project.alpha_methods=[specter,specmoeoff]"])
    slots, K = method_slots(cfg, "dsv2")
    px = Proxy(cfg, "tiny_dsv2", slots, K, "dsv2")
    cm = cost_model("dsv2", "a100_40gb_pcie4")
    return alpha_step(px, cm, {"model": "dsv2", "memory": "high", "device": cm.d.name}), px, cm


def test_the_alpha_curve_has_a_row_per_method_and_draft(curve):
    rows = curve[0]
    assert [(r["method"], r["draft"]) for r in rows] == [
        ("specter", "RTN INT4 g128"), ("specter", "RTN INT2 g32"),
        ("specmoeoff", "RTN INT4 g128"), ("specmoeoff", "RTN INT2 g32")]
    assert all(0 <= float(r["alpha"]) <= 1 and float(r["tpot_ms"]) > 0 for r in rows)
    assert {r["K"] for r in rows if r["method"] == "specter"} == {"16"}
    assert all(r["device"] == "a100_40gb_pcie4" for r in rows)


def test_an_installed_draft_is_the_one_the_engine_drafts_with(curve):
    """After install_draft(rtn2g32) the draft table the engine reads (the shared instance's for Specter, the
    separate instance's for SpecMoEOff) computes what the 2-bit layers compute, not what the 4-bit draft did."""
    from specter.assembly.methods import build_method
    from specter.projection.drafts import install_draft, parse_draft, quantize_layer
    from specter.quant.draft import build_draft, draft_forward, layer_weights

    _, px, _ = curve
    spec = parse_draft("rtn2g32")
    for name in ("specter", "specmoeoff"):
        method = build_method(px.config(name), px.checkpoint)
        try:
            moe = method.rt.moe if name == "specter" else method.draft_moe
            before = dict(moe.draft.experts)
            install_draft(method, spec)
            om = method.rt.om
            layer = om.moe_layers[0]
            g = torch.Generator().manual_seed(0)
            x = torch.randn(3, om.store.layout.hidden, generator=g)
            idx = torch.stack([torch.randperm(om.num_experts, generator=g)[:om.top_k] for _ in range(3)])
            w = torch.full(idx.shape, 1.0 / om.top_k)
            act = om.experts[layer].act_fn
            want = build_draft(om, "rtn", method.device, method.dtype, packed_layers={
                lay: quantize_layer(*layer_weights(om.store, lay), [], act, spec) for lay in om.moe_layers})[layer]
            got = draft_forward(x, idx, w, moe.draft.experts[layer], act)
            assert torch.equal(got, draft_forward(x, idx, w, want, act)), name
            assert not torch.equal(got, draft_forward(x, idx, w, before[layer], act)), name
            assert all(d.method == "rtn" for d in moe.draft.experts.values())
        finally:
            method.close()
