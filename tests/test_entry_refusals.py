"""One rule for every entry point besides run.py: bad input is one line on stderr and exit status 2
(130/143 on signals, with a line; 141 when stdout's reader leaves), never a traceback, a hang, or a
number computed from the bad input. Each case here failed before (docs/input_safety.md lists them).

    specter generate / serve     options, overrides, SPECTER_HOME, the prompt's bytes, the address
    python -m specter.routing_stats
    experiment=project           device files and project.* counts
    make_figures.py              --results, --only, --dpi, --figures, copied run folders, a full disk
    reproduce_all preflight      RESULTS / SPECTER_HOME pointing at a file
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO, cli_in_process

from specter import cli as specter_cli
from specter import routing_stats as rs

TINY = ["model=tiny_dsv2", "memory=low"]


def one_line(rc: int, err: str, prog: str = "specter", status: int = 2) -> str:
    """The single error line of a refusal (asserting that there is exactly one and no traceback)."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if f"{prog}: error:" in line]
    assert rc == status and len(lines) == 1, (rc, err)
    return lines[0]


def run_specter(argv, capsys) -> tuple[int, str, str]:
    rc = specter_cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------------------- specter generate / serve
@pytest.mark.parametrize("argv,expect", [
    (["serve", "--port", "70000", *TINY], "port"),  # was an OverflowError traceback
    (["serve", "--port", "http", *TINY], "port"),
    (["serve", "--drain-timeout", "nan", *TINY], "drain-timeout"),  # was a ValueError traceback
    (["serve", "--drain-timeout", "-1", *TINY], "drain-timeout"),
    (["serve", "--max-batch", "0", *TINY], "max-batch"),
    (["serve", "--max-queue", "1e3", *TINY], "max-queue"),
    (["serve", "+typo=1", *TINY], "unknown setting"),  # was accepted and served
    (["generate", "prompt=hi", "+typo=1", *TINY], "unknown setting"),  # was accepted and ran
    (["generate", "prompt=a\udcffb", *TINY], "UTF-8"),  # non-UTF-8 bytes in argv: was a TypeError traceback
    (["generate", *TINY], "prompt"),
])
def test_generate_and_serve_refuse_in_one_line(argv, expect, capsys):
    rc, out, err = run_specter(argv, capsys)
    assert expect in one_line(rc, err)
    assert "http://" not in out  # no banner


def test_specter_home_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    home.write_text("not a folder")
    monkeypatch.setenv("SPECTER_HOME", str(home))
    for argv in (["generate", "prompt=hi", *TINY], ["serve", *TINY]):  # was a NotADirectoryError traceback
        rc, _, err = run_specter(argv, capsys)
        assert "is a file" in one_line(rc, err)


def test_a_port_in_use_is_refused_before_the_model_loads(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        rc, out, err = run_specter(["serve", "--port", str(port), *TINY], capsys)  # was rc 3 after loading
    assert "cannot listen" in one_line(rc, err) and "http://" not in out
    assert time.monotonic() - start < 30


def test_an_address_not_of_this_machine_is_one_line_without_a_banner(capsys):
    rc, out, err = run_specter(["serve", "--host", "203.0.113.7", "--port", "0", *TINY], capsys)
    assert "203.0.113.7" in one_line(rc, err) and "http://" not in out


def test_a_non_loopback_host_is_warned_about(monkeypatch, capsys):
    import specter.api as api
    from specter.assembly.config import ConfigError

    def stop(*args, **kwargs):
        raise ConfigError("stopped before loading")

    monkeypatch.setattr(api, "build_served", stop)
    rc, out, err = run_specter(["serve", "--host", "0.0.0.0", "--port", "0", *TINY], capsys)
    assert "stopped before loading" in one_line(rc, err)
    assert "exposes the server to the network" in err and "http://" not in out


def _spawn(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=REPO, text=True, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"}, **kw)


def test_sigterm_while_generate_loads_is_143_with_a_line():
    proc = _spawn(["-m", "specter.cli", "generate", "prompt=hi", *TINY], stdout=subprocess.DEVNULL)
    time.sleep(1.5)  # in its imports or the model's load: was a silent 143
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "terminated" in err and "Traceback" not in err, err


@pytest.mark.parametrize("after_s", [0.5, 2.5])  # in its imports; building the method
def test_sigterm_while_serve_loads_is_143_with_one_line(after_s, tiny_checkpoint):
    tiny_checkpoint("tiny_dsv2")
    proc = _spawn(["-m", "specter.cli", "serve", "--port", "0", *TINY], stdout=subprocess.PIPE)
    time.sleep(after_s)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("INFO:")]
    assert proc.returncode == 143 and lines == ["specter: terminated (SIGTERM)"], (proc.returncode, err)
    assert "http://" not in out  # never announced a server it is not running


def test_a_sigterm_before_uvicorn_takes_the_signals_still_stops_the_server(monkeypatch):
    """Between the model's load and uvicorn's own handlers, SIGTERM goes to serve's handler: it must
    stop the server (was: recorded and ignored, so the server ran on)."""
    from specter.serve import server as server_mod

    class FakeServer:
        should_exit = False

        def run(self, sockets=None):
            os.kill(os.getpid(), signal.SIGTERM)  # before uvicorn.Server.serve installs its handlers
            time.sleep(0.05)
            ran.append(self.should_exit)

    class FakeLoop:
        failure = None

    class FakeMethod:
        name = "specter"

    class FakeEngine:
        name, method, max_batch = "tiny_dsv2", FakeMethod(), 1
        cfg = type("C", (), {"memory": type("M", (), {"name": "low"})()})()

        def close(self):
            closed.append(True)

    ran, closed = [], []
    monkeypatch.setattr("specter.api.compose_checked", lambda overrides: None)
    monkeypatch.setattr("specter.api.load_overrides", lambda overrides, max_batch: FakeEngine())
    monkeypatch.setattr(server_mod, "make_server", lambda *a, **k: type("P", (), {"server": FakeServer(),
                                                                                  "loop": FakeLoop()})())
    rc = specter_cli.main(["serve", "--port", "0", *TINY])
    assert rc == 0 and ran == [True] and closed == [True]


def test_a_closed_stdout_is_141_with_a_line(tiny_checkpoint):
    tiny_checkpoint("tiny_dsv2")
    proc = _spawn(["-m", "specter.cli", "generate", "prompt=def f(x):", "ignore_eos=true", "max_new_tokens=200",
                   "method=target_only", "warmup_tokens=0", *TINY], stdout=subprocess.PIPE)
    assert len(proc.stdout.read(5)) == 5  # `| head -c 5`
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=60)
    assert proc.returncode == 141 and "output closed" in err and "Traceback" not in err, err


# ---------------------------------------------------------------------------------- routing_stats
def _rs(argv, capsys) -> tuple[int, str]:
    rc = rs.main(argv)
    out, err = capsys.readouterr()
    return rc, err


@pytest.mark.parametrize("extra,expect", [
    (["--text", "no-such-file.txt"], "neither a dataset"),
    (["--tokens", str(10**9)], "--tokens"),
    (["--tokens", "12"], "--tokens"),
    (["--K", "100000"], "--K"),  # exited 0 with all-NaN CSVs
    (["--K", "0"], "--K"),
])
def test_routing_stats_refuses_arguments(extra, expect, capsys):
    rc, err = _rs(["tiny_qwen", "--untrained", *extra], capsys)
    assert expect in one_line(rc, err, "routing_stats")


def test_routing_stats_refuses_paths(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    rc, err = _rs(["tiny_qwen", "--untrained", "--text", str(tmp_path)], capsys)
    assert "not a file" in one_line(rc, err, "routing_stats")
    rc, err = _rs(["tiny_qwen", "--untrained", "--out", str(a_file)], capsys)  # an existing file as --out
    assert "is a file" in one_line(rc, err, "routing_stats")
    rc, err = _rs(["tiny_qwen", "--untrained", "--out", str(a_file / "sub")], capsys)
    assert "is a file" in one_line(rc, err, "routing_stats")


def test_routing_stats_refuses_too_little_text_and_a_truncated_checkpoint(tmp_path, tiny_checkpoint, capsys):
    ck = tiny_checkpoint("tiny_qwen")
    short = tmp_path / "short.txt"
    short.write_text("a few words only")
    rc, err = _rs(["tiny_qwen", "--untrained", "--text", str(short), "--out", str(tmp_path / "o")], capsys)
    assert "hold only" in one_line(rc, err, "routing_stats")
    assert not (tmp_path / "o").exists()
    broken = tmp_path / "ckpt"
    shutil.copytree(ck, broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    rc, err = _rs([str(broken), "--out", str(tmp_path / "o")], capsys)
    one_line(rc, err, "routing_stats")


def test_routing_stats_ctrl_c_is_130_with_a_line(monkeypatch, tiny_checkpoint, tmp_path, capsys):
    tiny_checkpoint("tiny_qwen")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(rs, "routing_report", interrupted)
    rc, err = _rs(["tiny_qwen", "--untrained", "--out", str(tmp_path / "o")], capsys)
    assert rc == 130 and "interrupted" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------- experiment=project
GOOD_DEVICE = (REPO / "specter" / "projection" / "devices" / "a100_40gb_pcie4.yaml").read_text()


@pytest.mark.parametrize("text,expect", [
    ("hbm_bandwidth: {value: [unclosed\n", "not valid YAML"),
    ("42\n", "must be a mapping"),
    (GOOD_DEVICE.replace("value: 1.555e12", "value: fast"), "hbm_bandwidth must be a finite number > 0"),
    (GOOD_DEVICE.replace("value: 24.0e9", "value: -24.0e9"), "h2d_bandwidth must be a finite number > 0"),
    (GOOD_DEVICE.replace("value: 1.555e12", "value: .inf"), "hbm_bandwidth"),
    (GOOD_DEVICE.replace("value: 1.555e12", "value: .nan"), "hbm_bandwidth"),
    (GOOD_DEVICE.replace("value: 0.8", "value: 1.5"), "hbm_efficiency must be in (0, 1]"),
    (GOOD_DEVICE.replace("value: 0.8", "value: true"), "hbm_efficiency"),
    ("\n".join(line for line in GOOD_DEVICE.splitlines() if not line.startswith("d2h_latency")), "missing"),
    (GOOD_DEVICE.replace(', source: "datasheet: A100 FP16 tensor core, dense"', ""), "peak_fp16 has no source"),
    (GOOD_DEVICE.replace("peak_fp16: {", "peak_fp16: 3\nx: {"), "peak_fp16 must be"),
])
def test_device_files_are_validated(tmp_path, text, expect):
    from specter.assembly.config_error import ConfigError
    from specter.projection.cost_model import load_device

    path = tmp_path / "device.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_device(path)
    assert expect in str(info.value)
    assert load_device(REPO / "specter" / "projection" / "devices" / "a100_40gb_pcie4.yaml").bw > 0


def test_a_device_folder_is_refused(tmp_path):
    from specter.assembly.config_error import ConfigError
    from specter.projection.cost_model import load_device

    folder = tmp_path / "dev.yaml"
    folder.mkdir()
    with pytest.raises(ConfigError, match="cannot be read"):
        load_device(folder)


PROJECT = ["experiment=project", "model=tiny_dsv2", "project.tokens=8", "project.methods=[]", "progress=false"]


@pytest.mark.parametrize("extra,expect", [
    (["project.warmup_tokens=-3"], "project.warmup_tokens"),  # hung forever
    (["project.warmup_tokens=0"], "project.warmup_tokens"),
    (["project.prompts=0"], "project.prompts"),
])
def test_project_counts_are_refused_up_front(extra, expect, tmp_path, capsys):
    rc, out, err = cli_in_process([*PROJECT, *extra, f"output_dir={tmp_path / 'o'}"], capsys)
    assert expect in one_line(rc, err)


def test_a_bad_device_file_ends_the_projection_in_one_line_and_no_number(tmp_path, capsys):
    bad = tmp_path / "neg.yaml"
    bad.write_text(GOOD_DEVICE.replace("value: 24.0e9", "value: -24.0e9"))
    rc, out, err = cli_in_process([*PROJECT, f"project.device={bad}", f"output_dir={tmp_path / 'o'}"], capsys)
    assert "h2d_bandwidth" in one_line(rc, err)
    assert " ms" not in out and not list((tmp_path / "o").rglob("*.csv"))


# ---------------------------------------------------------------------------------- make_figures.py
def _figures(argv, capsys) -> tuple[int, str, str]:
    from specter.figures.cli import main

    rc = main(argv, repo=REPO)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def results(tmp_path) -> Path:
    from test_figures import _run

    root = tmp_path / "results"
    _run(root / "main" / "tiny_dsv2-specter-high", "specter", prefetch="adaptive")
    _run(root / "main" / "tiny_dsv2-offload_ar-high", "offload_ar")
    return root


def test_make_figures_refuses_its_arguments(tmp_path, results, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    figs = str(tmp_path / "figs")
    cases = [
        (["--results", str(tmp_path / "missing"), "--figures", figs], "does not exist"),  # rc 0, "0 files"
        (["--results", str(a_file), "--figures", figs], "is a file"),  # rc 0, "0 files"
        (["--results", str(results), "--figures", figs, "--only", "bogus"], "bogus"),  # rc 0, silently
        (["--results", str(results), "--figures", figs, "--dpi", "-5"], "--dpi"),  # a traceback
        (["--results", str(results), "--figures", figs, "--dpi", "many"], "--dpi"),
        (["--results", str(results), "--figures", str(a_file)], "is a file"),  # a traceback
    ]
    for argv, expect in cases:
        rc, out, err = _figures(argv, capsys)
        assert expect in one_line(rc, err, "make_figures.py"), argv
    assert not (tmp_path / "figs").exists()


def test_make_figures_refuses_a_copied_run_folder(tmp_path, results, capsys):
    records = results / "main" / "tiny_dsv2-specter-high" / "records.csv"
    lines = records.read_text().splitlines()  # as a run writes them: each record's own start time
    records.write_text("\n".join([lines[0] + ",started_at", *(f"{line},{1.7e9 + i}" for i, line in
                                                              enumerate(lines[1:]))]) + "\n")
    rc, out, err = _figures(["--results", str(results), "--figures", str(tmp_path / "f0")], capsys)
    assert rc == 0, err  # one copy of the run: drawn
    shutil.copytree(results / "main" / "tiny_dsv2-specter-high", results / "copy" / "tiny_dsv2-specter-high")
    rc, out, err = _figures(["--results", str(results), "--figures", str(tmp_path / "f")], capsys)
    assert "counted twice" in one_line(rc, err, "make_figures.py")  # Fig. 14 counted its records twice
    assert not (tmp_path / "f").exists()


def test_make_figures_on_a_full_disk_is_one_line(tmp_path, results, monkeypatch, capsys):
    from specter.figures.common import Output

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "fig14_tpot.png")

    monkeypatch.setattr(Output, "figure", full)
    monkeypatch.setattr(Output, "table", full)
    rc, out, err = _figures(["--results", str(results), "--figures", str(tmp_path / "f"), "--only", "tpot_grid"],
                            capsys)
    assert "No space left" in one_line(rc, err, "make_figures.py"), out


@pytest.mark.parametrize("value", ["inf", "-inf", "1e400"])
def test_make_figures_leaves_out_a_record_whose_tpot_is_not_finite(tmp_path, results, capsys, value):
    """A row with tpot_ms=inf is left out of every figure with one note naming its file (was: three
    figures FAILED on "non-finite value", exit 1); the figures are drawn from the other rows."""
    records = results / "main" / "tiny_dsv2-specter-high" / "records.csv"
    lines = records.read_text().splitlines()
    header = lines[0].split(",")
    row = lines[1].split(",")
    row[header.index("tpot_ms")] = value
    records.write_text("\n".join([lines[0], ",".join(row), *lines[2:]]) + "\n")
    rc, out, err = _figures(["--results", str(results), "--figures", str(tmp_path / "f")], capsys)
    assert rc == 0 and "Traceback" not in out + err and "FAILED" not in out + err, out + err
    notes = [line for line in (out + err).splitlines() if "not finite" in line]
    assert len(notes) == 1 and str(records) in notes[0] and "1 record(s) left out" in notes[0]
    assert (tmp_path / "f" / "fig14_tpot.png").exists()


# ---------------------------------------------------------------------------------- reproduce preflight
@pytest.mark.parametrize("name", ["RESULTS", "SPECTER_HOME", "FIGURES", "LOGS"])
def test_reproduce_preflight_refuses_a_file_as_a_folder(name, tmp_path, capsys):
    from specter.reproduce.__main__ import main

    a_file = tmp_path / "file"
    a_file.write_text("x")
    for value in (a_file, a_file / "under"):
        rc = main({"CHECK": "1", "QUICK": "1", "MODELS": "tiny_dsv2", "METHODS": "specter",
                   "ASSETS": str(FIXTURES / "datasets"), name: str(value)})
        _, err = capsys.readouterr()
        assert name in one_line(rc, err, "reproduce_all")
