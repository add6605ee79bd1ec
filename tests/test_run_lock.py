"""One writer per run folder, and a start that failed does not lock a folder to its mistake."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest

from conftest import REPO, run_cli
from specter.experiments import cli
from specter.records.records import KEY_COLUMNS

RUN = ["method=target_only", "model=tiny_qwen", "dataset=humaneval", "num_prompts=3", "max_new_tokens=4",
       "warmup_tokens=0", "progress=false", "assets_dir=/nonexistent", "allow_hub=false"]

HOLDER = """
import sys, time
from specter.assembly.compose import compose
from specter.records.output import run_folder
with run_folder(compose(sys.argv[1:])):
    print("locked", flush=True)
    time.sleep(120)
"""


def error_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("specter: error:")]


def test_second_writer_is_refused_with_the_holders_pid(tmp_path, capsys, tiny_checkpoint):
    tiny_checkpoint("tiny_qwen")
    args = [*RUN, f"output_dir={tmp_path / 'run'}"]
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, *args], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert cli.main(args) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        (line,) = error_lines(err)
        assert f"in use by another run (pid {holder.pid})" in line
    finally:
        holder.kill()  # like kill -9: the lock dies with its process
        holder.wait()
    assert cli.main(args) == 0
    assert len(pd.read_csv(tmp_path / "run" / "records.csv")) == 3


def test_two_identical_runs_never_write_a_key_twice(tmp_path, tiny_checkpoint):
    tiny_checkpoint("tiny_qwen")
    args = [*RUN, "num_prompts=4", "max_new_tokens=24", f"output_dir={tmp_path / 'run'}"]
    env_cmd = [sys.executable, str(REPO / "run.py"), *args]
    procs = [subprocess.Popen(env_cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=600), p.stdout.read(), p.stderr.read()) for p in procs]
    for rc, out, err in results:
        assert "Traceback" not in err
        assert rc == 0 or (rc == 2 and "in use by another run (pid" in err), err[-2000:]
    assert any(rc == 0 for rc, _, _ in results)
    df = pd.read_csv(tmp_path / "run" / "records.csv")
    assert len(df) == 4 and not df.duplicated(list(KEY_COLUMNS)).any()


def test_failed_start_accepts_a_corrected_configuration(tmp_path, capsys, tiny_checkpoint):
    """A budget refusal leaves nothing that looks like a run; the corrected command runs in that folder."""
    tiny_checkpoint("tiny_qwen")
    out = tmp_path / "run"
    base = [*RUN, "method=offload_ar", f"output_dir={out}"]
    assert cli.main([*base, "memory.budget_mb=0.5"]) == 2
    assert not (out / "config.yaml").exists() and not (out / "records.csv").exists()
    capsys.readouterr()
    assert cli.main(base) == 0
    records = pd.read_csv(out / "records.csv")
    assert len(records) == 3 and (records.schedule == "expert").all()  # the schedule that ran is recorded
    # once a record is finished, a different configuration is refused again
    assert cli.main([*base, "max_new_tokens=5"]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "different configuration" in line and "max_new_tokens" in line


def test_missing_weights_never_create_the_folder(tmp_path):
    res = run_cli(["model=dsv2", "memory=low", f"output_dir={tmp_path / 'o'}"], cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "initialization.download_models" in res.stderr and "tiny_dsv2" in res.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("volatile", ["progress=true", "hardware.recalibrate=true"])
def test_volatile_keys_resume(tmp_path, capsys, volatile, tiny_checkpoint):
    tiny_checkpoint("tiny_qwen")
    args = [*RUN, "num_prompts=1", f"output_dir={tmp_path / 'run'}"]
    assert cli.main(args) == 0
    assert cli.main([*args, volatile]) == 0
    assert "nothing to run" in capsys.readouterr().out


def test_lock_file_is_not_a_foreign_file(tmp_path, capsys, tiny_checkpoint):
    """A folder holding only a lock file left by a run killed before writing config.yaml is usable."""
    tiny_checkpoint("tiny_qwen")
    out = tmp_path / "run"
    out.mkdir()
    (out / ".specter.lock").write_text("12345\n")
    assert cli.main([*RUN, "num_prompts=1", f"output_dir={out}"]) == 0
