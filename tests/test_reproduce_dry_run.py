"""scripts/reproduce_all.sh: the plan printed by DRY_RUN=1 (and CHECK=1), without running or writing anything:
the dataset decision that narrows DATASET, and the steps a failed step makes skip (DRY_FAIL)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "reproduce_all.sh"
TINY = ("tiny_dsv2", "tiny_qwen", "tiny_phi")
STEP = re.compile(r"^\[(\d+)/(\d+)\] (\S+): (.*)$")
FIXTURES = REPO / "tests" / "fixtures" / "datasets"


def script(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    out = tmp_path / "out"
    env.setdefault("ASSETS", str(FIXTURES))  # every dataset present (tiny fixture files)
    full = dict(os.environ, SPECTER_HOME=str(tmp_path / "home"), RESULTS=str(out / "results"),
                FIGURES=str(out / "figures"), LOGS=str(out / "logs"), **env)
    # `python` is this interpreter (a virtualenv's): the plan's method list depends on what it can import
    full["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), full.get("PATH", "")])
    for var in ("METHODS", "DATASET", "DRY_FAIL", "CHECK", "DRY_RUN"):
        if var not in env:
            full.pop(var, None)
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=full, timeout=60, cwd=tmp_path)
    assert not out.exists() and not (tmp_path / "home").exists()  # a dry run or check writes nothing
    return res


def dry_run(tmp_path: Path, **env) -> tuple[list[tuple[str, list[str]]], str]:
    res = script(tmp_path, DRY_RUN="1", **env)
    assert res.returncode == 0, res.stderr
    steps = []
    for line in res.stdout.splitlines():
        m = STEP.match(line)
        if m:
            rest = m.group(4)
            steps.append((m.group(3), rest if rest.startswith("skipped ") else shlex.split(rest)))
    total = {int(STEP.match(line).group(2)) for line in res.stdout.splitlines() if STEP.match(line)}
    assert total == {len(steps)} and steps
    return steps, res.stdout


def many_prompts(tmp_path: Path, n: int = 40) -> Path:
    """An assets folder whose GSM8K file yields n prompts (the full protocol asks 5, batching 32)."""
    import json

    assets = tmp_path / "many"
    (assets / "gsm8k").mkdir(parents=True)
    (assets / "gsm8k" / "test.jsonl").write_text(
        "".join(json.dumps({"question": f"Question {i}: what is {i} plus {i}?", "answer": str(2 * i)}) + "\n"
                for i in range(n)))
    return assets


def assets_with(tmp_path: Path, *names: str) -> Path:
    assets = tmp_path / "assets"
    assets.mkdir()
    for name in names:
        shutil.copytree(FIXTURES / name, assets / name)
    return assets


def default_methods() -> list[str]:
    names = sorted(p.stem for p in (REPO / "conf" / "method").glob("*.yaml"))
    skip = {"llamacpp"} if importlib.util.find_spec("llama_cpp") is None else set()
    return [n for n in names if n not in skip | {"vllm"}]  # vllm: HARDWARE=cuda only


def test_quick_plan(tmp_path):
    steps, _ = dry_run(tmp_path, QUICK="1")
    names = [n for n, _ in steps]
    assert names[0] == "quick.datasets"  # the dataset check runs first: it decides what the runs are given
    assert names[1:4] == [f"quick.train-{m}" for m in TINY]
    # QUICK: low tier only; Specter's profile over the paper's K set and SpecMoEOff's own over its k_range
    assert [n for n in names if "k_sweep" in n] == [f"quick.k_sweep-{m}-low{x}" for m in TINY for x in ("", "-specmoeoff")]
    methods = default_methods()
    mains = {n for n in names if n.startswith("quick.main-")}
    assert mains == {f"quick.main-{m}-{t}" for m in TINY for t in ("high", "low")}  # one cell per model x tier
    assert {"quick.bench-draft-kernel", "quick.bench-verify", "quick.bench-prefetch"} <= set(names)
    assert names[-1] == "quick.figures"
    cmds = dict(steps)
    spec = cmds["quick.main-tiny_qwen-high"]
    assert spec[:2] == ["python", "run.py"]
    for arg in ("experiment=cell", "model=tiny_qwen", "memory=high", "hardware=emulated", "model.trained=true",
                "num_prompts=1", "repeats=1", "max_new_tokens=32", "dataset=all"):
        assert arg in spec
    (listed,) = [a for a in spec if a.startswith("cell.methods=")]
    assert set(listed.split("=", 1)[1].strip("[]").split(",")) == {m for m in methods if m != "vllm"}
    out = tmp_path / "out" / "results"
    assert f"k_profile={out}/k_sweep/tiny_qwen-low-emulated/k_profile.json" in spec
    assert f"output_dir='{out}/main/tiny_qwen-{{method}}-high'" in spec
    assert "+cell.hardware.target_only=cpu" in spec  # moves no experts: nothing to emulate
    assert "k_sweep.values=[4,8,16]" in cmds["quick.k_sweep-tiny_dsv2-low"]
    assert cmds["quick.figures"][-4:] == ["--results", str(out), "--figures", str(tmp_path / "out" / "figures")]
    assert "--quick" in cmds["quick.bench-draft-kernel"]
    for step, module in (("bench-draft-kernel", "bench_draft_kernel"), ("bench-verify", "bench_verify"),
                         ("bench-prefetch", "bench_methods")):  # as modules: the repo root on sys.path, no install
        assert cmds[f"quick.{step}"][1:3] == ["-m", f"scripts.{module}"]
    # the staging ablation: every cache-owning method without staging buffers (QUICK: first model, low tier)
    owning = [k for k in methods if k in ("offload_ar", "mo_sc", "mo_sm", "specmoeoff", "specter", "moe_spec")]
    ablation = [n for n in names if ".ablation-" in n]
    assert sorted(ablation) == sorted(f"quick.ablation-staging0-tiny_dsv2-low-{k}" for k in owning) and len(owning) == 6
    for name in ablation:
        assert "method.staging_buffers=0" in cmds[name] and "memory=low" in cmds[name]
        assert any(a.startswith(f"output_dir={out}/ablation/staging0/") for a in cmds[name])


def test_reference_plan_profiles_k_at_every_tier_on_the_papers_record_length(tmp_path):
    steps, _ = dry_run(tmp_path, REFERENCE="1", MODELS="tiny_qwen", ASSETS=str(many_prompts(tmp_path)))
    cmds = dict(steps)
    assert [n for n in cmds if "k_sweep" in n] == [  # a profile per tier, Specter's and SpecMoEOff's own
        "reference.k_sweep-tiny_qwen-high", "reference.k_sweep-tiny_qwen-high-specmoeoff",
        "reference.k_sweep-tiny_qwen-low", "reference.k_sweep-tiny_qwen-low-specmoeoff"]
    for tier in ("high", "low"):
        cell = cmds[f"reference.main-tiny_qwen-{tier}"]
        own = cmds[f"reference.k_sweep-tiny_qwen-{tier}-specmoeoff"]
        assert "method=specmoeoff" in own and not any(a.startswith("k_sweep.values=") for a in own)
        assert "method.k_range=[4,8,16,32,48,64,96]" in own  # the same K set as Specter's, to 96
        assert "k_sweep.values=[4,8,16,32,48,64,96]" in cmds[f"reference.k_sweep-tiny_qwen-{tier}"]
        for arg in ("num_prompts=2", "max_new_tokens=128", "warmup_tokens=64"):  # 6 prompts x 128 tokens
            assert arg in own and arg in cmds[f"reference.k_sweep-tiny_qwen-{tier}"]
        profile = f"{tmp_path}/out/results/k_sweep/tiny_qwen-{tier}-emulated-specmoeoff/k_profile.json"
        assert f"+cell.k_profiles.specmoeoff={profile}" in cell  # SpecMoEOff's K from its own profile, this tier's
        assert f"k_profile={tmp_path}/out/results/k_sweep/tiny_qwen-{tier}-emulated/k_profile.json" in cell
        for arg in ("experiment=cell", "num_prompts=5", "repeats=2", "max_new_tokens=128", "warmup_tokens=64"):
            assert arg in cell  # 5 prompts per dataset x 2 timing repeats, 128 tokens after a 64-token warm-up
        assert f"output_dir='{tmp_path}/out/results/main/tiny_qwen-{{method}}-{tier}'" in cell
    batch = cmds["reference.batch-tiny_qwen-specmoeoff"]
    assert f"k_profile={tmp_path}/out/results/k_sweep/tiny_qwen-high-emulated-specmoeoff/k_profile.json" in batch
    assert "batch.sizes=[1,2,4,8,16,32]" in cmds["reference.batch-tiny_qwen-specter"]
    assert "dataset.name=wikitext2\\,humaneval\\,gsm8k" in batch  # the batch sweep on every dataset
    res = script(tmp_path, DRY_RUN="1", QUICK="1", REFERENCE="1")
    assert res.returncode != 0 and "choose one" in res.stderr + res.stdout


def test_quick_plan_overrides_compose(tmp_path):
    """Every run.py command of the plan names valid config groups and keys."""
    from conftest import compose

    steps, _ = dry_run(tmp_path, QUICK="1", MODELS="tiny_qwen", TIERS="high")
    runs = [cmd for _, cmd in steps if cmd[:2] == ["python", "run.py"]]
    assert runs
    for cmd in runs:
        compose(cmd[2:])


def test_methods_and_paper_config(tmp_path):
    steps, out = dry_run(tmp_path, METHODS="specter offload_ar", HARDWARE="cuda", MODELS="dsv2 qwen15moe phi35moe",
                         ASSETS=str(many_prompts(tmp_path)), DATASET="gsm8k,c4")
    assert "datasets: gsm8k (GK) (not present: c4 (C4))" in out
    names = [n for n, _ in steps]
    assert not [n for n in names if "train-" in n]  # real models are not trained here
    assert {n for n in names if n.startswith("full.main-")} == {  # real models: a step per method (GPU memory)
        f"full.main-{m}-{t}-{k}" for m in ("dsv2", "qwen15moe", "phi35moe") for t in ("high", "low")
        for k in ("specter", "offload_ar")}
    assert [n for n in names if "k_sweep" in n] == [f"full.k_sweep-{m}-{t}" for m in ("dsv2", "qwen15moe", "phi35moe")
                                                     for t in ("high", "low")]
    spec = dict(steps)["full.main-dsv2-low-specter"]
    assert "experiment=main" in spec
    assert "hardware=cuda" in spec and not [a for a in spec if a.startswith("model.trained")]
    assert not [a for a in spec if a.startswith(("num_prompts", "repeats"))]  # the full protocol of experiment=main
    assert "dataset=gsm8k" in spec and "dataset=gsm8k" in dict(steps)["full.batch-dsv2-specter"]


def test_slurm_launcher_plan(tmp_path):
    steps, _ = dry_run(tmp_path, QUICK="1", LAUNCHER="slurm", METHODS="target_only offload_ar specter")
    multi = [cmd for _, cmd in steps if cmd[1:3] == ["run.py", "-m"]]
    assert multi and all("hydra/launcher=slurm" in cmd for cmd in multi)
    main = dict(steps)["quick.main-tiny-others"]
    assert "model=tiny_dsv2,tiny_qwen,tiny_phi" in main and "memory=high,low" in main and "method=offload_ar" in main
    assert any(a.startswith("output_dir=") and "${model.name}-${method.name}-${memory.name}" in a for a in main)


@pytest.mark.parametrize("var", ["QUICK", "REFERENCE", "DRY_RUN"])
def test_script_documents_its_settings(var):
    assert var in SCRIPT.read_text().split("set -uo pipefail")[0]


def _runs(steps):
    return {n: cmd for n, cmd in steps if isinstance(cmd, list) and cmd[1:2] == ["run.py"]}


def test_dataset_check_narrows_to_the_datasets_present(tmp_path):
    """Two of five present: every run is given exactly those two, said once at the start; no step per missing one."""
    assets = assets_with(tmp_path, "c4", "gsm8k")
    steps, out = dry_run(tmp_path, QUICK="1", ASSETS=str(assets), DATASET="c4,gsm8k,gpqa")  # GPQA: never bundled
    header = [line for line in out.splitlines() if line.startswith("datasets:")]
    assert len(header) == 1
    assert "datasets: c4 (C4), gsm8k (GK) (not present: gpqa (GP))" in header[0]
    runs = _runs(steps)
    assert runs
    for name, cmd in runs.items():
        chosen = [a for a in cmd if a.startswith("dataset")]
        if ".trace-" in name:
            assert chosen == ["dataset=c4"], (name, chosen)  # one prompt of one dataset: a timeline
        elif ".batch-" not in name:
            assert chosen == ["dataset=all", "dataset.name=c4\\,gsm8k"], (name, chosen)
    prefetch = dict(steps)["quick.bench-prefetch"]
    assert prefetch[prefetch.index("--datasets") + 1] == "c4"  # QUICK: the ablation on one dataset
    assert "gpqa" not in " ".join(" ".join(c) for c in runs.values())


def test_one_dataset_present_is_passed_by_name(tmp_path):
    steps, out = dry_run(tmp_path, QUICK="1", ASSETS=str(assets_with(tmp_path, "gsm8k")), DATASET="c4,gsm8k",
                         MODELS="tiny_qwen", METHODS="offload_ar specter")
    runs = _runs(steps)
    assert all("dataset=gsm8k" in cmd for n, cmd in runs.items() if ".batch-" not in n)
    assert "datasets: gsm8k (GK) (not present: c4 (C4))" in out


def test_narrowed_dataset_composes_and_validates(tmp_path):
    """The comma list reaches the run's config as dataset.name and passes validation."""
    from conftest import compose

    from specter.assembly.config import validate
    from specter.datasets import expand_datasets

    steps, _ = dry_run(tmp_path, QUICK="1", ASSETS=str(assets_with(tmp_path, "c4", "gsm8k")),
                       DATASET="c4,gsm8k,gpqa", MODELS="tiny_qwen", TIERS="high", METHODS="offload_ar")
    # (gpqa: not present, not bundled)
    cmd = _runs(steps)["quick.main-tiny_qwen-high"]
    cfg = compose(cmd[2:])
    assert expand_datasets(cfg.dataset.name) == ["c4", "gsm8k"]
    validate(cfg)


def test_no_dataset_present_stops_with_one_message(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    res = script(tmp_path, DRY_RUN="1", QUICK="1", ASSETS=str(empty), DATASET="c4,gpqa")  # neither is bundled
    assert res.returncode == 2
    assert not STEP.search(res.stdout) and "Traceback" not in res.stderr
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "none of the requested datasets" in errors[0]
    assert f"{empty}/c4/" in res.stderr and f"{empty}/gpqa/" in res.stderr  # where each file goes
    assert "prepare_datasets" in res.stderr


def test_bad_dataset_name_is_one_message(tmp_path):
    res = script(tmp_path, DRY_RUN="1", QUICK="1", DATASET="c5")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.count("error:") == 1 and "unknown dataset 'c5'" in res.stderr


def test_failed_step_skips_its_dependents_only(tmp_path):
    """DRY_FAIL: a failed training skips every step of that model; a failed K sweep skips the specter runs
    that read its profile; independent steps still run."""
    steps, out = dry_run(tmp_path, QUICK="1", DRY_FAIL="quick.train-tiny_dsv2 quick.k_sweep-tiny_qwen-low")
    result = dict(steps)
    skipped = {n: r for n, r in result.items() if isinstance(r, str)}
    dsv2 = [n for n in result if "tiny_dsv2" in n and n != "quick.train-tiny_dsv2"]
    assert dsv2 and all(skipped.get(n) == "skipped because quick.train-tiny_dsv2 failed" for n in dsv2)
    assert skipped["quick.bench-verify"] == "skipped because quick.train-tiny_dsv2 failed"
    # a cell holds specter beside the others: it waits for the K profile as a whole
    for n in ("quick.main-tiny_qwen-high", "quick.main-tiny_qwen-low", "quick.batch-tiny_qwen-specter",
              "quick.trace-tiny_qwen"):
        assert skipped[n] == "skipped because quick.k_sweep-tiny_qwen-low failed", n
    for n in ("quick.main-tiny_phi-low", "quick.batch-tiny_qwen-mo_sm",
              "quick.bench-draft-kernel", "quick.figures"):
        assert n not in skipped, n
    assert f"DRY_FAIL: {len(skipped)} step(s) would be skipped" in out


def test_check_prints_plan_data_and_estimate(tmp_path):
    res = script(tmp_path, CHECK="1", QUICK="1")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "datasets: c4 (C4), wikitext2 (WT), humaneval (HE), gsm8k (GK), gpqa (GP)" in out
    total = [line for line in out.splitlines() if line.startswith("total")]
    assert len(total) == 1 and re.search(r"\d+ (min|s)", total[0])
    assert "per-kind constants" in out and "estimate.py" in out
    assert not STEP.search(out)  # a check lists kinds, not commands


@pytest.mark.parametrize("launcher", ["", "slurm"])
def test_moe_spec_shares_specters_k_profile(tmp_path, launcher):
    """MoE-Spec budgets Specter's verification: it runs with the same tier's profiled K (and needs its sweep)."""
    steps, _ = dry_run(tmp_path, LAUNCHER=launcher, METHODS="specter moe_spec offload_ar",
                       ASSETS=str(many_prompts(tmp_path)), DATASET="gsm8k")
    cmds = dict(steps)
    out = tmp_path / "out" / "results"
    if launcher:
        spec = cmds["full.main-tiny-specter"]
        assert "method=specter,moe_spec" in spec and "method=offload_ar" in cmds["full.main-tiny-others"]
        assert any(a.startswith("k_profile=") and "${memory.name}" in a for a in spec)
    else:
        from conftest import compose

        from specter.experiments.cell import method_config

        for tier in ("high", "low"):
            profile = f"k_profile={out}/k_sweep/tiny_qwen-{tier}-emulated/k_profile.json"
            cell = cmds[f"full.main-tiny_qwen-{tier}"]
            assert profile in cell
            cfg = compose(cell[2:])  # the profile reaches specter and moe_spec only (cell.k_profile_methods)
            assert method_config(cfg, "moe_spec").k_profile == profile.split("=", 1)[1]
            assert method_config(cfg, "specter").k_profile == profile.split("=", 1)[1]
            assert method_config(cfg, "offload_ar").k_profile is None
        failed = dict(dry_run(tmp_path, METHODS="specter moe_spec offload_ar", ASSETS=str(tmp_path / "many"),
                              DATASET="gsm8k", DRY_FAIL="full.k_sweep-tiny_qwen-low")[0])
        assert failed["full.main-tiny_qwen-low"] == "skipped because full.k_sweep-tiny_qwen-low failed"
        assert isinstance(failed["full.main-tiny_qwen-high"], list)


def test_bare_clone_runs_on_the_offline_bundle(tmp_path):
    """No assets at all: the datasets the repository bundles (initialization/assets) are what the runs use."""
    from specter.datasets import bundle_manifest

    bundled = [n for n in ("c4", "wikitext2", "humaneval", "gsm8k", "gpqa") if n in bundle_manifest()]
    empty = tmp_path / "empty"
    empty.mkdir()
    steps, out = dry_run(tmp_path, QUICK="1", ASSETS=str(empty), MODELS="tiny_qwen", METHODS="offload_ar")
    line = next(line for line in out.splitlines() if line.startswith("datasets:"))
    for name in bundled:
        assert f"{name} (" in line.split("(not present")[0], (name, line)
    from specter.reproduce.datasets import dataset_overrides

    cmd = _runs(steps)["quick.main-tiny_qwen-high"]
    assert [a for a in cmd if a.startswith("dataset")] == dataset_overrides(tuple(bundled))
