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
    assert set(a["gates"]["passed"]) == {"loss", "repeat_within_4"}


def _install_fake_trained(root, passed: bool = True):
    """A 'trained' folder made from the random checkpoint, with a report as train() writes it."""
    out = tiny.tiny_dir(NAME, trained=True, root=root)
    shutil.copytree(root / NAME, out)
    report = {"name": NAME, "steps": 1, "gates": {"passed": {"loss": passed, "repeat_within_4": True,
                                                              "distinct_2gram": True}},
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
    (tiny.tiny_dir(NAME, trained=True, root=root) / "specter_trained.json").write_text("{}")
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
