"""specter.reproduce's runner: a step is done by its outputs (not its marker alone), dependents of a
failed step are skipped, TERM stops the running step's whole process group, and the summary reads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from specter.reproduce.datasets import DatasetDecision
from specter.reproduce.execute import DONE, FAILED, INTERRUPTED, NOT_RUN, REPRODUCED, SKIPPED, Runner, error_lines
from specter.reproduce.plan import Check, Step
from specter.reproduce.report import figure_lines, summary

REPO = Path(__file__).resolve().parents[1]


def writer(name: str, out: Path, rows: int = 1, rc: int = 0, **kw) -> Step:
    code = f"import sys; open({str(out)!r}, 'w').write('a,b\\n' + '1,2\\n' * {rows}); sys.exit({rc})"
    return Step(name=name, kind="bench", argv=(sys.executable, "-c", code), checks=(Check("csv", out),), **kw)


def test_done_by_outputs_not_marker(tmp_path):
    logs, out = tmp_path / "logs", tmp_path / "res" / "bench.csv"
    logs.mkdir()
    out.parent.mkdir()
    step = writer("quick.bench-x", out)
    first = Runner(logs, say=lambda _: None).run_step(step, 1, 1)
    assert first.status == REPRODUCED and (logs / "quick.bench-x.done").read_text().strip() == step.command
    assert Runner(logs, say=lambda _: None).run_step(step, 1, 1).status == DONE
    out.unlink()  # the result deleted, the marker kept: the step runs again
    again = Runner(logs, say=lambda _: None).run_step(step, 1, 1)
    assert again.status == REPRODUCED and out.exists()
    out.write_text("a,b\n1,2,3\n")  # a torn row: not valid
    assert Runner(logs, say=lambda _: None).done_earlier(step) is None


def test_exit_zero_without_outputs_fails(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    step = Step(name="quick.bench-y", kind="bench", argv=(sys.executable, "-c", "pass"),
                checks=(Check("csv", tmp_path / "never.csv"),))
    got = Runner(logs, say=lambda _: None).run_step(step, 1, 1)
    assert got.status == FAILED and "never.csv is missing" in got.why
    assert not (logs / "quick.bench-y.done").exists()


def test_dependents_of_a_failed_step_are_skipped_with_its_name(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    bad = Step(name="quick.k_sweep-m-low", kind="k_sweep",
               argv=(sys.executable, "-c", "import sys; print('specter: error: dataset x; tried: a; b', "
                     "file=sys.stderr); sys.exit(2)"))
    child = writer("quick.main-m-low-specter", tmp_path / "a.csv", needs=(bad.name,))
    grandchild = writer("quick.trace-m", tmp_path / "b.csv", needs=(child.name,))
    other = writer("quick.main-m-low-offload_ar", tmp_path / "c.csv")
    runner = Runner(logs, say=lambda _: None)
    got = runner.run_all([bad, child, grandchild, other])
    assert [o.status for o in got] == [FAILED, SKIPPED, SKIPPED, REPRODUCED]
    assert got[1].why == got[2].why == "because quick.k_sweep-m-low failed"
    assert got[0].detail == ["specter: error: dataset x", "  tried: a", "  b"]  # unfolded, not one '; ' line
    assert not (tmp_path / "a.csv").exists()
    data = DatasetDecision(("c4", "gsm8k"), ("gsm8k",), ("gsm8k",), {"c4": "absent"})
    lines = summary(got, data, "quick", 12.0, tmp_path / "res", tmp_path / "figs", logs)
    text = "\n".join(lines)
    assert "datasets: gsm8k (GK) (not present: c4 (C4))" in text
    assert "skipped (because quick.k_sweep-m-low failed)" in text
    assert text.count("specter: error: dataset x") == 1  # each error once
    assert "figures were not drawn" in text


def test_error_lines_keeps_consecutive_errors(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("$ cmd\n\nsome progress\nFAILED c4 (C4): missing\nFAILED gpqa (GP): missing\n"
                   "2 of 5 datasets not ready: c4, gpqa\n")
    assert error_lines(log) == ["FAILED c4 (C4): missing", "FAILED gpqa (GP): missing"]


def test_figure_lines_say_what_came_from_this_run(tmp_path):
    from specter.reproduce.execute import Outcome

    figs = tmp_path / "figs"
    figs.mkdir()
    (figs / "index.md").write_text("# Figures\n\n| figure | status | files |\n|---|---|---|\n"
                                   "| Fig. 14 TPOT grid | written | fig14_tpot |\n"
                                   "| Figs. 15/16 + Table 3 batching | skipped: no batch.csv | |\n")
    fig = Step(name="quick.figures", kind="figures", argv=("true",))
    batch = Step(name="quick.batch-m-specter", kind="batch", argv=("true",))
    outcomes = [Outcome(batch, SKIPPED, why="because quick.k_sweep-m-high failed"), Outcome(fig, REPRODUCED, 3.0)]
    lines = figure_lines(outcomes, figs, tmp_path / "res")
    assert lines[0].startswith("Fig. 14 TPOT grid: drawn from this run's results")
    assert "NOT drawn from this run (skipped: no batch.csv; its steps did not finish: quick.batch-m-specter)" in lines[1]
    assert "results/reference" in lines[1]


RUNNER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from specter.reproduce.execute import Runner
    from specter.reproduce.plan import Check, Step
    logs, pidfile = Path(sys.argv[1]), sys.argv[2]
    child = ("import os, subprocess, sys, time; "
             "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
             f"open({pidfile!r}, 'w').write(f'{{os.getpid()}} {{g.pid}}'); time.sleep(120)")
    long = Step(name="quick.main-slow", kind="main", argv=(sys.executable, "-c", child),
                checks=(Check("csv", logs / "never.csv"),))
    after = Step(name="quick.figures", kind="figures", argv=(sys.executable, "-c", "pass"))
    runner = Runner(logs)
    runner.install_signals()
    got = runner.run_all([long, after])
    print("STATUS", *[o.status for o in got], flush=True)
    sys.exit(128 + runner.signum if runner.signum else 0)
""")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_term_stops_the_running_step_and_its_children(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    pidfile = tmp_path / "pids"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(logs), str(pidfile)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and len(pidfile.read_text().split()) == 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    step_pid, grandchild = map(int, pidfile.read_text().split())
    assert _alive(step_pid) and _alive(grandchild)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert f"STATUS {INTERRUPTED} {NOT_RUN}" in out
    deadline = time.monotonic() + 5
    while (_alive(step_pid) or _alive(grandchild)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(step_pid) and not _alive(grandchild)  # nothing orphaned to hold a run folder's lock
    assert not (logs / "quick.main-slow.done").exists()


FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for python: reproduce_all itself runs for real; each step only logs and exits
if [[ "$1 $2" == "-m specter.reproduce" ]]; then exec {python} "$@"; fi
echo "$*" >> {calls}
case "$*" in
  *initialization.prepare_datasets*) echo "FAILED c4 (C4): missing" >&2; exit 1 ;;
  *initialization.train_tiny*) echo "error: training diverged; loss nan" >&2; exit 3 ;;
esac
exit 0
"""


def test_script_end_to_end_with_stand_in_steps(tmp_path):
    """The live path: the dataset check first and narrowing, a failed training skipping its model's steps,
    an exit-0 step without outputs failing, and the summary table written beside the results."""
    import shutil

    assets = tmp_path / "assets"
    shutil.copytree(REPO / "tests" / "fixtures" / "datasets" / "gsm8k", assets / "gsm8k")
    fake = tmp_path / "python"
    calls = tmp_path / "calls"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable, calls=calls))
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=str(fake), PYTHONPATH=str(REPO), QUICK="1", MODELS="tiny_qwen", TIERS="low",
               METHODS="offload_ar", DATASET="c4,gsm8k", ASSETS=str(assets), SPECTER_HOME=str(tmp_path / "home"),
               RESULTS=str(out / "results"), FIGURES=str(out / "figures"), LOGS=str(out / "logs"))
    for var in ("DRY_RUN", "CHECK", "FORCE", "DRY_FAIL", "BATCH_MODELS", "BATCH_METHODS"):
        env.pop(var, None)
    res = subprocess.run(["bash", str(REPO / "scripts" / "reproduce_all.sh")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    text = res.stdout
    assert text.count("datasets: gsm8k (GK) (not present: c4 (C4))") == 2  # at the start and in the summary
    ran = calls.read_text().splitlines()
    assert ran[0].startswith("-m initialization.prepare_datasets --datasets c4,gsm8k")
    assert not [c for c in ran if "run.py" in c]  # every run needs the failed training: none was started
    summary = (out / "results" / "reproduce_summary.md").read_text()
    for line in ("quick.datasets", "reproduced (narrowed to gsm8k)",
                 "quick.train-tiny_qwen", "failed (exit 3: error E1 below)",
                 "quick.main-tiny_qwen-low", "skipped (because quick.train-tiny_qwen failed)",
                 "quick.bench-draft-kernel", "draft_kernel.csv is missing",
                 "E1: quick.train-tiny_qwen", "    error: training diverged", "    loss nan"):
        assert line in summary, line
    assert (out / "logs" / "quick.train-tiny_qwen.log").read_text().startswith("$ ")
    assert not (out / "logs" / "quick.train-tiny_qwen.done").exists()


def test_run_folder_of_other_datasets_is_set_aside_not_reused(tmp_path):
    """After the datasets change (e.g. more were added), a run folder made for the old choice is moved aside
    (the harness refuses to resume under a changed config) and the step runs afresh; nothing is deleted."""
    from specter.reproduce.outputs import set_aside_other_datasets

    folder = tmp_path / "main" / "tiny_qwen-offload_ar-low"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("dataset:\n  name: humaneval\nnum_prompts: 1\nrepeats: 1\n")
    (folder / "records.csv").write_text("kept\n")
    step = Step(name="quick.main-tiny_qwen-low-offload_ar", kind="main", argv=("true",),
                checks=(Check("run", folder, ("c4", "humaneval")),))
    moved = set_aside_other_datasets(step, "T")
    assert len(moved) == 1 and "measured humaneval, not c4, humaneval" in moved[0]
    assert not folder.exists()
    assert (tmp_path / "main" / "tiny_qwen-offload_ar-low.humaneval-T" / "records.csv").read_text() == "kept\n"
    folder.mkdir()
    (folder / "config.yaml").write_text("dataset:\n  name: all\nnum_prompts: 1\nrepeats: 1\n")
    same = Step(name=step.name, kind="main", argv=("true",),
                checks=(Check("run", folder, ("c4", "wikitext2", "humaneval", "gsm8k", "gpqa")),))
    assert set_aside_other_datasets(same, "T") == [] and folder.exists()


def test_run_folder_counts_only_valid_records(tmp_path):
    """A reference run folder is done; with its last record torn it is not (and the step would run again)."""
    import shutil

    from specter.reproduce.outputs import check_problem

    import pandas as pd

    folder = tmp_path / "run"
    shutil.copytree(REPO / "results" / "reference" / "main" / "tiny_dsv2-specter-high", folder)
    records = pd.read_csv(folder / "records.csv")
    datasets = tuple(records.dataset.unique())  # as the reference run was given them
    check = Check("run", folder, datasets)
    assert check_problem(check) is None
    assert f"ran {', '.join(datasets)}, not c4" in check_problem(Check("run", folder, ("c4",)))
    text = (folder / "records.csv").read_text()
    (folder / "records.csv").write_text(text[: len(text) - 40])  # the last row torn
    assert check_problem(check) == f"{folder}/records.csv holds {len(records) - 1} of {len(records)} records"
    shutil.rmtree(folder)
    assert check_problem(check) == f"{folder} is missing"


def test_estimate_prefers_this_machine_then_the_reference_then_the_model():
    from specter.reproduce.estimate import estimate, modelled_seconds

    step = Step(name="quick.main-m-low-offload_ar", kind="main", argv=("python", "run.py", "max_new_tokens=32"),
                records=5)
    here = {step.name: {"seconds": 40.0, "command": step.command, "status": "reproduced"}}
    reference = {step.name: {"seconds": 20.0, "records": 5, "status": "reproduced"}}
    assert estimate(step, here, reference).source == "measured here" and estimate(step, here, reference).seconds == 40
    assert estimate(step, {}, reference).seconds == 20.0
    assert estimate(step, {}, {step.name: {"seconds": 20.0, "records": 2, "status": "reproduced"}}).source == "model"
    failed = {step.name: {"seconds": 3.0, "command": step.command, "status": "failed"}}
    assert estimate(step, failed).source == "model"
    assert modelled_seconds(step) == 11.0 + 5 * 0.9 + 9.0  # startup + records x per-record at 32 tokens + one method of a cell


def test_kill_9_of_the_runner_still_ends_the_step(tmp_path):
    """No chance to forward a signal: the step is TERMed by the kernel when its parent dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    logs = tmp_path / "logs"
    logs.mkdir()
    pidfile = tmp_path / "pids"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(logs), str(pidfile)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and len(pidfile.read_text().split()) == 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    step_pid, grandchild = map(int, pidfile.read_text().split())
    proc.kill()
    proc.wait()
    try:
        deadline = time.monotonic() + 10
        while _alive(step_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(step_pid)
    finally:
        try:
            os.kill(grandchild, signal.SIGKILL)  # the step's own child is not covered (no signal reached the group)
        except ProcessLookupError:
            pass


def timed(name: str, kind: str, stamps: Path, seconds: float, rc: int = 0, needs: tuple[str, ...] = ()) -> Step:
    """A step that appends its start and end times to `stamps` and sleeps `seconds` in between."""
    code = (f"import time, sys; f = open({str(stamps)!r}, 'a'); f.write(f'{name} start {{time.monotonic()}}\\n'); "
            f"f.flush(); time.sleep({seconds}); f.write(f'{name} end {{time.monotonic()}}\\n'); sys.exit({rc})")
    return Step(name=name, kind=kind, argv=(sys.executable, "-c", code), needs=needs)


def spans(stamps: Path) -> dict[str, tuple[float, float]]:
    got: dict[str, list[float]] = {}
    for line in stamps.read_text().splitlines():
        name, _, t = line.split()
        got.setdefault(name, []).append(float(t))
    return {k: (v[0], v[1]) for k, v in got.items() if len(v) == 2}


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_jobs_run_measuring_steps_together_and_exclusive_steps_alone(tmp_path):
    logs, stamps = tmp_path / "logs", tmp_path / "stamps"
    logs.mkdir()
    steps = [timed("train", "train", stamps, 0.3),
             timed("sweep-a", "k_sweep", stamps, 1.0, needs=("train",)),
             timed("sweep-b", "k_sweep", stamps, 1.0, needs=("train",)),
             timed("main-a", "main", stamps, 0.5, needs=("sweep-a",)),
             timed("main-b", "main", stamps, 0.5, needs=("sweep-b",)),
             timed("bench", "bench", stamps, 0.3),
             timed("after", "trace", stamps, 0.3),
             timed("figures", "figures", stamps, 0.1)]
    lines: list[str] = []
    t0 = time.monotonic()
    out = Runner(logs, say=lines.append).run_all(steps, jobs=2)
    wall = time.monotonic() - t0
    assert [o.status for o in out] == [REPRODUCED] * len(steps) and [o.step.name for o in out] == [s.name for s in steps]
    sp = spans(stamps)
    assert overlap(sp["sweep-a"], sp["sweep-b"])  # two measuring steps at once
    assert sp["train"][1] <= sp["sweep-a"][0] and sp["sweep-a"][1] <= sp["main-a"][0]  # needs come first
    for name in ("train", "bench", "figures"):  # exclusive: nothing beside them
        assert not any(overlap(sp[name], sp[other]) for other in sp if other != name), name
    assert sp["main-a"][1] <= sp["bench"][0] and sp["main-b"][1] <= sp["bench"][0]  # a barrier: all before it done
    assert sp["bench"][1] <= sp["after"][0] and sp["after"][1] <= sp["figures"][0]
    assert wall < 0.3 + 1.0 + 0.5 + 0.3 + 0.3 + 0.1 + 2.5  # the pairs overlapped (serially: 4.0 s of sleeps)
    assert any(line.endswith("sweep-a done in 1 s") for line in lines)


def test_jobs_skip_dependents_of_a_failed_step_and_run_the_rest(tmp_path):
    logs, stamps = tmp_path / "logs", tmp_path / "stamps"
    logs.mkdir()
    steps = [timed("sweep-a", "k_sweep", stamps, 0.2, rc=3), timed("sweep-b", "k_sweep", stamps, 0.2),
             timed("main-a", "main", stamps, 0.1, needs=("sweep-a",)),
             timed("main-b", "main", stamps, 0.1, needs=("sweep-b",))]
    out = {o.step.name: o for o in Runner(logs, say=lambda _: None).run_all(steps, jobs=2)}
    assert out["sweep-a"].status == FAILED and out["sweep-a"].rc == 3
    assert out["main-a"].status == SKIPPED and out["main-a"].root == "sweep-a"
    assert out["sweep-b"].status == REPRODUCED and out["main-b"].status == REPRODUCED


def test_jobs_term_stops_every_running_step(tmp_path):
    """TERM to a JOBS=2 runner stops both running steps' process groups; the rest are 'not run'."""
    logs, stamps = tmp_path / "logs", tmp_path / "stamps"
    logs.mkdir()
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from specter.reproduce.execute import Runner
        from test_reproduce_runner import timed
        stamps = Path({str(stamps)!r})
        steps = [timed("a", "main", stamps, 60), timed("b", "main", stamps, 60), timed("c", "main", stamps, 1)]
        r = Runner(Path({str(logs)!r}), say=print)
        r.install_signals()
        out = r.run_all(steps, jobs=2)
        print("STATUSES", [o.status for o in out], flush=True)
    """))
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not stamps.exists() or stamps.read_text().count("start") < 2):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert "STATUSES ['interrupted', 'interrupted', 'not run']" in out
    assert "end" not in stamps.read_text()  # neither sleeper ran to its end
