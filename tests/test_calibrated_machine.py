"""One model of the paper's machine: the emulated link's default ratio is the projection's cost model,
a tiny model's cache sizes are the real model's plan, and the draft's precision is stated."""

from __future__ import annotations

import pytest
import torch

from specter.assembly.compose import compose
from specter.assembly.config import ConfigError, load_ratio_of
from specter.projection.cost_model import cost_model
from specter.projection.link_ratio import LEGACY_ESTIMATE, link_ratio

REAL_OF = {"tiny_dsv2": "dsv2", "tiny_qwen": "qwen15moe", "tiny_phi": "phi35moe"}


@pytest.mark.parametrize("tiny", sorted(REAL_OF))
def test_emulated_default_ratio_is_the_device_files(tiny: str) -> None:
    cfg = compose([f"model={tiny}", "hardware=emulated"])
    ratio, source = load_ratio_of(cfg)
    cm = cost_model(REAL_OF[tiny], "a100_40gb_pcie4")
    by_hand = cm.h2d() / ((cm.draft_step() - cm.t(cm.lm_head())) / cm.s.num_layers)  # one expert H2D / one draft layer
    assert ratio == pytest.approx(by_hand, rel=1e-12)
    assert "a100_40gb_pcie4" in source and REAL_OF[tiny] in source
    assert ratio != pytest.approx(LEGACY_ESTIMATE[REAL_OF[tiny]], rel=0.2)  # the old estimate is a named point only


def test_ratios_are_copy_bound_on_the_a100() -> None:
    # DeepSeek and Qwen charge a few draft layers per expert load, Phi (16 large experts) about thirty
    assert 3 < link_ratio("dsv2").ratio < 5 and 3 < link_ratio("qwen15moe").ratio < 5
    assert 20 < link_ratio("phi35moe").ratio < 40


def test_an_explicit_ratio_overrides_and_says_so() -> None:
    cfg = compose(["model=tiny_dsv2", "hardware=emulated", "model.load_ratio=0.7"])
    assert load_ratio_of(cfg) == (0.7, "model.load_ratio (set)")


def test_another_device_file_moves_the_ratio() -> None:
    a100 = load_ratio_of(compose(["model=tiny_qwen", "hardware=emulated"]))[0]
    h200 = load_ratio_of(compose(["model=tiny_qwen", "hardware=emulated", "hardware.device_model=h200_pcie5"]))[0]
    assert h200 != pytest.approx(a100)


def test_an_unknown_device_file_is_one_clear_error() -> None:
    from specter.assembly.config import validate

    with pytest.raises(ConfigError, match="device_model"):
        validate(compose(["model=tiny_dsv2", "hardware=emulated", "hardware.device_model=no_such_gpu"]))


def test_the_spec_carries_the_ratio_and_its_source() -> None:
    from specter.assembly.runtime import method_spec

    spec = method_spec(compose(["model=tiny_phi", "hardware=emulated", "method=specter"]))
    assert spec.link.load_ratio == pytest.approx(link_ratio("phi35moe").ratio)
    assert spec.link.load_ratio_source.startswith("cost model: phi35moe")


def test_named_points_of_the_sweep() -> None:
    from specter.experiments.load_ratio_sweep import named_ratios

    cfg = compose(["experiment=load_ratio_sweep", "model=tiny_dsv2"])
    named = named_ratios(cfg, "tiny_dsv2")
    assert named[0.7] == "legacy estimate"
    assert named[round(link_ratio("dsv2").ratio, 3)] == "a100_40gb_pcie4"
    assert named_ratios(cfg, "tiny_phi")[6.0] == "legacy estimate"


# ----------------------------------------------------------------------------- real-model slots

def _plan_row(real: str, tier: str, method: str):
    from specter.assembly.plan import plan_rows

    rows, _ = plan_rows(compose([f"model={real}", f"memory={tier}", "hardware=cuda", "experiment=plan"]))
    return next(r for r in rows if r.method == method and r.batch == 1)


@pytest.mark.parametrize("tiny,tier", [("tiny_dsv2", "high"), ("tiny_qwen", "low"), ("tiny_phi", "high")])
def test_mo_sm_slots_are_the_real_plans(tiny: str, tier: str) -> None:
    from specter.assembly.real_plan import planned_slots

    planned = planned_slots(compose([f"model={tiny}", f"memory={tier}", "method=mo_sm", "hardware=emulated"]))
    assert planned is not None and planned.resident == _plan_row(REAL_OF[tiny], tier, "mo_sm").resident
    assert REAL_OF[tiny] in planned.source


def test_dsv2_high_mo_sm_holds_32_slots_as_the_plan_says() -> None:
    from specter.assembly.real_plan import planned_slots

    assert _plan_row("dsv2", "high", "mo_sm").resident == 32
    assert planned_slots(compose(["model=tiny_dsv2", "memory=high", "method=mo_sm"])).resident == 32


def test_staging_scales_per_layer() -> None:
    from specter.assembly.real_plan import planned_slots

    row = _plan_row("dsv2", "high", "specter")
    planned = planned_slots(compose(["model=tiny_dsv2", "memory=high", "method=specter"]))
    assert planned.resident == 16 and planned.staging(26) == row.staging
    assert planned.staging(3) == round(row.staging * 3 / 26)


def test_a_batch_experiment_takes_the_plan_at_its_largest_batch() -> None:
    """Every batch size runs on one device layout: the real plan's at the largest size, whose KV and scratch
    for 32 requests leave fewer staging buffers than one request's (Phi-3.5-MoE high: the budget binds)."""
    from specter.assembly.config import effective_K
    from specter.assembly.plan import plan_rows
    from specter.assembly.real_plan import planned_slots

    single = planned_slots(compose(["model=tiny_phi", "memory=high", "method=specter"]))
    batched = planned_slots(compose(["model=tiny_phi", "memory=high", "method=specter", "experiment=batch",
                                     "batch.sizes=[1,32]"]))
    rows, _ = plan_rows(compose(["model=phi35moe", "memory=high", "hardware=cuda", "experiment=plan",
                                 "batch.sizes=[32]", "K=" + str(effective_K(compose(["model=tiny_phi"])))]))
    row = next(r for r in rows if r.method == "specter")
    assert batched.resident == single.resident and batched.staging_per_layer < single.staging_per_layer
    assert batched.staging(32) == row.staging


@pytest.mark.parametrize("overrides", [["memory.slots=budget"], ["memory.resident_experts=8"], ["memory.budget_mb=50"],
                                       ["method=target_only"]])
def test_own_budget_when_asked_or_user_sized(overrides: list[str]) -> None:
    from specter.assembly.real_plan import planned_slots

    assert planned_slots(compose(["model=tiny_dsv2", "memory=high", "method=mo_sm", *overrides])) is None


def test_unknown_slot_source_is_refused() -> None:
    from specter.assembly.real_plan import planned_slots

    with pytest.raises(ConfigError, match="memory.slots"):
        planned_slots(compose(["model=tiny_dsv2", "memory.slots=mine"]))


def test_a_built_mo_sm_runs_with_the_plans_slots(tiny_checkpoint) -> None:
    from specter.assembly.methods import build_method

    cfg = compose(["model=tiny_dsv2", "memory=high", "method=mo_sm", "hardware=cpu"])
    method = build_method(cfg, tiny_checkpoint("tiny_dsv2"))
    try:
        assert method.rt.resident == 32
        env = method.environment()
        assert env["resident_experts_per_layer"] == 32 and "plan of dsv2" in env["slots_source"]
    finally:
        method.close()


# ----------------------------------------------------------------------------- draft precision

def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("n,k,gs", [(32, 128, 128), (64, 256, 64)])
def test_fewer_bits_live_in_the_int4_layout(bits: int, n: int, k: int, gs: int) -> None:
    from specter.quant.gptq import gptq_reference
    from specter.quant.int4 import dequantize, quantize_rtn, unpack_codes

    w = torch.randn(n, k, generator=_gen(1)) / 8
    x = torch.randn(64, k, generator=_gen(2))
    codes, scales = gptq_reference(w, x, gs, bits=bits)
    lo, hi = 8 - 2 ** (bits - 1), 8 + 2 ** (bits - 1) - 1
    assert int(codes.min()) >= lo and int(codes.max()) <= hi
    rtn = quantize_rtn(w[None], gs, torch.float32, bits=bits)
    c = unpack_codes(rtn.qweight)
    assert int(c.min()) >= lo and int(c.max()) <= hi
    err = (dequantize(rtn, torch.float32)[0] - w).abs()
    assert bool((err <= rtn.scales[0].repeat_interleave(gs, -1) / 2 + 1e-6).all())  # RTN: within half a step


def test_fewer_bits_cost_accuracy_monotonically() -> None:
    from specter.quant.int4 import dequantize, quantize_rtn

    w = torch.randn(64, 128, generator=_gen(3))
    errs = [float((dequantize(quantize_rtn(w[None], 128, torch.float32, bits=b), torch.float32)[0] - w).pow(2).mean())
            for b in (4, 3, 2)]
    assert errs[0] < errs[1] < errs[2]


@pytest.mark.parametrize("bits", [2, 3])
def test_builtin_gptq_agrees_with_gptqmodel_at_fewer_bits(bits: int) -> None:
    from specter.quant.gptq import gptq_reference, quantize_linear
    from specter.quant.int4 import unpack_codes

    w = torch.randn(64, 256, generator=_gen(9)) / 16
    x = torch.randn(96, 256, generator=_gen(10)) * torch.logspace(0, -1, 256)
    ours, ours_scales = gptq_reference(w, x, 128, bits=bits)
    theirs = quantize_linear(w, x, 128, engine="gptqmodel", scale_dtype=torch.float32, bits=bits)
    assert float((unpack_codes(theirs.qweight[0]) == ours).float().mean()) > 0.98
    torch.testing.assert_close(theirs.scales[0], ours_scales, rtol=1e-5, atol=1e-7)


def test_draft_bits_are_validated() -> None:
    from specter.assembly.config import validate

    with pytest.raises(ConfigError, match="draft_bits"):
        validate(compose(["model=tiny_dsv2", "model.draft_bits=5"]))


@pytest.mark.parametrize("tiny", sorted(REAL_OF))
@pytest.mark.parametrize("tier", ["high", "low"])
def test_every_offloading_method_has_a_plan_that_fits(tiny: str, tier: str) -> None:
    from specter.assembly.real_plan import planned_slots

    for method in ("offload_ar", "mo_sc", "mo_sm", "specter", "specmoeoff", "specmoeoff_artifact", "moe_spec"):
        planned = planned_slots(compose([f"model={tiny}", f"memory={tier}", f"method={method}"]))
        row = _plan_row(REAL_OF[tiny], tier, method)
        assert planned.resident == row.resident, (method, row)
        assert row.fits_budget or "over the tier's budget" in planned.source  # run at the minimum, and said


def test_planned_mo_sm_is_lossless(tiny_checkpoint) -> None:
    from specter.assembly.methods import build_method

    prompt = torch.tensor([[17, 300, 45, 8, 512, 9, 77]])
    outs = {}
    for method in ("target_only", "mo_sm"):
        cfg = compose(["model=tiny_phi", "memory=low", f"method={method}", "hardware=cpu"])
        m = build_method(cfg, tiny_checkpoint("tiny_phi"))
        try:
            if method == "mo_sm":
                assert m.rt.resident == _plan_row("phi35moe", "low", "mo_sm").resident
            outs[method] = m.generate(prompt, 12, torch.Generator().manual_seed(0)).tokens
        finally:
            m.close()
    assert outs["mo_sm"] == outs["target_only"]
