"""Adversarial probes: inputs that used to run silently wrong, mix incompatible records, or end in a
traceback. Each must now be refused with one line (exit status 2; 130/143 for signals) or be
handled exactly, with nothing finished lost.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FIXTURES, REPO, cli_in_process, run_cli
from specter.experiments import run as run_mod

ASSETS = FIXTURES / "datasets"
BASE = ["model=tiny_qwen", "num_prompts=1", "max_new_tokens=2", "warmup_tokens=0", "progress=false",
        f"assets_dir={ASSETS}"]


def one_error(rc: int, out: str, err: str, needle: str, status: int = 2) -> str:
    assert rc == status, (rc, out[-800:], err[-1500:])
    assert "Traceback" not in out + err, err[-1500:]
    errors = [line for line in err.splitlines() if line.startswith("specter: error:")]
    assert len(errors) == 1, err[-1500:]
    assert needle in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def no_model(monkeypatch):
    """The error must come before any method (and so any model) is built."""
    monkeypatch.setattr(run_mod, "build_method", lambda *a, **k: pytest.fail("a model was loaded"))


# -- 1. a method's identity is its registered runner -----------------------------------------------
@pytest.mark.parametrize("method,runner", [
    ("specter", "specter.assembly.methods:TargetOnly"),  # would save target-only records as method=specter
    ("offload_ar", "specter.assembly.methods:Specter"),  # died in a ValueError after the model loaded
])
def test_a_runner_under_another_methods_name_is_refused(method, runner, no_model, tmp_path, capsys):
    rc, out, err = cli_in_process([*BASE, f"method={method}", f"method.runner={runner}",
                                   f"output_dir={tmp_path / 'o'}"], capsys)
    one_error(rc, out, err, f"is not the runner of method '{method}'")
    assert not (tmp_path / "o").exists()


def test_a_new_method_name_may_take_a_registered_runner(monkeypatch, tmp_path):
    from specter.assembly.compose import compose
    from specter.assembly.config import validate

    validate(compose([*BASE, "method=target_only", "method.name=my_target", f"output_dir={tmp_path}"]))


# -- 2. a run folder is one configuration ------------------------------------------------------------
def _finished_run(tmp_path, capsys) -> Path:
    out = tmp_path / "run"
    rc, _, err = cli_in_process([*BASE, "method=target_only", f"output_dir={out}"], capsys)
    assert rc == 0, err[-2000:]
    return out


def test_resume_refuses_a_hand_edited_config(tmp_path, capsys):
    out = _finished_run(tmp_path, capsys)
    cfg = out / "config.yaml"
    cfg.write_text(cfg.read_text().replace("max_new_tokens: 2", "max_new_tokens: 3"))
    records = (out / "records.csv").read_bytes()
    rc, o, err = cli_in_process([*BASE, "method=target_only", "num_prompts=2", "max_new_tokens=3",
                                 f"output_dir={out}"], capsys)
    one_error(rc, o, err, "config.yaml was changed after the run wrote it")
    assert (out / "records.csv").read_bytes() == records  # nothing finished lost, nothing mixed in


@pytest.mark.parametrize("damage", ["half", "edit"])
def test_resume_refuses_a_damaged_or_edited_env_json(damage, tmp_path, capsys):
    out = _finished_run(tmp_path, capsys)
    env = out / "env.json"
    text = env.read_text()
    if damage == "half":
        env.write_text(text[: len(text) // 2])
    else:
        data = json.loads(text)
        data["packages"]["torch"] = "0.0.1"
        env.write_text(json.dumps(data))
    rc, o, err = cli_in_process([*BASE, "method=target_only", "num_prompts=2", f"output_dir={out}"], capsys)
    one_error(rc, o, err, "env.json")


def test_resume_refuses_another_environment_naming_the_keys(tmp_path):
    from specter.assembly.config import ConfigError
    from specter.records.output import check_environment, environment_info

    now = environment_info()
    was = json.loads(json.dumps(now))
    was["python"] = "2.7.0"
    was["packages"]["torch"] = "0.0.1"
    (tmp_path / "env.json").write_text(json.dumps(was))
    with pytest.raises(ConfigError, match=r"differs in: packages\.torch, python"):
        check_environment(tmp_path, 1, now=now)
    check_environment(tmp_path, 0, now=now)  # no finished record: nothing to mix


# -- 3. the schema is closed to additions --------------------------------------------------------------
def test_plus_keys_outside_the_schema_are_refused(no_model, tmp_path, capsys):
    rc, out, err = cli_in_process([*BASE, "+num_prompt=3", "+method.staging_buffer=0",
                                   f"output_dir={tmp_path / 'o'}"], capsys)
    line = one_error(rc, out, err, "unknown setting(s)")
    assert "num_prompt" in line and "method.staging_buffer" in line
    assert not (tmp_path / "o").exists()


def test_plus_keys_the_schema_declares_still_work():
    from specter.assembly.compose import compose
    from specter.assembly.config import unknown_keys

    assert unknown_keys(compose(["+memory.resident_experts=3", "method=specter", "+method.planner.ema=0.5"])) == []
    assert unknown_keys(compose([])) == []


@pytest.mark.parametrize("override", ["hydra.output_subdir={elsewhere}", "hydra.run.dir={elsewhere}",
                                      "hydra.sweep.subdir=x", "hydra.job.chdir=true"])
def test_hydra_output_locations_stay_fixed(override, tmp_path):
    elsewhere = tmp_path / "elsewhere"  # outside the output folder, private to this test
    res = run_cli([*BASE, f"output_dir={tmp_path / 'o'}", override.format(elsewhere=elsewhere)], cwd=tmp_path,
                  timeout=120)
    one_error(res.returncode, res.stdout, res.stderr, "Hydra's output locations are fixed")
    assert not (tmp_path / "o").exists() and not (elsewhere / "config.yaml").exists()


# -- 4. one line, not a traceback ----------------------------------------------------------------------
def test_checkpoint_routing_more_experts_than_it_has(tiny_checkpoint, no_model, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("tiny_qwen"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["num_experts_per_tok"] = 100
    (ckpt / "config.json").write_text(json.dumps(config))
    from specter.assembly.compose import compose
    from specter.assembly.config import ConfigError, bind_checkpoint

    with pytest.raises(ConfigError, match="num_experts_per_tok=100"):
        bind_checkpoint(compose([*BASE, f"output_dir={tmp_path}"]), ckpt)
    rc, out, err = cli_in_process(["model=qwen15moe", "memory=low", f"model.local_dir={ckpt}", *BASE[1:],
                                   f"output_dir={tmp_path / 'o'}"], capsys)
    assert rc == 2 and "Traceback" not in out + err  # refused by whichever check sees it first, in one line
    assert len([ln for ln in err.splitlines() if ln.startswith("specter: error:")]) == 1


def test_output_dir_name_over_255_bytes(no_model, tmp_path, capsys):
    rc, out, err = cli_in_process([*BASE, f"output_dir={tmp_path / ('x' * 300)}"], capsys)
    one_error(rc, out, err, "at most 255")


def test_specter_home_pointing_at_a_file(no_model, tmp_path, capsys, monkeypatch):
    home = tmp_path / "home"
    home.write_text("not a folder")
    monkeypatch.setenv("SPECTER_HOME", str(home))
    rc, out, err = cli_in_process([*BASE, f"output_dir={tmp_path / 'o'}"], capsys)
    one_error(rc, out, err, "is a file, not a folder")
    monkeypatch.setenv("SPECTER_HOME", str(home / "below"))
    rc, out, err = cli_in_process([*BASE, f"output_dir={tmp_path / 'o'}"], capsys)
    one_error(rc, out, err, "which is a file, not a folder")


def _signal_once_started(args: list[str], sig: int, started: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run `python run.py args`, send `sig` once `started` exists (the run folder is open)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    # A shell runs a background job (`pytest ... &`, as CI scripts may) with SIGINT ignored, and a child
    # inherits that: Python then keeps Ctrl-C ignored, as a user who started it so intended. The run is
    # started with SIGINT at its default, so Python turns it into KeyboardInterrupt whoever runs the test.
    proc = subprocess.Popen([sys.executable, str(REPO / "run.py"), *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("sig,status,multirun", [(signal.SIGINT, 130, True), (signal.SIGTERM, 143, False),
                                                 (signal.SIGTERM, 143, True)])
def test_signals_end_in_one_line(sig, status, multirun, tmp_path):
    out = tmp_path / "o"
    args = [*BASE, "method=target_only", "num_prompts=1", "max_new_tokens=256", "warmup_tokens=64",
            f"output_dir={out}"]
    res = _signal_once_started(["-m", *args] if multirun else args, sig, out / "config.yaml", tmp_path)
    assert res.returncode == status, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stdout + res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == ("specter: interrupted; finished records are kept "
                                                  "(rerun the same command to resume)")


# -- 6. quiet wrong answers ------------------------------------------------------------------------------
@pytest.mark.parametrize("override,needle", [
    ("temperature=inf", "temperature must be a finite number"),
    ("temperature=nan", "temperature must be a finite number"),
    ("top_p=nan", "top_p must be in (0, 1]"),
    ("top_p=inf", "top_p must be in (0, 1]"),
    (f"seed={2**70}", "seed must be below 2**31"),
    (f"seed={2**31}", "seed must be below 2**31"),
    ("model.num_experts=10", "model.num_experts=10 (the checkpoint has"),
    ("hardware.device=0", "hardware.device must be cpu, cuda"),  # found by tests/test_fuzz_cli.py
])
def test_quiet_wrong_answers_are_refused(override, needle, no_model, tmp_path, capsys):
    rc, out, err = cli_in_process([*BASE, override, f"output_dir={tmp_path / 'o'}"], capsys)
    one_error(rc, out, err, needle)


def test_the_largest_seed_is_taken_exactly(tmp_path):
    from specter.assembly.compose import compose
    from specter.assembly.config import validate

    validate(compose([*BASE, f"seed={2**31 - 1}", f"output_dir={tmp_path}"]))
    assert len({run_mod.record_seed(b, "gsm8k", 0, 0) for b in range(0, 2**31, 2**27)}) == 16  # distinct bases


def test_an_empty_method_list_is_refused(tmp_path, capsys, monkeypatch):
    from specter.experiments import compare

    monkeypatch.setattr(compare, "run", lambda cfg: pytest.fail("a method ran"), raising=False)
    rc, out, err = cli_in_process(["experiment=compare", "compare.methods=[]", *BASE[1:],
                                   f"output_dir={tmp_path / 'o'}"], capsys)
    one_error(rc, out, err, "compare.methods must list at least one method")


def test_a_budget_that_does_not_fit_prints_only_its_error(tmp_path):
    res = run_cli([*BASE, "method=offload_ar", "memory.budget_mb=1", f"output_dir={tmp_path / 'o'}"], timeout=300)
    one_error(res.returncode, res.stdout, res.stderr, "budget")
    assert res.stderr.strip().count("\n") == 0, res.stderr  # one line, no third-party noise before it


@pytest.mark.parametrize("verbose", [False, True])
def test_transformers_load_lines_only_when_verbose(verbose, tmp_path):
    args = [*BASE, "method=target_only", f"output_dir={tmp_path / 'o'}", *(["verbose=true"] if verbose else [])]
    res = run_cli(args, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    text = res.stdout + res.stderr
    if not verbose:
        for noise in ("TP rules were not applied", "were not sharded", "Loading weights"):
            assert noise not in text, (noise, text[-3000:])
    else:  # nothing hidden (the TP-rule check itself only runs at transformers' own warning level)
        assert "Loading weights" in text, text[-3000:]
