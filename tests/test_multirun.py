"""Hydra multiruns: one run folder per job and nothing stray, with the basic and submitit launchers."""

from __future__ import annotations

import importlib.util

import pandas as pd
import pytest
from conftest import FIXTURES, REPO, run_cli


def _has_submitit() -> bool:
    try:  # find_spec of a submodule raises when its parent package (hydra_plugins) is absent
        return importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except ModuleNotFoundError:
        return False


HAS_SUBMITIT = _has_submitit()

JOB = ["dataset=humaneval", "num_prompts=1", "repeats=1", "max_new_tokens=4", "warmup_tokens=1", "progress=false",
       f"assets_dir={FIXTURES / 'datasets'}"]


def _sweep_settings_present() -> None:
    text = (REPO / "conf" / "config.yaml").read_text()
    assert "${output_dir}" in text and "job_logging: stdout" in text, (
        "conf/config.yaml needs the sweep settings of ARTIFACT.md (Sweeps): hydra.sweep.dir under results/multirun, "
        "hydra.sweep.subdir = the run's output_dir, and hydra/job_logging: stdout")


def _check_tree(cwd, expected: list[str]) -> None:
    runs = cwd / "results" / "runs"
    assert sorted(p.name for p in runs.iterdir()) == sorted(expected)
    for name in expected:
        records = pd.read_csv(runs / name / "records.csv")
        assert len(records) == 1 and (records.new_tokens == 4).all()
        assert (runs / name / "config.yaml").exists()
    sweeps = list((cwd / "results" / "multirun").iterdir())
    assert len(sweeps) == 1 and (sweeps[0] / "multirun.yaml").exists()  # the sweep's own record, nothing else
    allowed = (runs, sweeps[0])
    stray = [p for p in cwd.rglob("*") if p not in (cwd / "results", runs, cwd / "results" / "multirun")
             and not any(a in p.parents or p == a for a in allowed)]
    assert not stray, f"files outside the run folders and the sweep folder: {stray}"
    assert not [p for p in runs.rglob("*.log")], "no job log inside run folders (they print to stdout)"


def test_basic_multirun_one_folder_per_job(tmp_path, tiny_checkpoint):
    _sweep_settings_present()
    for model in ("tiny_dsv2", "tiny_qwen"):
        tiny_checkpoint(model)
    res = run_cli(["-m", "model=tiny_dsv2,tiny_qwen", "method=target_only,offload_ar", *JOB], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    _check_tree(tmp_path, [f"{m}-{k}-high-humaneval" for m in ("tiny_dsv2", "tiny_qwen")
                           for k in ("target_only", "offload_ar")])
    # rerunning the sweep resumes: every job finds its records finished
    res = run_cli(["-m", "model=tiny_dsv2,tiny_qwen", "method=target_only,offload_ar", *JOB], cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.count("nothing to run") == 4


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SUBMITIT, reason="hydra-submitit-launcher is not installed (test extra)")
def test_submitit_local_launcher(tmp_path, tiny_checkpoint):
    _sweep_settings_present()
    tiny_checkpoint("tiny_qwen")
    res = run_cli(["-m", "hydra/launcher=local", "model=tiny_qwen", "method=target_only,offload_ar", *JOB], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    runs = tmp_path / "results" / "runs"
    assert sorted(p.name for p in runs.iterdir()) == ["tiny_qwen-offload_ar-high-humaneval",
                                                     "tiny_qwen-target_only-high-humaneval"]
    for run in runs.iterdir():
        assert len(pd.read_csv(run / "records.csv")) == 1
    sweep = next((tmp_path / "results" / "multirun").iterdir())
    assert (sweep / ".submitit").is_dir()  # submitit's job logs stay in the sweep folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["multirun", "runs"]


@pytest.mark.skipif(not HAS_SUBMITIT, reason="hydra-submitit-launcher is not installed (test extra)")
def test_slurm_launcher_config_composes(tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, SPECTER_SLURM_PARTITION="gpu")
    cmd = ["hydra/launcher=slurm", "--cfg", "hydra", "--package", "hydra.launcher", "--resolve"]
    res = subprocess.run([sys.executable, str(REPO / "run.py"), *cmd],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "SlurmLauncher" in res.stdout and "partition: gpu" in res.stdout and "gpus_per_node: 1" in res.stdout
    assert not list(tmp_path.iterdir())  # composing writes nothing
