"""Running the steps: one log and one marker per step, dependents of a failed step skipped, and the
running children stopped (each one's whole process group) when reproduce_all gets TERM, INT or HUP.

`jobs` > 1 runs that many measuring steps at once (JOBS=2 on 2 cores: the emulated link's copies are
waits, so a step leaves most of its core idle). A step starts when the steps it needs have finished;
a step of an EXCLUSIVE kind (the dataset check, training, the timed benchmarks, the figures) runs
alone and is a barrier: nothing after it starts before it has finished, nothing before it is still
running when it starts. Every method of a cell is interleaved in one process, so a neighbour on the
other core slows its methods alike; each record re-times the link from its own probe.

A step counts as done earlier only when its marker holds the same command AND its outputs are
valid (`outputs.outputs_problem`); a deleted or incomplete result folder is run again. Trained tiny
models are shared through SPECTER_HOME, so their outputs alone decide.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specter.reproduce.estimate import write_timing
from specter.reproduce.outputs import outputs_problem, set_aside_other_datasets
from specter.reproduce.plan import Step
from specter.reproduce.settings import REPO

PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_GRACE_S = 20.0  # after TERM, the child's process group gets this long before KILL
FAILED, SKIPPED, DONE, REPRODUCED, INTERRUPTED, NOT_RUN = (
    "failed", "skipped", "done earlier", "reproduced", "interrupted", "not run")
PLANNED = "planned"  # DRY_RUN only
STOPPED = (FAILED, SKIPPED, INTERRUPTED, NOT_RUN)  # a step that needs one of these is skipped
EXCLUSIVE_KINDS = ("datasets", "train", "bench", "figures")  # alone: shared inputs, timed kernels, the last step
POLL_S = 0.2  # how often a parallel run looks at its children


@dataclass
class Outcome:
    step: Step
    status: str
    seconds: float | None = None
    why: str = ""                      # one line for the table
    detail: list[str] = field(default_factory=list)  # the error message, line by line
    root: str = ""                     # the failed step a skip goes back to
    rc: int | None = None              # the step's exit status, when it ran


@dataclass
class _Running:
    """A step whose process has started: what its end needs."""

    step: Step
    tag: str
    proc: subprocess.Popen
    log: object                        # the open log file
    t0: float
    accept: Callable[[int], bool] | None = None


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_ERROR = re.compile(r"^(specter: error:|error:|FAILED |[A-Za-z_.]*(Error|Exception|Unavailable)\b:)")


def error_lines(log: Path, limit: int = 12) -> list[str]:
    """The error a failed step reported, unfolded ('; '-joined lines become lines again)."""
    try:
        lines = [ln.rstrip() for ln in log.read_text(encoding="utf-8", errors="replace").splitlines()]
    except OSError:
        return []
    lines = [ln for ln in lines if ln.strip()]
    hits = [i for i, ln in enumerate(lines) if _ERROR.match(ln.strip())]
    if hits:
        first = hits[-1]
        # several consecutive error lines (e.g. one FAILED line per dataset) belong together
        while first - 1 in hits:
            first -= 1
        chosen = lines[first:hits[-1] + 1]
        if len(chosen) == 1 and "; " in chosen[0]:
            head, *rest = chosen[0].split("; ")
            chosen = [head, *("  " + r for r in rest)]
    else:
        chosen = lines[-3:]
    return chosen[:limit]


class Runner:
    """Runs steps in the repository root, one at a time or `jobs` at once; `say` prints progress lines."""

    def __init__(self, logs: Path, force: bool = False, say: Callable[[str], None] = print, repo: Path = REPO):
        self.logs, self.force, self.say, self.repo = logs, force, say, repo
        self.procs: list[subprocess.Popen] = []  # the steps running now
        self.signum: int | None = None
        self.outcomes: dict[str, Outcome] = {}

    # ------------------------------------------------------------ signals
    def _on_signal(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum
            raise Interrupted(signum)
        for proc in self.procs:  # a second signal: no more grace
            if proc.poll() is None:
                _kill_group(proc, signal.SIGKILL)

    def install_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def stop_children(self) -> None:
        """TERM every running step's process group, wait, then KILL what is left."""
        live = [p for p in self.procs if p.poll() is None]
        for proc in live:
            self.say(f"    stopping the running step (pid {proc.pid}) and its children")
            _kill_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in live:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(proc, signal.SIGKILL)
                proc.wait()
            finally:
                _kill_group(proc, signal.SIGKILL)  # grandchildren that outlived the leader

    # ------------------------------------------------------------ markers
    def marker(self, step: Step) -> Path:
        return self.logs / f"{step.name}.done"

    def log_path(self, step: Step) -> Path:
        return self.logs / f"{step.name}.log"

    def done_earlier(self, step: Step) -> str | None:
        """None when `step` must run; else why it need not (for the progress line)."""
        if self.force or not step.checks:
            return None
        try:
            same = self.marker(step).read_text(encoding="utf-8").strip() == step.command
        except OSError:
            same = False
        if not same and step.kind != "train":
            return None
        problem = outputs_problem(step)
        if problem:
            if same:
                self.say(f"    finished earlier, but {problem}: running it again")
            return None
        return "outputs present and valid"

    def _write_marker(self, step: Step) -> None:
        tmp = self.logs / f".{step.name}.done.tmp"
        tmp.write_text(step.command + "\n", encoding="utf-8")
        os.replace(tmp, self.marker(step))

    # ------------------------------------------------------------ one step
    def blocker(self, step: Step) -> Outcome | None:
        for need in step.needs:
            got = self.outcomes.get(need)
            if got is not None and got.status in STOPPED:
                return got
        return None

    def run_step(self, step: Step, index: int, total: int, accept: Callable[[int], bool] | None = None) -> Outcome:
        """Run (or skip) one step; `accept(rc)` overrides the exit-status rule (the dataset check)."""
        started = self._launch(step, index, total, accept)
        if isinstance(started, Outcome):
            return started
        self.procs = [started.proc]
        try:
            rc = started.proc.wait()
        except Interrupted as sig:
            return self._interrupted(started, sig)
        finally:
            self.procs = []
        return self._finish(started, rc)

    def _launch(self, step: Step, index: int, total: int, accept=None) -> Outcome | _Running:
        """Skip `step` (a needed step stopped; done earlier) or start its process."""
        tag = f"[{index}/{total}] {step.name}" if total else f"[{index}] {step.name}"
        blocked = self.blocker(step)
        if blocked is not None:
            root = blocked.root or blocked.step.name
            verb = "was interrupted" if blocked.status == INTERRUPTED else "failed"
            outcome = Outcome(step, SKIPPED, why=f"because {root} {verb}", root=root)
            self.say(f"{tag}: skipped {outcome.why}")
            return self._keep(outcome)
        why_done = self.done_earlier(step)
        if why_done:
            self.say(f"{tag}: finished earlier ({why_done}), not rerun")
            return self._keep(Outcome(step, DONE, why=why_done))
        log = self.log_path(step)
        for line in set_aside_other_datasets(step, time.strftime("%Y%m%d-%H%M%S")):
            self.say(f"{tag}: {line}")
        self.say(f"{tag}: running (log: {log})")
        fh = log.open("w", encoding="utf-8")
        fh.write(f"$ {step.command}\n\n")
        fh.flush()
        try:
            proc = subprocess.Popen(list(step.argv), stdout=fh, stderr=subprocess.STDOUT, cwd=self.repo,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        except OSError as err:
            fh.close()
            return self._keep(Outcome(step, FAILED, 0.0, f"cannot start: {err}", [f"cannot start: {err}"]))
        return _Running(step, tag, proc, fh, time.monotonic(), accept)

    def _interrupted(self, started: _Running, sig: Interrupted) -> Outcome:
        self.stop_children()
        started.log.close()
        seconds = time.monotonic() - started.t0
        self.say(f"    {started.step.name} stopped by {sig} after {seconds:.0f} s")
        return self._keep(Outcome(started.step, INTERRUPTED, seconds, f"stopped by {sig}"))

    def _finish(self, started: _Running, rc: int) -> Outcome:
        """The outcome of a step whose process exited with `rc`: its outputs checked, its marker written."""
        started.log.close()
        step, seconds = started.step, time.monotonic() - started.t0
        log = self.log_path(step)
        ok = started.accept(rc) if started.accept else rc == 0
        if not ok:
            detail = error_lines(log)
            outcome = Outcome(step, FAILED, seconds, f"exit {rc}: {detail[0] if detail else 'see the log'}", detail,
                              rc=rc)
        else:
            problem = outputs_problem(step) if step.checks else None
            if problem:
                outcome = Outcome(step, FAILED, seconds, f"exit {rc}, but {problem}", [f"exit {rc}, but {problem}"],
                                  rc=rc)
            else:
                if step.checks:
                    self._write_marker(step)
                outcome = Outcome(step, REPRODUCED, seconds, rc=rc)
        write_timing(self.logs, step, seconds, outcome.status)
        if outcome.status == FAILED:
            self.say(f"    {step.name} FAILED after {seconds:.0f} s (log: {log}):")
            for line in outcome.detail:
                self.say(f"      {line}")
        else:
            self.say(f"    {step.name} done in {seconds:.0f} s")
        return self._keep(outcome)

    def _keep(self, outcome: Outcome) -> Outcome:
        self.outcomes[outcome.step.name] = outcome
        return outcome

    def run_all(self, steps: list[Step], start: int = 1, total: int | None = None, jobs: int = 1) -> list[Outcome]:
        """Run `steps` (`jobs` at a time); after a signal the rest are 'not run'. Returns them in plan order."""
        total = total or len(steps)
        if jobs > 1:
            return self._run_parallel(steps, start, total, jobs)
        done: list[Outcome] = []
        for i, step in enumerate(steps):
            if self.signum is not None:
                done.append(self._keep(Outcome(step, NOT_RUN, why="reproduce_all was stopped")))
                continue
            try:
                done.append(self.run_step(step, start + i, total))
            except Interrupted:  # between steps: nothing is running
                done.append(self._keep(Outcome(step, NOT_RUN, why="reproduce_all was stopped")))
        return done

    def _run_parallel(self, steps: list[Step], start: int, total: int, jobs: int) -> list[Outcome]:
        pending = list(enumerate(steps, start))
        running: list[_Running] = []
        ours = {s.name for s in steps}
        try:
            while pending or running:
                self._start_ready(pending, running, ours, jobs, total)
                time.sleep(POLL_S)
                for r in [r for r in running if r.proc.poll() is not None]:
                    running.remove(r)
                    self.procs.remove(r.proc)
                    self._finish(r, r.proc.returncode)
        except Interrupted as sig:
            self.stop_children()
            for r in running:
                r.log.close()
                self._keep(Outcome(r.step, INTERRUPTED, time.monotonic() - r.t0, f"stopped by {sig}"))
                self.say(f"    {r.step.name} stopped by {sig}")
        self.procs = []
        for _, step in pending:
            self._keep(Outcome(step, NOT_RUN, why="reproduce_all was stopped"))
        return [self.outcomes[s.name] for s in steps]

    def _start_ready(self, pending: list, running: list[_Running], ours: set[str], jobs: int, total: int) -> None:
        """Start pending steps in plan order while a slot is free: each once its needs have finished; an
        exclusive step only with nothing running, and never one past a pending exclusive step."""
        waiting = {s.name for _, s in pending} | {r.step.name for r in running}  # not finished yet
        for item in list(pending):
            index, step = item
            exclusive = step.kind in EXCLUSIVE_KINDS
            if len(running) >= jobs or any(r.step.kind in EXCLUSIVE_KINDS for r in running) or \
                    (exclusive and (running or item is not pending[0])):
                return
            if any(n in ours and n in waiting for n in step.needs) and (running or item is not pending[0]):
                if exclusive:
                    return
                continue  # (the first pending step with nothing running starts: its needs cannot finish first)
            pending.remove(item)
            started = self._launch(step, index, total)
            if isinstance(started, _Running):
                running.append(started)
                self.procs.append(started.proc)
            if exclusive:
                return


def _die_with_parent() -> None:
    """In the child, before exec: TERM when reproduce_all dies without a chance to stop it (kill -9)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: TERM/INT/HUP handling still stops the child
        pass


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the step leads its own session: its pid is its group id
    except (ProcessLookupError, PermissionError):
        pass


def simulate(steps: list[Step], failing: set[str], say: Callable[[str], None] = print) -> list[Outcome]:
    """DRY_RUN: the plan with each step's command, and the steps that `failing` would make skip."""
    outcomes: dict[str, Outcome] = {}
    total = len(steps)
    out = []
    for i, step in enumerate(steps, start=1):
        blocked = next((outcomes[n] for n in step.needs if n in outcomes and outcomes[n].status in STOPPED), None)
        if blocked is not None:
            root = blocked.root or blocked.step.name
            o = Outcome(step, SKIPPED, why=f"because {root} failed", root=root)
            say(f"[{i}/{total}] {step.name}: skipped {o.why}")
        elif step.name in failing:
            o = Outcome(step, FAILED, why="DRY_FAIL")
            say(f"[{i}/{total}] {step.name}: fails (DRY_FAIL): {step.command}")
        else:
            o = Outcome(step, PLANNED)
            say(f"[{i}/{total}] {step.name}: {step.command}")
        outcomes[step.name] = o
        out.append(o)
    return out
