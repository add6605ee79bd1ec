"""Every bad input gives one line on stderr, exit status 2, no traceback — before any model loads
wherever the value is known without the model.

The table runs `specter.experiments.run.main` (what `python run.py` calls) in-process for speed; a
few cases run `run.py` in a subprocess to check the real command line end to end.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import FIXTURES, cli_in_process, run_cli
from specter.experiments import cli as cli_mod
from specter.experiments import run as run_mod

ASSETS = FIXTURES / "datasets"
BASE = ["num_prompts=1", "max_new_tokens=2", "warmup_tokens=0", "progress=false", f"assets_dir={ASSETS}"]


def _gsm8k(tmp: Path, lines: list[str]) -> Path:
    root = tmp / "assets"
    (root / "gsm8k").mkdir(parents=True, exist_ok=True)
    (root / "gsm8k" / "test.jsonl").write_text("".join(line + "\n" for line in lines))
    return root


def _k_profile(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


# (id, overrides, text the one error line must contain, the model must not load)
CASES = [
    # values the typed schema rejects at composition
    ("temperature", ["temperature=abc"], "temperature", True),
    ("top_p", ["top_p=abc"], "top_p", True),
    ("top_k", ["top_k=abc"], "top_k", True),
    ("budget_type", ["memory.budget_mb=abc"], "budget_mb", True),
    ("resident_type", ["+memory.resident_experts=abc"], "resident_experts", True),
    ("unknown_key", ["foo=1"], "foo", True),
    ("override_syntax", ["temperature"], "temperature", True),
    ("unknown_group_option", ["model=nope"], "Could not find 'model/nope'", True),
    # values validate() rejects
    ("dtype", ["hardware.dtype=bogus"], "hardware.dtype", True),
    ("threads", ["hardware.threads=-1"], "hardware.threads", True),
    ("bandwidth", ["hardware=emulated", "hardware.bandwidth_gbps=-1"], "bandwidth_gbps", True),
    ("load_ratio", ["model.load_ratio=0"], "load_ratio", True),
    ("calibration_prompts", ["method=specter", "method.calibration_prompts=0"], "calibration_prompts", True),
    ("quant", ["method=specter", "method.quant=bogus"], "method.quant", True),
    ("schedule_specter", ["method=specter", "method.schedule=bogus"], "method.schedule", True),
    ("schedule_offload", ["method=offload_ar", "method.schedule=bogus"], "method.schedule", True),
    ("budget_negative", ["method=offload_ar", "memory.budget_mb=-5"], "memory.budget_mb", True),
    ("budget_target_only", ["method=target_only", "memory.budget_mb=100"], "target_only", True),
    ("num_prompts", ["num_prompts=-1"], "num_prompts", True),
    ("K", ["K=0"], "K must be", True),
    ("prefix", ["prefix_tokens=100000"], "context", True),
    ("resident_zero", ["+memory.resident_experts=0"], "no expert slot", True),
    ("lossless_sampling", ["verify_lossless=true", "temperature=0.5"], "temperature=0", True),
    ("experiment", ["experiment=nope"], "experiment", True),
    ("dataset_name", ["dataset.name=nope"], "dataset.name", True),
    # k_profile files
    ("k_profile_missing", ["method=specter", "k_profile={tmp}/none.json"], "does not exist", True),
    ("k_profile_no_K", ["method=specter", "k_profile={kp_noK}"], "no usable K", True),
    ("k_profile_list", ["method=specter", "k_profile={kp_list}"], "holds a list", True),
    ("k_profile_json", ["method=specter", "k_profile={kp_bad}"], "not valid JSON", True),
    ("k_profile_model", ["method=specter", "k_profile={kp_other}"], "measured for", True),
    # datasets
    ("dataset_empty_file", ["dataset=gsm8k", "assets_dir={empty}"], "holds only 0", True),
    ("dataset_too_few", ["dataset=gsm8k", "num_prompts=5", f"assets_dir={ASSETS}"], "5 were asked for", True),
    ("dataset_blank_only", ["dataset=gsm8k", "assets_dir={blank}"], "holds only 0", True),
    ("dataset_bad_json", ["dataset=gsm8k", "assets_dir={badjson}"], "line 1 is not valid JSON", True),
    ("dataset_missing", ["dataset=gpqa", "assets_dir=/nonexistent", "allow_hub=false"], "gpqa_main.csv", True),
    ("humaneval_500", ["dataset=humaneval", "num_prompts=500", "assets_dir=/nonexistent", "allow_hub=false"],
     "164", True),
    # output folders
    ("output_parent_is_file", ["output_dir={afile}/run"], "not a folder", True),
    ("output_is_file", ["output_dir={afile}"], "is a file", True),
    ("output_foreign_folder", ["output_dir={foreign}"], "holds no Specter run", True),
    # real weights that are not here
    ("missing_weights", ["model=dsv2", "memory=low"], "initialization.download_models", True),
    # names that would become paths outside the folder, code from the config (issue 21, item 4)
    ("model_name_escape", ["model.name=../../x"], "model.name='../../x' cannot be used", True),
    ("method_name_escape", ["method.name=../../x"], "method.name='../../x' cannot be used", True),
    ("compare_methods_escape", ["experiment=compare", "compare.methods=[../hardware/cpu]"],
     "compare.methods entry='../hardware/cpu'", True),
    ("runner_any_callable", ["method.runner=os:system"], "unknown runner 'os:system'", True),
    # checkpoints that cannot run as the configured model (items 5 and 9)
    ("truncated_safetensors", ["model=dsv2", "memory=low", "model.local_dir={trunc}"], "truncated or corrupt", True),
    ("corrupt_safetensors", ["model=dsv2", "memory=low", "model.local_dir={corrupt}"],
     "cannot be read as safetensors", True),
    ("non_moe_offloading", ["model=dsv2", "memory=low", "method=offload_ar", "model.local_dir={llama}"],
     "'llama' model", True),
    ("llama_as_dsv2", ["model=dsv2", "memory=low", "method=target_only", "model.local_dir={llama}"],
     "not dsv2's architecture", True),
    ("qwen_as_dsv2", ["model=dsv2", "memory=low", "model.local_dir={qwen}"], "'qwen2_moe' model", True),
    # method settings out of range (items 5 and 9)
    ("planner_unknown_key", ["method=specter", "+method.planner.foo=1"], "unknown method.planner key", True),
    ("planner_value", ["method=specter", "+method.planner.ema=0"], "method.planner", True),
    ("llamacpp_n_batch", ["method=llamacpp", "method.n_batch=0"], "method.n_batch", True),
    ("llamacpp_n_threads", ["method=llamacpp", "method.n_threads=-3"], "method.n_threads", True),
    ("transformers_experts_impl", ["method=transformers", "method.experts_implementation=bogus"],
     "method.experts_implementation", True),
    ("tie_tolerance", ["lossless_tie_tolerance=-1"], "lossless_tie_tolerance", True),
    ("staging_per_layer", ["method=specter", "method.staging_per_layer=-1"], "method.staging_per_layer", True),
    ("specmoeoff_residents", ["method=specmoeoff_artifact", "method.residents.high=0"], "method.residents.high", True),
]


def _checkpoint(folder: Path, model_type: str, cut: int = 0, garbage: bool = False) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    weights = folder / "model.safetensors"
    save_file({"w": torch.zeros(256)}, str(weights))
    if cut:
        weights.write_bytes(weights.read_bytes()[:-cut])
    if garbage:
        weights.write_bytes(b"\xff" * 64)
    return folder


@pytest.fixture
def files(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    return {
        "tmp": tmp_path,
        "kp_noK": _k_profile(tmp_path / "kp_noK.json", {"model": "tiny_qwen"}),
        "kp_list": _k_profile(tmp_path / "kp_list.json", [8]),
        "kp_other": _k_profile(tmp_path / "kp_other.json", {"model": "tiny_phi", "K": 4}),
        "kp_bad": tmp_path / "bad.json",
        "empty": _gsm8k(tmp_path / "e", []),
        "blank": _gsm8k(tmp_path / "bl", ['{"question": "   "}', '{"question": ""}']),
        "badjson": _gsm8k(tmp_path / "bj", ['{"question": "unterminated']),
        "afile": afile,
        "foreign": foreign,
        "trunc": _checkpoint(tmp_path / "trunc", "deepseek_v2", cut=100),
        "corrupt": _checkpoint(tmp_path / "corrupt", "deepseek_v2", garbage=True),
        "llama": _checkpoint(tmp_path / "llama", "llama"),
        "qwen": _checkpoint(tmp_path / "qwen", "qwen2_moe"),
    }


cli = cli_in_process


def assert_one_line_error(rc: int, out: str, err: str, needle: str) -> str:
    assert rc == 2, (rc, out[-1000:], err[-2000:])
    assert "Traceback" not in out + err
    errors = [line for line in err.splitlines() if line.startswith("specter: error:")]
    assert len(errors) == 1, err[-2000:]
    assert needle in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(case, files, capsys, monkeypatch, tmp_path):
    _, overrides, needle, early = case
    (tmp_path / "bad.json").write_text('{"model": "tiny_qwen", "K":')
    overrides = [o.format(**files) for o in overrides]
    if early:  # the error must come before any method (and so any model) is built
        monkeypatch.setattr(run_mod, "build_method", lambda *a, **k: pytest.fail("a model was loaded"))
    out_dir = tmp_path / "out"
    args = [*BASE, f"output_dir={out_dir}", *overrides]
    rc, out, err = cli(args, capsys)
    assert_one_line_error(rc, out, err, needle)
    assert not (out_dir / "records.csv").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_gpu_before_anything_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_mod, "model_checkpoint", lambda *a, **k: pytest.fail("checkpoint resolved"))
    rc, out, err = cli([*BASE, "hardware=cuda", f"output_dir={tmp_path / 'o'}"], capsys)
    assert_one_line_error(rc, out, err, "CUDA")
    assert not (tmp_path / "o").exists()


@pytest.fixture
def calibration_home(tmp_path, monkeypatch, tiny_checkpoint):
    """Calibration files go to a private folder; returns the file this run will read."""
    from specter.assembly import runtime
    from specter.models.registry import checkpoint_digest

    monkeypatch.setattr(runtime, "specter_home", lambda: tmp_path / "home")
    digest = checkpoint_digest(tiny_checkpoint("tiny_qwen"))
    path = tmp_path / "home" / "calibration" / f"tiny_qwen-{digest[:12]}-float32-t1.json"
    path.parent.mkdir(parents=True)
    return path


EMULATED = ["method=offload_ar", "hardware=emulated", "hardware.threads=1", "hardware.recalibrate=false"]  # the cached step


@pytest.mark.parametrize("content,needle", [
    ('{"per_layer_step_s": 0.0', "hardware.recalibrate=true"),  # truncated
    ("", "hardware.recalibrate=true"),  # empty
    ('{"measured": "yesterday"}', "hardware.recalibrate=true"),  # keyless
    ("[1, 2]", "hardware.recalibrate=true"),  # not an object
    ('{"per_layer_step_s": 1000}', "not a plausible step time"),  # 1000 s per step
    ('{"per_layer_step_s": 9.0}', "one expert load would take"),  # 0.7 x 9 s per load: bounded
])
def test_bad_calibration_file_is_one_line_naming_it(content, needle, calibration_home, capsys, tmp_path):
    calibration_home.write_text(content)
    rc, out, err = cli([*BASE, *EMULATED, f"output_dir={tmp_path / 'o'}"], capsys)
    line = assert_one_line_error(rc, out, err, needle)
    assert str(calibration_home) in line and "hardware.recalibrate=true" in line


def test_recalibrate_fixes_a_corrupt_calibration_in_the_same_folder(calibration_home, capsys, tmp_path):
    """A failed start (corrupt calibration) does not lock the folder; hardware.recalibrate=true is accepted."""
    calibration_home.write_text("{")
    args = [*BASE, *EMULATED, f"output_dir={tmp_path / 'o'}"]
    assert cli(args, capsys)[0] == 2
    rc, out, err = cli([*args, "hardware.recalibrate=true"], capsys)
    assert rc == 0, err[-2000:]
    assert json.loads(calibration_home.read_text())["per_layer_step_s"] > 0


def test_budget_error_at_high_does_not_suggest_high(capsys, tmp_path):
    rc, out, err = cli([*BASE, "method=offload_ar", "memory=high", "memory.budget_mb=0.5",
                        f"output_dir={tmp_path / 'o'}"], capsys)
    line = assert_one_line_error(rc, out, err, "budget")
    assert "memory=high)" not in line and "memory.resident_experts" in line


def test_malformed_dataset_is_an_error_for_gptq_calibration(tmp_path, capsys):
    """The evaluated prompts read fine; the calibration prompts after them hit a broken line: an error,
    never a silent fallback to the evaluated prompts."""
    assets = _gsm8k(tmp_path, ['{"question": "What is two plus two, in words?"}', '{"question": "unterminated'])
    rc, out, err = cli([*BASE, "method=specter", "method.quant=gptq", "model=tiny_qwen", "dataset=gsm8k",
                        f"assets_dir={assets}", f"output_dir={tmp_path / 'o'}"], capsys)
    assert_one_line_error(rc, out, err, "line 2 is not valid JSON")
    assert not (tmp_path / "o").exists()  # raised while building the draft; a refused start leaves no run behind


def _ro_mount(path: Path) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        return False
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], capture_output=True)
    if ok.returncode != 0:
        return False
    subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True, check=True)
    return True


def test_read_only_output_folder(tmp_path, capsys):
    ro = tmp_path / "ro"
    mounted = _ro_mount(ro)
    if not mounted:
        import os

        if os.geteuid() == 0:
            pytest.skip("cannot mount a read-only tmpfs, and root ignores file modes")
        ro.chmod(0o555)
    try:
        for target in (ro, ro / "run"):
            rc, out, err = cli([*BASE, f"output_dir={target}"], capsys)
            assert_one_line_error(rc, out, err, "cannot use output_dir")
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=True)


@pytest.mark.parametrize("args,needle", [
    (["temperature=abc"], "temperature"),
    (["hardware.dtype=bogus"], "hardware.dtype"),
    (["model=nope"], "Could not find 'model/nope'"),
])
def test_command_line_prints_one_line(args, needle, tmp_path):
    res = run_cli([*args, f"output_dir={tmp_path / 'o'}", "progress=false"], cwd=tmp_path)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr + res.stdout and "HYDRA_FULL_ERROR" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("specter: error:") and needle in lines[0], res.stderr


def test_multirun_refuses_an_unknown_experiment(tmp_path):
    """`-m` goes through Hydra's launcher, which skips a missing optional group (issue 21, item 6)."""
    res = run_cli(["-m", "experiment=bogus", f"output_dir={tmp_path / 'o'}", "progress=false"], cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr + res.stdout
    lines = [line for line in res.stderr.splitlines() if line.startswith("specter: error:")]
    assert len(lines) == 1 and "unknown experiment='bogus'" in lines[0], res.stderr
    assert not (tmp_path / "o").exists()


def test_optional_group_sweeps_are_checked_per_option():
    from specter.assembly.compose import check_optional_groups
    from specter.assembly.config import ConfigError

    check_optional_groups(["experiment=main,batch"])
    with pytest.raises(ConfigError, match="unknown experiment='bogus'"):
        check_optional_groups(["experiment=main,bogus"])


def _enospc(*args, **kwargs):
    raise OSError(28, "No space left on device", "/home/specter/models/tiny_qwen.partial/model.safetensors")


@pytest.mark.parametrize("where", ["model", "calibration", "draft"])
def test_disk_full_under_specter_home_is_one_line(where, capsys, monkeypatch, tmp_path, tiny_checkpoint):
    """A full disk while building the model, the link calibration or the draft (issue 21, item 5)."""
    from specter.assembly import methods
    from specter.assembly import runtime

    args = [*BASE, f"output_dir={tmp_path / 'o'}"]
    if where == "model":
        monkeypatch.setattr(run_mod, "model_checkpoint", _enospc)
    else:
        tiny_checkpoint("tiny_qwen")
        args += ["model=tiny_qwen"]
        if where == "calibration":
            monkeypatch.setattr(runtime, "calibrated_link", _enospc)
            args += ["method=offload_ar", "hardware=emulated", "hardware.recalibrate=true"]
        else:
            monkeypatch.setattr(methods, "gptq_draft_for", _enospc)
            args += ["method=specter", "method.quant=gptq"]
    rc, out, err = cli(args, capsys)
    line = assert_one_line_error(rc, out, err, "No space left on device")
    assert "tiny_qwen.partial" in line and "rerun the same command" in line


def _vllm_cfg(python):
    from omegaconf import OmegaConf

    return OmegaConf.create({"method": {"python": str(python)}})


@pytest.mark.parametrize("kind,needle", [
    ("file", "not an executable file"),
    ("folder", "not an executable file"),
    ("true", "not a Python interpreter"),
    ("python_without_vllm", "has no vllm package"),
])
def test_vllm_python_that_cannot_run_vllm(kind, needle, tmp_path):
    """method.python pointing at a file, a folder, /bin/true or an interpreter without vLLM: one clear
    error at once, never "did not answer in 900 s" (issue 21, item 5)."""
    import importlib.util
    import sys

    from baselines.common import EngineUnavailable
    from baselines.vllm_engine import vllm_python

    if kind == "python_without_vllm" and importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter has vllm")
    target = {"file": tmp_path / "notes.txt", "folder": tmp_path, "true": Path(shutil.which("true") or "/bin/true"),
              "python_without_vllm": Path(sys.executable)}[kind]
    if kind == "file":
        target.write_text("x")
    with pytest.raises(EngineUnavailable, match=needle):
        vllm_python(_vllm_cfg(target))
