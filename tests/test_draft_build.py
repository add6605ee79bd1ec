"""GPTQ draft building: cached beside the model, verified by checksum; K profiling end to end."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from conftest import FIXTURES, compose


@pytest.fixture
def specter_home(tmp_path, monkeypatch, tiny_checkpoint):
    tiny_checkpoint("tiny_phi")  # built into the shared cache first; drafts go to a fresh home
    monkeypatch.setenv("SPECTER_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_gptq_draft_is_cached_and_checksummed(tiny_checkpoint, specter_home):
    from specter.assembly.runtime import build_runtime, gptq_draft_for, method_spec
    from specter.quant.calibration import CorruptDraft, load_draft

    ck = tiny_checkpoint("tiny_phi")
    cfg = compose(["model=tiny_phi", "method=specter", "method.quant=gptq", "method.calibration_prompts=4",
                   f"assets_dir={FIXTURES / 'datasets'}", "dataset=gsm8k", "num_prompts=1"])
    rt = build_runtime(method_spec(cfg), ck, K=4)
    try:
        layers, info = gptq_draft_for(method_spec(cfg), rt, ck)
        assert not info["cached"] and info["calibration_prompts"] >= 1
        assert all(d.gate_up.method == "gptq" for d in layers.values())
        again, info2 = gptq_draft_for(method_spec(cfg), rt, ck)
        assert info2["cached"] and info2["draft_archive"] == info["draft_archive"]
        for layer in layers:
            assert torch.equal(again[layer].gate_up.qweight, layers[layer].gate_up.qweight)
        archive = info["draft_archive"]
        data = bytearray(open(archive, "rb").read())
        data[-5] ^= 0xFF
        open(archive, "wb").write(bytes(data))
        with pytest.raises(CorruptDraft, match="checksum"):
            load_draft(__import__("pathlib").Path(archive))
    finally:
        rt.close()


def test_k_sweep_picks_min_tpot_and_feeds_specter(tiny_checkpoint, tmp_path):
    from specter.assembly.config import effective_K, load_ratio_of
    from specter.experiments.profile_k import profile_k

    tiny_checkpoint("tiny_qwen")
    out = tmp_path / "sweep"
    cfg = compose(["experiment=k_sweep", "model=tiny_qwen", "hardware=emulated", "dataset=humaneval", "num_prompts=1", "repeats=1",
                   "max_new_tokens=8", "warmup_tokens=0", "progress=false", "k_sweep.values=[1,3]", "method.quant=rtn",
                   f"output_dir={out}"])
    profile_k(cfg)
    table = pd.read_csv(out / "k_sweep.csv")
    profile = json.loads((out / "k_profile.json").read_text())
    assert list(table.K) == [1, 3]
    assert profile["K"] in (1, 3) and profile["swept"] == [1, 3] and profile["at_edge"] is True  # two values: both edges
    for K in (1, 3):
        rec = pd.read_csv(out / f"K={K}" / "records.csv")
        assert (rec.K == K).all() and rec.drafted_tokens.gt(0).all()
    assert effective_K(compose(["model=tiny_qwen", f"k_profile={out / 'k_profile.json'}"])) == profile["K"]
    from specter.assembly.config import ConfigError

    with pytest.raises(ConfigError, match="measured for"):
        effective_K(compose(["model=tiny_dsv2", f"k_profile={out / 'k_profile.json'}"]))
    # the K holds at the link cost it was profiled at: another load ratio is refused, a close one accepted
    at = f"k_profile={out / 'k_profile.json'}"
    assert profile["load_ratio"] == pytest.approx(load_ratio_of(compose(["model=tiny_qwen", "hardware=emulated"]))[0])
    assert effective_K(compose(["model=tiny_qwen", "hardware=emulated", at,
                                f"model.load_ratio={profile['load_ratio'] * 1.02}"])) == profile["K"]
    with pytest.raises(ConfigError, match="profiled at load ratio"):
        effective_K(compose(["model=tiny_qwen", "hardware=emulated", at, "model.load_ratio=0.7"]))


def test_choose_K_is_the_lowest_mean_tpot():
    from specter.experiments.profile_k import choose_K

    table = pd.DataFrame({"K": [2, 4, 8, 16], "mean_tpot_ms": [5.0, 3.0, 4.0, 3.0]})
    assert choose_K(table) == 4  # 4 and 16 tie at 3.0 ms: the smaller K wins
    assert choose_K(table.iloc[[0, 2]]) == 8


def test_k_sweep_profiles_the_k_that_fit_and_records_the_refused(tiny_checkpoint, tmp_path, monkeypatch):
    """A K the tier's budget refuses (a longer window's KV and scratch) is recorded, not fatal; none fitting is."""
    import specter.experiments.run as run_module
    from specter.experiments.profile_k import profile_k
    from specter.offload.budget import BudgetError

    tiny_checkpoint("tiny_qwen")
    real_run = run_module.run

    def budget_refuses_long_windows(cfg):
        if int(cfg.K) > 3:
            raise BudgetError(f"K={cfg.K} needs more than the budget")
        return real_run(cfg)

    monkeypatch.setattr(run_module, "run", budget_refuses_long_windows)
    out = tmp_path / "sweep"
    args = ["experiment=k_sweep", "model=tiny_qwen", "hardware=emulated", "dataset=humaneval", "num_prompts=1",
            "repeats=1", "max_new_tokens=8", "warmup_tokens=0", "progress=false", "method.quant=rtn"]
    profile_k(compose(args + ["k_sweep.values=[1,3,5]", f"output_dir={out}"]))
    profile = json.loads((out / "k_profile.json").read_text())
    assert list(pd.read_csv(out / "k_sweep.csv").K) == [1, 3] and profile["swept"] == [1, 3]
    assert profile["K"] in (1, 3) and list(profile["refused"]) == ["5"] and "budget" in profile["refused"]["5"]
    with pytest.raises(BudgetError, match="no K of"):
        profile_k(compose(args + ["k_sweep.values=[4,5]", f"output_dir={tmp_path / 'none'}"]))
