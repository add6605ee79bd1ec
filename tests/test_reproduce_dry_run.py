"""scripts/reproduce_all.sh: the QUICK plan printed by DRY_RUN=1, without running or writing anything."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "reproduce_all.sh"
TINY = ("tiny_dsv2", "tiny_qwen", "tiny_phi")
STEP = re.compile(r"^\[(\d+)/(\d+)\] (\S+): (.*)$")


def dry_run(tmp_path: Path, **env) -> tuple[list[tuple[str, list[str]]], str]:
    out = tmp_path / "out"
    full = dict(os.environ, DRY_RUN="1", SPECTER_HOME=str(tmp_path / "home"), RESULTS=str(out / "results"),
                FIGURES=str(out / "figures"), LOGS=str(out / "logs"), **env)
    if "METHODS" not in env:
        full.pop("METHODS", None)
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=full, timeout=60)
    assert res.returncode == 0, res.stderr
    assert not out.exists() and not (tmp_path / "home").exists()  # a dry run writes nothing
    steps = []
    for line in res.stdout.splitlines():
        m = STEP.match(line)
        if m:
            steps.append((m.group(3), shlex.split(m.group(4))))
    total = {int(STEP.match(line).group(2)) for line in res.stdout.splitlines() if STEP.match(line)}
    assert total == {len(steps)} and steps
    return steps, res.stdout


def default_methods() -> list[str]:
    names = sorted(p.stem for p in (REPO / "conf" / "method").glob("*.yaml"))
    skip = {"llamacpp"} if importlib.util.find_spec("llama_cpp") is None else set()
    return [n for n in names if n not in skip | {"vllm"}]  # vllm: HARDWARE=cuda only


def test_quick_plan(tmp_path):
    steps, _ = dry_run(tmp_path, QUICK="1")
    names = [n for n, _ in steps]
    assert names[:3] == [f"quick.train-{m}" for m in TINY]
    assert "quick.datasets" in names
    assert [n for n in names if "k_sweep" in n] == [f"quick.k_sweep-{m}-low" for m in TINY]  # QUICK: low tier only
    methods = default_methods()
    mains = {n for n in names if n.startswith("quick.main-")}
    assert mains == {f"quick.main-{m}-{t}-{k}" for m in TINY for t in ("high", "low") for k in methods}
    assert {"quick.bench-draft-kernel", "quick.bench-verify", "quick.bench-prefetch"} <= set(names)
    assert names[-1] == "quick.figures"
    cmds = dict(steps)
    spec = cmds["quick.main-tiny_qwen-high-specter"]
    assert spec[:2] == ["python", "run.py"]
    for arg in ("experiment=main", "model=tiny_qwen", "memory=high", "hardware=emulated", "model.trained=true",
                "num_prompts=1", "repeats=2", "max_new_tokens=32"):
        assert arg in spec
    out = tmp_path / "out" / "results"
    assert f"k_profile={out}/k_sweep/tiny_qwen-low-emulated/k_profile.json" in spec
    assert f"output_dir={out}/main/tiny_qwen-specter-high" in spec
    assert "hardware=cpu" in cmds["quick.main-tiny_qwen-high-target_only"]  # moves no experts: nothing to emulate
    assert "k_sweep.values=[4,8,16]" in cmds["quick.k_sweep-tiny_dsv2-low"]
    assert cmds["quick.figures"][-4:] == ["--results", str(out), "--figures", str(tmp_path / "out" / "figures")]
    assert "--quick" in cmds["quick.bench-draft-kernel"]


def test_quick_plan_overrides_compose(tmp_path):
    """Every run.py command of the plan names valid config groups and keys."""
    from conftest import compose

    steps, _ = dry_run(tmp_path, QUICK="1", MODELS="tiny_qwen", TIERS="high")
    runs = [cmd for _, cmd in steps if cmd[:2] == ["python", "run.py"]]
    assert runs
    for cmd in runs:
        compose(cmd[2:])


def test_methods_and_paper_config(tmp_path):
    steps, _ = dry_run(tmp_path, METHODS="specter offload_ar", HARDWARE="cuda", MODELS="dsv2 qwen15moe phi35moe")
    names = [n for n, _ in steps]
    assert not [n for n in names if "train-" in n]  # real models are not trained here
    assert {n for n in names if n.startswith("full.main-")} == {
        f"full.main-{m}-{t}-{k}" for m in ("dsv2", "qwen15moe", "phi35moe") for t in ("high", "low")
        for k in ("specter", "offload_ar")}
    assert [n for n in names if "k_sweep" in n] == [f"full.k_sweep-{m}-{t}" for m in ("dsv2", "qwen15moe", "phi35moe")
                                                     for t in ("high", "low")]
    spec = dict(steps)["full.main-dsv2-low-specter"]
    assert "hardware=cuda" in spec and not [a for a in spec if a.startswith("model.trained")]
    assert not [a for a in spec if a.startswith(("num_prompts", "repeats"))]  # the full protocol of experiment=main


def test_slurm_launcher_plan(tmp_path):
    steps, _ = dry_run(tmp_path, QUICK="1", LAUNCHER="slurm", METHODS="target_only offload_ar specter")
    multi = [cmd for _, cmd in steps if cmd[1:3] == ["run.py", "-m"]]
    assert multi and all("hydra/launcher=slurm" in cmd for cmd in multi)
    main = dict(steps)["quick.main-tiny-others"]
    assert "model=tiny_dsv2,tiny_qwen,tiny_phi" in main and "memory=high,low" in main and "method=offload_ar" in main
    assert any(a.startswith("output_dir=") and "${model.name}-${method.name}-${memory.name}" in a for a in main)


@pytest.mark.parametrize("launcher", ["", "slurm"])
def test_moe_spec_shares_specters_k_profile(tmp_path, launcher):
    """MoE-Spec budgets Specter's verification: it runs with the same tier's profiled K."""
    steps, _ = dry_run(tmp_path, LAUNCHER=launcher, METHODS="specter moe_spec offload_ar")
    cmds = dict(steps)
    out = tmp_path / "out" / "results"
    if launcher:
        spec = cmds["full.main-tiny-specter"]
        assert "method=specter,moe_spec" in spec and "method=offload_ar" in cmds["full.main-tiny-others"]
        assert any(a.startswith("k_profile=") and "${memory.name}" in a for a in spec)
    else:
        for tier in ("high", "low"):
            profile = f"k_profile={out}/k_sweep/tiny_qwen-{tier}-emulated/k_profile.json"
            assert profile in cmds[f"full.main-tiny_qwen-{tier}-specter"]
            assert profile in cmds[f"full.main-tiny_qwen-{tier}-moe_spec"]
            assert not any(a.startswith("k_profile=") for a in cmds[f"full.main-tiny_qwen-{tier}-offload_ar"])


@pytest.mark.parametrize("var", ["QUICK", "DRY_RUN"])
def test_script_documents_its_settings(var):
    assert var in SCRIPT.read_text().split("set -uo pipefail")[0]
