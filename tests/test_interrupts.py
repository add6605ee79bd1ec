"""Ctrl-C while a command loads: `specter generate`, `specter serve` and run.py stop with one line and
status 130, also when started the way a script starts a background job (SIGINT ignored on entry, which
made Python install no handler: generate went on and decoded, serve came up and never stopped)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = ["model=tiny_dsv2", "model.trained=true", "memory=low", "max_new_tokens=4"]


def _ignoring_sigint() -> None:  # what a shell without job control does to a background command
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _interrupt_after_first_line(cmd: list[str], tmp_path: Path) -> tuple[int, str]:
    """Start `cmd` with SIGINT ignored and a fresh SPECTER_HOME (so it loads: it trains its model), send
    SIGINT once it has written its first stderr line, and return (status, stderr)."""
    env = dict(os.environ, SPECTER_HOME=str(tmp_path / "home"), PYTHONPATH=str(REPO))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_ignoring_sigint)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while not lines and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, f"{cmd[1:3]} ended before it was interrupted: {''.join(lines)[-800:]}"
    proc.send_signal(signal.SIGINT)
    try:
        status = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{cmd[1:3]} went on for 60 s after SIGINT: {''.join(lines)[-800:]}")
    reader.join(timeout=5)
    return status, "".join(lines)


@pytest.mark.parametrize("cmd,prog", [
    ([sys.executable, "-m", "specter.cli", "generate", *TINY, "prompt=def f(x):"], "specter"),
    ([sys.executable, "-m", "specter.cli", "serve", *TINY, "--port", "0"], "specter"),
    ([sys.executable, "run.py", *TINY, "output_dir={out}"], None),
], ids=["generate", "serve", "run.py"])
def test_sigint_while_loading_stops_with_130_and_one_line(cmd, prog, tmp_path):
    cmd = [a.replace("{out}", str(tmp_path / "out")) for a in cmd]
    status, err = _interrupt_after_first_line(cmd, tmp_path)
    assert status == 128 + signal.SIGINT, err[-1500:]
    assert "Traceback" not in err, err[-1500:]
    if prog:
        assert err.rstrip().splitlines()[-1] == f"{prog}: interrupted", err[-800:]


@pytest.mark.parametrize("signum,kind", [(signal.SIGINT, "KeyboardInterrupt"), (signal.SIGTERM, "Terminated")])
def test_a_signal_inside_an_import_is_raised_after_it(signum, kind, tmp_path, monkeypatch):
    """A signal raised inside an import left half-initialised modules (numpy recursed, torch aborted); the
    handler holds it while the import runs and raises at the first call in own code after it."""
    import specter.entry as entry
    from specter.entry import Terminated, interrupt, terminate_as_interrupt

    monkeypatch.setattr(entry, "OWN_CODE", [*entry.OWN_CODE, str(Path(__file__).parent)])  # this test's loop

    (tmp_path / "slow_module_for_signals.py").write_text(
        "import os, signal, time\n"
        f"os.kill(os.getpid(), {int(signum)})\n"
        "deadline = time.monotonic() + 0.3\n"
        "while time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "finished = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    previous = signal.signal(signal.SIGINT, interrupt)
    raised, after_import = None, False
    try:
        with terminate_as_interrupt():
            try:
                import slow_module_for_signals  # noqa: F401
                after_import = True
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    time.sleep(0.01)
            except KeyboardInterrupt as err:
                raised = err
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.modules.pop("slow_module_for_signals", None)
    assert after_import and type(raised).__name__ == kind, (after_import, raised)
    assert isinstance(raised, Terminated) == (signum == signal.SIGTERM)
