"""The GPU validation step: measure_device's device file loads into the cost model (fed fake
measurements here), its fit recovers latency and bandwidth, it refuses a machine without CUDA, and
scripts/gpu_check.sh lists the step within its time limit."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, compose

FAKE = {"hbm_bandwidth": 4.1e12, "hbm_efficiency": 0.83, "launch_overhead": 3.5e-6, "h2d_bandwidth": 52.3e9,
        "h2d_latency": 7.25e-6, "d2h_bandwidth": 48.0e9, "d2h_latency": 9.0e-6}


def _write(tmp_path):
    from specter.projection.measure_device import device_yaml, measured_values, slug

    path = tmp_path / "measured.yaml"
    path.write_text(device_yaml(slug("NVIDIA H200"), measured_values("NVIDIA H200", FAKE, "h200_pcie5"), comment="t"))
    return path


def test_device_file_loads_into_the_cost_model(tmp_path):
    from specter.projection.cost_model import CostModel, load_device, real_shape

    dev = load_device(_write(tmp_path))
    ref = load_device("h200_pcie5")
    assert dev.name == "measured_nvidia_h200"
    for p, v in FAKE.items():
        assert getattr(dev, p) == pytest.approx(v, rel=1e-6)
        assert dev.sources[p] == "measured on NVIDIA H200 by scripts/gpu_check.sh"
    assert dev.peak_fp16 == ref.peak_fp16 and dev.sources["peak_fp16"].startswith("not measured; from h200_pcie5")
    cm = CostModel(real_shape("dsv2"), dev)
    assert cm.h2d() == pytest.approx(FAKE["h2d_latency"] + cm.expert_bytes() / FAKE["h2d_bandwidth"])


def test_device_file_is_exact_bytes(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert _write(tmp_path / "a").read_bytes() == _write(tmp_path / "b").read_bytes()


def test_project_runs_on_a_measured_device_file(tmp_path, capsys):
    from specter.experiments.dispatch import run_experiment

    path = _write(tmp_path)
    run_experiment(compose(["experiment=project", "model=dsv2", "project.routes=independent", "project.tokens=4",
                            f"project.device={path}", f"output_dir={tmp_path / 'out'}"]))
    assert "measured_nvidia_h200" in (tmp_path / "out" / "projection.csv").read_text()


def test_fit_recovers_latency_and_bandwidth():
    from specter.projection.measure_device import expert_bytes, fit_latency_bandwidth

    sizes = [65536.0, 1 << 20, 4 << 20, float(expert_bytes())]
    bw, lat = fit_latency_bandwidth(sizes, [10e-6 + s / 25e9 for s in sizes])
    assert bw == pytest.approx(25e9) and lat == pytest.approx(10e-6)
    assert expert_bytes("dsv2") == 3 * 2048 * 1408 * 2


def test_writer_refuses_a_missing_parameter():
    from specter.projection.measure_device import device_yaml

    with pytest.raises(ValueError, match="missing"):
        device_yaml("x", {"hbm_bandwidth": (1.0, "s")})


def test_refuses_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    res = subprocess.run([sys.executable, "-m", "specter.projection.measure_device", "--out", str(tmp_path / "d.yaml")],
                         cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2 and "no CUDA device" in res.stderr and not (tmp_path / "d.yaml").exists()


def test_gpu_check_dry_run_lists_the_device_step_within_its_limit():
    res = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "DRY_RUN": "1"})
    assert res.returncode == 0, res.stderr
    head = re.search(r"(\d+) steps, (\d+) s of budgets \(limit (\d+) s\)", res.stdout)
    n, total, limit = map(int, head.groups())
    budgets = [int(b) for b in re.findall(r"^\s+\d+\. .*?\s(\d+) s\s", res.stdout, re.M)]
    assert len(budgets) == n and sum(budgets) == total <= limit
    assert re.search(r"^\s+\d+\. device\s+\d+ s\s+step_measure_device$", res.stdout, re.M)
    assert "measure_device --out" in (REPO / "scripts" / "gpu_check.sh").read_text()
