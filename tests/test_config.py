"""Every config option composes; invalid values are rejected before any model loads."""

from __future__ import annotations

import itertools

import pytest

from conftest import REPO, compose
from specter.assembly.config import ConfigError, effective_K, resident_experts, validate

GROUPS = {g: sorted(p.stem for p in (REPO / "conf" / g).glob("*.yaml")) for g in
          ("model", "memory", "dataset", "method", "hardware", "experiment")}


def test_groups_are_complete():
    assert {"tiny_dsv2", "tiny_qwen", "tiny_phi", "dsv2", "qwen15moe", "phi35moe"} <= set(GROUPS["model"])
    assert {"high", "low"} <= set(GROUPS["memory"])
    assert {"c4", "wikitext2", "humaneval", "gsm8k", "gpqa", "all"} <= set(GROUPS["dataset"])
    assert {"cpu", "emulated", "cuda"} <= set(GROUPS["hardware"])
    assert "target_only" in GROUPS["method"] and "main" in GROUPS["experiment"]


@pytest.mark.parametrize("model,memory", itertools.product(GROUPS["model"], GROUPS["memory"]))
def test_every_model_and_tier_composes_and_validates(model, memory):
    cfg = compose([f"model={model}", f"memory={memory}"])
    validate(cfg)
    E = cfg.model.num_experts or cfg.model.published.num_experts  # hub models: read from the checkpoint
    assert 1 <= resident_experts(cfg) <= E


@pytest.mark.parametrize("group", ["dataset", "method", "hardware", "experiment"])
def test_every_option_composes(group):
    for option in GROUPS[group]:
        cfg = compose([f"{group}={option}"])
        validate(cfg)


def test_paper_resident_counts():
    expect = {("dsv2", "high"): 16, ("dsv2", "low"): 4, ("qwen15moe", "high"): 15, ("qwen15moe", "low"): 8,
              ("phi35moe", "high"): 2, ("phi35moe", "low"): 1}
    for (model, memory), M in expect.items():
        assert resident_experts(compose([f"model={model}", f"memory={memory}"])) == M
        tiny = {"dsv2": "tiny_dsv2", "qwen15moe": "tiny_qwen", "phi35moe": "tiny_phi"}[model]
        assert resident_experts(compose([f"model={tiny}", f"memory={memory}"])) == M


def test_model_default_K():
    assert [effective_K(compose([f"model={m}"])) for m in ("dsv2", "qwen15moe", "phi35moe")] == [16, 8, 16]
    assert effective_K(compose(["K=4"])) == 4


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["num_prompts=-1"], "num_prompts"),
        (["repeats=0"], "repeats"),
        (["max_new_tokens=0"], "max_new_tokens"),
        (["prefix_tokens=100000"], "context"),
        (["prefix_tokens=400", "max_new_tokens=200"], "exceeds"),
        (["K=0"], "K must be"),
        (["temperature=-1"], "temperature"),
        (["top_p=0"], "top_p"),
        (["verify_lossless=true", "temperature=0.7"], "temperature=0"),
        (["+memory.resident_experts=0"], "no expert slot"),
        (["+memory.resident_experts=999"], "exceeds"),
        (["method=target_only", "memory.budget_mb=10"], "does not apply a memory budget"),
        (["method=offload_ar", "memory.budget_mb=-5"], "memory.budget_mb must be > 0"),
        (["method=offload_ar", "method.schedule=bogus"], "method.schedule"),
        (["method=specter", "method.quant=bogus"], "method.quant"),
        (["method=specter", "method.calibration_prompts=0"], "calibration_prompts"),
        (["hardware.threads=-1"], "hardware.threads"),
        (["hardware.dtype=bogus"], "hardware.dtype"),
        (["model.load_ratio=0"], "load_ratio"),
    ],
)
def test_invalid_values_rejected(overrides, match):
    cfg = compose(overrides)
    with pytest.raises(ConfigError, match=match):
        validate(cfg)
        resident_experts(cfg)


def test_specter_defaults_follow_the_paper():
    cfg = compose(["method=specter"])
    assert cfg.method.quant == "gptq" and cfg.method.prefetch == "adaptive" and cfg.method.schedule == "expert"
    assert compose(["experiment=k_sweep"]).k_sweep["values"] == [2, 4, 6, 8, 12, 16, 20, 24, 32, 48, 64, 96]


def test_one_default_job(monkeypatch, capsys):
    """`python run.py`, `compose([])` and Hydra's flags without overrides (`--cfg job`) are one job."""
    import importlib.util

    from omegaconf import OmegaConf

    from specter.experiments import cli as cli_mod
    from specter.experiments import dispatch as experiments

    seen = []
    monkeypatch.setattr(experiments, "run_experiment", lambda cfg: seen.append(cfg))
    assert cli_mod.main([]) == 0
    default = compose([])
    assert default.experiment == "compare" and default.model.name == "tiny_dsv2" and default.memory.name == "low"
    assert OmegaConf.to_container(seen[0]) == OmegaConf.to_container(default)
    assert compose(["model=tiny_phi"]).experiment == "run"  # an override selects from conf/config.yaml
    spec = importlib.util.spec_from_file_location("run_entry", REPO / "run.py")
    run_entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_entry)
    assert run_entry.with_default_job(["--cfg", "job"]) == ["--cfg", "job", "experiment=compare"]
    assert run_entry.with_default_job(["--cfg", "job", "model=tiny_phi"]) == ["--cfg", "job", "model=tiny_phi"]
    assert run_entry.with_default_job(["--help"]) == ["--help"]


def test_every_experiment_runner_resolves():
    """Each registered runner names a function that exists (runners are imported only when they run)."""
    import importlib

    from specter.experiments.dispatch import EXPERIMENTS

    for kind, runner in EXPERIMENTS.items():
        module, name = runner.__qualname__.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), name)), kind
