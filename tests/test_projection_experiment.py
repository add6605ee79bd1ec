"""experiment=project's offload_ar replay (the cross-check rows): composes and runs for every real model and
tier with no weights, prints a table and writes an exact-bytes CSV; the proxy's recorded routes drive the
replay when a checkpoint exists. The engine-driven rows are tested in test_projection_engine.py."""

from __future__ import annotations

import csv
import itertools

import pytest

from conftest import compose

FAST = ["experiment=project", "project.tokens=8", "progress=false", "project.methods=[]"]  # replay rows only


def _run(tmp_path, overrides, capsys=None):
    from specter.experiments.dispatch import run_experiment

    out = run_experiment(compose([*FAST, *overrides, f"output_dir={tmp_path}"]))
    return (out / "projection.csv").read_bytes()


@pytest.mark.parametrize("model,memory", itertools.product(("dsv2", "qwen15moe", "phi35moe"), ("high", "low")))
def test_project_runs_for_every_real_model_and_tier(model, memory, tmp_path, capsys):
    data = _run(tmp_path, [f"model={model}", f"memory={memory}", "project.routes=independent"])
    out = capsys.readouterr().out
    assert "projected TPOT" in out and "INDEPENDENT" in out
    rows = list(csv.DictReader(data.decode().splitlines()))
    assert [(r["method"], r["source"]) for r in rows] == [("offload_ar", "replay")]
    assert {r["routes"] for r in rows} == {"independent"} and {r["device"] for r in rows} == {"a100_40gb_pcie4"}
    M = {("dsv2", "high"): 16, ("dsv2", "low"): 4, ("qwen15moe", "high"): 15, ("qwen15moe", "low"): 8,
         ("phi35moe", "high"): 2, ("phi35moe", "low"): 1}[model, memory]  # conf/model/<model>.yaml tiers
    ar = rows[0]
    assert ar["resident"] == str(M) and int(ar["staging"]) >= 0
    from specter.projection.cost_model import cost_model

    assert float(ar["tpot_ms"]) > cost_model(model, "a100_40gb_pcie4").target_step_resident() * 1e3
    assert float(ar["loads_per_token"]) > 0 and 0 < float(ar["copy_busy"]) <= 1
    if (model, memory) in (("dsv2", "low"), ("phi35moe", "low")):  # M < top-k: the engine's staging buffers serve
        assert "staged loads/token" in ar["note"] and int(ar["staging"]) > 0


def test_project_csv_is_byte_identical_across_runs(tmp_path):
    args = ["model=dsv2", "memory=high", "project.routes=independent"]
    assert _run(tmp_path / "a", args) == _run(tmp_path / "b", args)


def test_project_device_key_chooses_the_h200(tmp_path):
    a100 = list(csv.DictReader(_run(tmp_path / "a", ["model=qwen15moe", "project.routes=independent"]).decode().splitlines()))
    h200 = list(csv.DictReader(_run(tmp_path / "h", ["model=qwen15moe", "project.routes=independent",
                                                     "project.device=h200_pcie5"]).decode().splitlines()))
    assert h200[0]["device"] == "h200_pcie5" and float(h200[0]["tpot_ms"]) < float(a100[0]["tpot_ms"])


def test_project_replays_the_proxy_routes(tiny_checkpoint, tmp_path, capsys):
    """A tiny model stands for its real one; its (here random) checkpoint's routes drive the replay."""
    tiny_checkpoint("tiny_dsv2")
    args = ["model=tiny_dsv2", "model.trained=false", "memory=high", "project.routes=proxy"]
    data = _run(tmp_path / "a", args)
    assert "the proxy tiny_dsv2's teacher-forced routes" in capsys.readouterr().out
    rows = list(csv.DictReader(data.decode().splitlines()))
    assert rows[0]["model"] == "dsv2" and {r["routes"] for r in rows} == {"tiny_dsv2"} and rows[0]["resident"] == "16"
    assert [r["source"] for r in rows] == ["replay", "replay_unpermuted"]
    assert all(float(r["loads_per_token"]) > 0 for r in rows)
    assert _run(tmp_path / "b", args) == data


def test_project_refuses_proxy_routes_without_a_checkpoint(tmp_path, monkeypatch):
    from specter.assembly.config import ConfigError

    monkeypatch.setenv("SPECTER_HOME", str(tmp_path / "home"))
    with pytest.raises(ConfigError, match="no proxy checkpoint"):
        _run(tmp_path, ["model=dsv2", "project.routes=proxy"])


def test_independent_routes_are_distinct_top_k():
    from specter.experiments.project import independent_routes

    routes = independent_routes(3, 16, 2, 5, seed=0)
    assert len(routes) == 5 and all(len(set(step[layer])) == 2 for step in routes for layer in range(3))
    assert routes == independent_routes(3, 16, 2, 5, seed=0) and routes != independent_routes(3, 16, 2, 5, seed=1)


def test_tiny_proxy_takes_its_real_models_slots(tmp_path):
    """model=tiny_phi projects phi35moe with phi35moe's tier slots and staging buffers."""
    tiny = list(csv.DictReader(_run(tmp_path / "t", ["model=tiny_phi", "memory=low", "project.routes=independent"])
                               .decode().splitlines()))
    real = list(csv.DictReader(_run(tmp_path / "r", ["model=phi35moe", "memory=low", "project.routes=independent"])
                               .decode().splitlines()))
    assert tiny == real and tiny[0]["model"] == "phi35moe" and tiny[0]["resident"] == "1"
