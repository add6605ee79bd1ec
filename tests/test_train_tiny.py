"""Trained tiny models are a pure function of (spec, steps, seed): two trainings give the same bytes
whatever the thread count, a model that misses its quality gates is never used, and an installed
one is verified against its recorded hashes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO
from specter.models import tiny, tiny_train
from specter.models.registry import ModelUnavailable, ensure_trained

NAME = "tiny_phi"  # the fastest step


def _train_cli(root, threads: int, steps: int = 3) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "initialization.train_tiny", NAME, "--steps", str(steps),
                           "--root", str(root), "--no-progress"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=600)


@pytest.fixture
def root(tmp_path, tiny_checkpoint):
    """A models folder holding a copy of the built random tiny model (no rebuild needed)."""
    shutil.copytree(tiny_checkpoint(NAME), tmp_path / NAME)
    return tmp_path


def test_short_training_is_deterministic_and_gated(root):
    reports = []
    for threads in (1, 2):  # training pins one thread itself: the same bytes either way
        res = _train_cli(root, threads)
        assert res.returncode == 1, res.stderr[-2000:]
        errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and "missed its quality gates" in errors[0] and "Traceback" not in res.stderr
        rejected = tiny.tiny_dir(NAME, trained=True, root=root).with_name(f"{NAME}-trained.rejected")
        reports.append(json.loads((rejected / "specter_trained.json").read_text()))
    assert not tiny.tiny_dir(NAME, trained=True, root=root).exists()  # never installed
    a, b = reports
    assert a["steps"] == b["steps"] == 3
    assert a["weights_sha256"] == b["weights_sha256"] and a["files"] == b["files"]
    assert a["loss_first_25"] == b["loss_first_25"]
    assert not all(a["gates"]["passed"].values())
    # PhiMoE has no paper growth to match: the quality gates and three routing gates
    assert set(a["gates"]["passed"]) == {"loss", "repeat_within_4", "no_dead_expert", "usage_entropy",
                                         "window_vs_independent"}
    assert len(a["routing"]["dead_experts"]) == 4 and a["routing"]["tokens"] == 4096


def _install_fake_trained(root, passed: bool = True):
    """A 'trained' folder made from the random checkpoint, with a report as train() writes it."""
    out = tiny.tiny_dir(NAME, trained=True, root=root)
    shutil.copytree(root / NAME, out)
    report = {"name": NAME, "steps": 1, "gates": {"passed": {"loss": passed, "repeat_within_4": True,
                                                              "distinct_2gram": True}},
              "routing": {"dead_experts": [0] * 4, "usage_entropy": [0.95] * 4},
              "files": tiny.file_sha256s(out)}
    (out / "specter_trained.json").write_text(json.dumps(report))
    return out


def test_installed_trained_model_is_verified(root):
    out = _install_fake_trained(root)
    assert ensure_trained(NAME, root=root) == out
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64)  # an overwritten tensor of the same size
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelUnavailable, match="does not match its recorded sha256.*python -m initialization.train_tiny"):
        ensure_trained(NAME, root=root)
    weights.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    with pytest.raises(ModelUnavailable, match="does not match"):
        ensure_trained(NAME, root=root)


def test_gate_failures_are_refused_on_load(root):
    _install_fake_trained(root, passed=False)
    with pytest.raises(ModelUnavailable, match="missed its quality gates"):
        ensure_trained(NAME, root=root)
    report_path = tiny.tiny_dir(NAME, trained=True, root=root) / "specter_trained.json"
    report = json.loads(report_path.read_text())
    report["gates"]["passed"]["loss"] = True
    del report["routing"]  # trained before the routing gates existed: collapsed routing, refused
    report_path.write_text(json.dumps(report))
    with pytest.raises(ModelUnavailable, match="before the routing gates"):
        ensure_trained(NAME, root=root)
    report_path.write_text("{}")
    with pytest.raises(ModelUnavailable, match="older version"):
        ensure_trained(NAME, root=root)


def test_training_is_a_fixed_step_count():
    assert set(tiny_train.DEFAULT_STEPS) == set(tiny.TINY_SPECS)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        tiny_train.train(NAME, steps=0)


@pytest.mark.parametrize("name", sorted(tiny.TINY_SPECS))
def test_built_trained_models_match_their_pinned_digest(name):
    """Where the full trained model is built, it is the pinned one and passed its gates."""
    out = tiny.tiny_dir(name, trained=True)
    if not (out / "specter_trained.json").exists():
        pytest.skip(f"{name}-trained is not built here")
    report = json.loads((out / "specter_trained.json").read_text())
    pinned = tiny.trained_pin(name)
    if (pinned and report.get("cpu_kind") == tiny.cpu_kind() and report["steps"] == tiny_train.DEFAULT_STEPS[name]
            and report["torch"].split("+")[0] == "2.13.0"):
        assert report["weights_sha256"] == pinned
    assert all(report["gates"]["passed"].values())
    assert tiny_train.trained_problem(out) is None


def _check(name, model, tokenizer):  # stands in for specter.routing_stats.held_out_routing
    raise AssertionError("the fake training runs never call it")


def _fake_runs(monkeypatch, tmp_path, passes: list[bool]) -> list[int]:
    """`train` over fake training runs whose gates pass as listed; returns the step counts it ran.
    Every run must be handed the routing check `train` was given (a retry once got the last report instead)."""
    runs: list[int] = []
    monkeypatch.setattr(tiny, "ensure_tiny", lambda name, root=None: tmp_path / "random")

    def once(name, steps, seed, src, out, progress, balance, routing):
        assert routing is _check, f"try {len(runs) + 1} got {routing!r} as its routing check"
        runs.append(steps)
        tmp = out.with_name(out.name + ".partial")
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "steps").write_text(str(steps))
        ok = passes[len(runs) - 1]
        return tmp, {"weights_sha256": "x", "pinned_sha256": None, "loss_last_25": 4.0,
                     "greedy_after": {"repeat_within_4": 0.3 if ok else 0.7, "distinct_2gram_ratio": 0.2},
                     "routing": {"dead_experts": [0, 0], "usage_entropy": [0.95, 0.97],
                                 "window_vs_independent": [0.8, 0.9]},
                     "gates": {"passed": {"loss": True, "repeat_within_4": ok}}}

    monkeypatch.setattr(tiny_train, "train_once", once)
    return runs


def test_a_default_training_missing_its_gates_is_run_again_for_longer(monkeypatch, tmp_path):
    runs = _fake_runs(monkeypatch, tmp_path, [False, True])
    out = tiny_train.train(NAME, root=tmp_path, log=lambda msg: None, routing=_check)
    n = tiny_train.DEFAULT_STEPS[NAME]
    assert runs == [n, round(n * tiny_train.LONGER[0])] and (out / "steps").read_text() == str(runs[-1])


def test_a_training_missing_its_gates_on_every_try_is_rejected(monkeypatch, tmp_path):
    runs = _fake_runs(monkeypatch, tmp_path, [False] * 3)
    with pytest.raises(tiny_train.TrainingRejected, match="repeat_within_4 after"):
        tiny_train.train(NAME, root=tmp_path, log=lambda msg: None, routing=_check)
    assert len(runs) == 1 + len(tiny_train.LONGER)
    out = tiny.tiny_dir(NAME, trained=True, root=tmp_path)
    assert not out.exists() and out.with_name(out.name + ".rejected").is_dir()
    runs.clear()
    with pytest.raises(tiny_train.TrainingRejected):  # explicit steps: one try
        tiny_train.train(NAME, steps=7, root=tmp_path, log=lambda msg: None, routing=_check)
    assert runs == [7]
