"""SpecMoEOff as designed (method=specmoeoff) and as the paper artifact presets it (specmoeoff_artifact).

As designed, the target keeps every resident slot its budget holds beside the separate draft (no
slot more fits), and K comes from SpecMoEOff's own K profile, else the fixed default, with env.json
saying which. The artifact keeps the 12/2 preset and K = 3. Both stay under the budget, both are
lossless, and bad settings are one clear error.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from conftest import FIXTURES, TINY_MODELS, compose

from specter.assembly.config import ConfigError
from specter.assembly.methods import build_method
from specter.models.loading import load_full_model
from specter.offload.budget import BudgetError
from specter.speculative.autoregressive import generate_autoregressive
from specter.speculative.sampling import SamplingParams

# memory.slots=budget: these tests check each method's own sizing rule against the tiny tier's bytes (the rule the
# real model's plan applies at real sizes; tests/test_calibrated_machine.py checks the plan's slots on tiny models)
LINK = ["hardware=emulated", "hardware.bandwidth_gbps=2", "hardware.latency_us=5", "memory.slots=budget"]
PROMPT = torch.tensor([[17, 300, 45, 8, 512, 9, 77]])
N = 16
METHODS = ("specmoeoff", "specmoeoff_artifact")


def _build(model, memory, method, tiny_checkpoint, *extra):
    cfg = compose([f"model={model}", f"memory={memory}", f"method={method}", *LINK, f"max_new_tokens={N}",
                   "method.quant=rtn", *extra])
    return build_method(cfg, tiny_checkpoint(model))


def _one_more_slot_overflows(m) -> bool:
    """The design without its staging buffers, plus one more slot in every MoE layer, is over the budget."""
    fp, rt = m.rt.footprint, m.rt
    slot_row = len(rt.om.moe_layers) * rt.om.store.nbytes_per_expert
    return fp.total - fp.staging + slot_row > rt.budget_bytes


# ------------------------------------------------------------------------------------ residents
def test_designed_spends_its_budget_on_residents(tiny_checkpoint):
    """tiny_dsv2, low tier: the artifact's preset keeps 2 slots where 18 fit; the design keeps the 18."""
    m = _build("tiny_dsv2", "low", "specmoeoff", tiny_checkpoint)
    try:
        res = m.environment()["residents"]
        assert m.rt.resident == res["used"] == res["fit_in_budget"] == 18
        assert _one_more_slot_overflows(m)  # no slot more fits: the budget is spent
        assert m.rt.footprint.total <= m.rt.budget_bytes
        assert m.static_fields()["resident_experts"] == 18
    finally:
        m.close()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("memory", ["high", "low"])
@pytest.mark.parametrize("model", TINY_MODELS)
def test_under_budget_and_lossless(model, memory, method, tiny_checkpoint):
    m = _build(model, memory, method, tiny_checkpoint)
    try:
        res = m.environment()["residents"]
        assert m.rt.footprint.total <= m.rt.budget_bytes
        assert m.rt.resident == res["used"] >= 1
        if method == "specmoeoff":
            assert res["used"] == res["fit_in_budget"] and (_one_more_slot_overflows(m) or res["used"] == m.rt.om.num_experts)
        else:
            assert res["used"] == min(res["scaled"], res["fit_in_budget"])
        gen = m.generate(PROMPT, N, torch.Generator().manual_seed(0))
        full = load_full_model(tiny_checkpoint(model), torch.float32, torch.device("cpu"))
        assert gen.tokens == generate_autoregressive(full, PROMPT, N, SamplingParams())
        assert gen.stats["drafted_tokens"] > 0
    finally:
        m.close()


def test_artifact_reproduces_the_preset(tiny_checkpoint):
    """The numbers today's SpecMoEOff ran with: 12/2 of DeepSeek-V2-Lite's 64 experts on tiny_dsv2 (64),
    K = 3, prefetch after draft step 1 (int(0.2*3) = 0 has no routes; int(0.6*3) = 1)."""
    for memory, scaled, fit in (("high", 12, 31), ("low", 2, 18)):
        m = _build("tiny_dsv2", memory, "specmoeoff_artifact", tiny_checkpoint)
        try:
            env = m.environment()
            assert env["residents"] == {"preset": scaled, "of_real_experts": 64, "scaled": scaled,
                                        "fit_in_budget": fit, "used": scaled}
            assert m.rt.resident == scaled and env["K"] == m.static_fields()["K"] == 3
            assert env["prefetch_steps"] == [1] and env["K_source"] == "artifact preset method.K"
        finally:
            m.close()


def test_fitting_residents_by_hand():
    from baselines.specmoeoff import fitting_residents

    # 100 bytes left at B=1 for rows of 30: 3 slots; each further request takes 20
    assert fitting_residents(1100, 1000, 20, 30, (1,), 64).slots == 3
    assert fitting_residents(1100, 1000, 20, 30, (1,), 2).slots == 2  # at most every expert
    fit = fitting_residents(1100, 1000, 20, 30, (1, 2, 4, 8), 64)  # B=4: 40 left, 1 slot; B=8: none
    assert (fit.slots, fit.batch) == (1, 4)
    assert fitting_residents(1010, 1000, 20, 30, (1,), 64).slots == 0  # nothing fits: the caller refuses


# ------------------------------------------------------------------------------------ K
def _profile(tmp_path, model, method, K):
    path = tmp_path / f"{method}-k_profile.json"
    path.write_text(json.dumps({"model": model, "memory": "low", "hardware": "emulated", "method": method, "K": K}))
    return path


def test_K_source_default_profile_and_override(tiny_checkpoint, tmp_path):
    m = _build("tiny_qwen", "low", "specmoeoff", tiny_checkpoint)
    try:
        env = m.environment()
        assert env["K"] == 3 and env["K_source"] == "default method.K (no K profile given)"
    finally:
        m.close()
    own = _profile(tmp_path, "tiny_qwen", "specmoeoff", 5)
    m = _build("tiny_qwen", "low", "specmoeoff", tiny_checkpoint, f"k_profile={own}")
    try:
        env = m.environment()
        assert env["K"] == m.static_fields()["K"] == m.engine.K == 5 and env["K_source"] == f"k_profile {own}"
    finally:
        m.close()
    m = _build("tiny_qwen", "low", "specmoeoff", tiny_checkpoint, f"k_profile={own}", "K=2")
    try:
        assert m.environment()["K"] == 2 and m.environment()["K_source"] == "K= override"
    finally:
        m.close()
    m = _build("tiny_qwen", "low", "specmoeoff_artifact", tiny_checkpoint, f"k_profile={own}")
    try:
        assert m.environment()["K"] == 3  # the preset fixes K
    finally:
        m.close()


def test_k_sweep_profiles_specmoeoff_over_its_own_range(tiny_checkpoint, tmp_path):
    from specter.experiments.profile_k import profile_k

    tiny_checkpoint("tiny_dsv2")
    out = tmp_path / "sweep"
    profile_k(compose(["experiment=k_sweep", "method=specmoeoff", "model=tiny_dsv2", "memory=low", *LINK,
                       "dataset=humaneval", f"assets_dir={FIXTURES / 'datasets'}", "num_prompts=1", "repeats=1",
                       "max_new_tokens=6", "warmup_tokens=0", "progress=false", "method.quant=rtn",
                       "method.k_range=[1,2]", f"output_dir={out}"]))
    profile = json.loads((out / "k_profile.json").read_text())
    assert profile["method"] == "specmoeoff" and profile["swept"] == [1, 2] and profile["K"] in (1, 2)
    for K in (1, 2):
        rec = pd.read_csv(out / f"K={K}" / "records.csv")
        assert rec.K.eq(K).all()
    m = _build("tiny_dsv2", "low", "specmoeoff", tiny_checkpoint, f"k_profile={out / 'k_profile.json'}")
    try:
        assert m.environment()["K"] == profile["K"]
    finally:
        m.close()


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("method", METHODS)
def test_bad_K_is_a_config_error(method, tiny_checkpoint):
    with pytest.raises(ConfigError, match="K must be >= 1"):
        _build("tiny_dsv2", "low", method, tiny_checkpoint, "method.K=0")


def test_a_budget_without_room_for_one_slot_is_refused(tiny_checkpoint):
    from baselines.specmoeoff import NoResidentFits

    with pytest.raises(ConfigError, match="not one resident expert per layer fits beside the separate draft") as err:
        _build("tiny_dsv2", "low", "specmoeoff", tiny_checkpoint, "memory.budget_mb=1")
    assert isinstance(err.value, BudgetError) and isinstance(err.value, NoResidentFits) and "\n" not in str(err.value)
    with pytest.raises(BudgetError):  # the artifact, as before: its one slot over the budget
        _build("tiny_dsv2", "low", "specmoeoff_artifact", tiny_checkpoint, "memory.budget_mb=1")


def test_another_methods_profile_is_refused(tiny_checkpoint, tmp_path):
    specter_profile = _profile(tmp_path, "tiny_dsv2", "specter", 16)
    with pytest.raises(ConfigError, match="measured for method=specter"):
        _build("tiny_dsv2", "low", "specmoeoff", tiny_checkpoint, f"k_profile={specter_profile}")


def test_a_bad_k_range_is_refused(tmp_path):
    from specter.experiments.profile_k import profile_k

    with pytest.raises(ConfigError, match="method.k_range"):
        profile_k(compose(["experiment=k_sweep", "method=specmoeoff", "model=tiny_dsv2", "method.k_range=[0,2]",
                           f"output_dir={tmp_path}"]))


def test_a_sweep_folder_holds_one_methods_sweep(tmp_path):
    """SpecMoEOff's sweep never resumes into (or overwrites) Specter's folder, nor the other way round."""
    from specter.experiments.profile_k import profile_k

    (tmp_path / "K=2").mkdir()
    (tmp_path / "K=2" / "config.yaml").write_text("method:\n  name: specter\n")
    with pytest.raises(ConfigError, match="holds a K sweep of method=specter"):
        profile_k(compose(["experiment=k_sweep", "method=specmoeoff", "model=tiny_dsv2", f"output_dir={tmp_path}"]))
