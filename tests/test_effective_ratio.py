"""Every record carries the effective load ratio it ran under; a run off the configured ratio is flagged."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from conftest import FIXTURES, cli_in_process
from specter.harness import load_ratio, runtime
from specter.harness.records import COLUMNS
from specter.offload.calibrate import (
    RATIO_COLUMNS,
    EffectiveRatio,
    LinkParams,
    LoadRatioMonitor,
    calibrated_link,
)
from specter.offload.link import EmulatedLink

BASE = ["num_prompts=1", "max_new_tokens=3", "warmup_tokens=0", "progress=false", f"assets_dir={FIXTURES / 'datasets'}",
        "method=offload_ar", "memory=low", "hardware=emulated", "hardware.threads=1"]


cli = cli_in_process


def test_records_have_the_ratio_columns():
    assert set(RATIO_COLUMNS) <= set(COLUMNS)


@pytest.mark.parametrize("step_s,off", [(1e-3, False), (1.2e-3, False), (0.7e-3, True), (2e-3, True)])
def test_effective_ratio_and_tolerance(step_s, off):
    r = EffectiveRatio(configured=0.7, layer_step_s=step_s, expert_load_s=0.7e-3, tolerance=0.25)
    assert r.effective == pytest.approx(0.7e-3 / step_s)
    assert r.off is off
    cols = r.columns()
    assert set(cols) == set(RATIO_COLUMNS) and cols["load_ratio_off"] == int(off)
    assert cols["layer_step_ms"] == pytest.approx(step_s * 1e3) and cols["load_ratio"] == 0.7


def test_nothing_configured_or_measured_stays_empty():
    pinned = EffectiveRatio(configured=None, layer_step_s=1e-3, expert_load_s=2e-3)
    assert pinned.effective == pytest.approx(2.0) and pinned.off is None
    assert pinned.columns()["load_ratio_off"] is None and pinned.columns()["load_ratio"] is None
    unprobed = EffectiveRatio(configured=0.7, layer_step_s=None, expert_load_s=2e-3)
    assert unprobed.effective is None and unprobed.off is None


def _link_and_params(load_s: float, ratio: float, nbytes: int) -> tuple[EmulatedLink, LinkParams]:
    link = EmulatedLink(bandwidth_bytes_per_s=nbytes / load_s)
    params = LinkParams("emulated", nbytes / load_s, 0.0, per_layer_step_s=load_s / ratio, expert_load_s=load_s,
                        load_ratio=ratio, calibrated=True, calibration_source="measured")
    return link, params


def test_monitor_measures_the_link_and_brackets_the_record_with_probes():
    load_s, n = 0.02, 4096
    link, params = _link_and_params(load_s, ratio=1.0, nbytes=n)
    steps = iter([0.02, 0.02, 0.06])  # warm-up probe, after record 1, after record 2 (the machine slowed down)
    try:
        monitor = LoadRatioMonitor(link, params, probe=lambda: next(steps), tolerance=0.25)
        src, dst = torch.ones(n // 4), torch.zeros(n // 4)
        for _ in range(3):
            link.submit(src, dst)
        first = monitor.record()  # three copies of ~20 ms, step 20 ms before and after
        assert load_s <= first.expert_load_s < 10 * load_s  # a busy machine stretches copies: measured, not assumed
        assert first.layer_step_s == pytest.approx(0.02)
        assert first.effective == pytest.approx(first.expert_load_s / 0.02)
        assert first.off is (first.effective > 1.25)
        second = monitor.record()  # no copy: the link's modelled load; step (20 + 60) / 2 ms
        assert second.expert_load_s == load_s and second.layer_step_s == pytest.approx(0.04)
        assert second.effective == pytest.approx(0.5) and second.off is True
    finally:
        link.close()


def test_recalibration_is_the_default_and_the_cache_a_fallback(tmp_path):
    path = tmp_path / "cal.json"
    measured = []
    measure = lambda: (measured.append(1), 2e-3)[1]
    p = calibrated_link(1000, 0.5, path, measure, recalibrate=True)
    assert p.calibration_source == "measured" and p.per_layer_step_s == 2e-3 and len(measured) == 1
    path.write_text(json.dumps({"per_layer_step_s": 4e-3}))
    p = calibrated_link(1000, 0.5, path, measure, recalibrate=False)
    assert p.calibration_source == "cached" and p.per_layer_step_s == 4e-3 and len(measured) == 1
    p = calibrated_link(1000, 0.5, path, measure, recalibrate=True)  # measures again, and updates the cache
    assert p.calibration_source == "measured" and json.loads(path.read_text())["per_layer_step_s"] == 2e-3


def test_emulated_profile_recalibrates_by_default():
    from conftest import compose

    hw = compose(["hardware=emulated"]).hardware
    assert hw.recalibrate is True and hw.load_ratio_tolerance == 0.25 and hw.ratio_probe_steps > 0


@pytest.mark.parametrize("probe_step_s,flagged", [(10e-3, False), (40e-3, True)], ids=["steady", "slowed"])
def test_a_run_whose_machine_slows_down_is_flagged(probe_step_s, flagged, monkeypatch, capsys, tmp_path,
                                                   tiny_checkpoint):
    """The warm-up calibrates a 10 ms layer step (r = 0.7: 7 ms per expert load); the in-run probe then
    finds the step unchanged (steady) or 4x slower (a CPU-bound process arrived: r ~ 0.18, flagged)."""
    tiny_checkpoint("tiny_qwen")
    monkeypatch.setattr(runtime, "specter_home", lambda: tmp_path / "home")
    monkeypatch.setattr(runtime, "measure_layer_step", lambda model, steps=24: 10e-3)
    monkeypatch.setattr(load_ratio, "measure_layer_step", lambda model, steps=24: probe_step_s)
    out = tmp_path / "run"
    rc, stdout, err = cli([*BASE, f"output_dir={out}"], capsys)
    assert rc == 0, err[-2000:]
    rec = pd.read_csv(out / "records.csv")
    assert rec.load_ratio.eq(0.7).all() and rec.layer_step_ms.eq(probe_step_s * 1e3).all()
    assert (rec.expert_load_ms >= 7.0).all()
    expected = rec.expert_load_ms / (probe_step_s * 1e3)
    assert rec.effective_load_ratio.to_numpy() == pytest.approx(expected.to_numpy(), rel=1e-3)
    assert rec.load_ratio_off.eq(int(flagged)).all()
    assert ("load_ratio_off=1" in err) is flagged
    summary = pd.read_csv(out / "summary.csv")
    assert summary.load_ratio_off.iloc[0] == int(flagged)
    assert summary.effective_load_ratio.iloc[0] == pytest.approx(rec.effective_load_ratio.mean())
    assert "layer step measured" in stdout


def test_target_only_records_leave_the_ratio_empty(capsys, tmp_path, tiny_checkpoint):
    tiny_checkpoint("tiny_qwen")
    out = tmp_path / "run"
    rc, _, err = cli([*BASE, "method=target_only", f"output_dir={out}"], capsys)
    assert rc == 0, err[-2000:]
    rec = pd.read_csv(out / "records.csv")
    assert rec[list(RATIO_COLUMNS)].isna().all().all()


@pytest.mark.parametrize("override,needle", [("hardware.load_ratio_tolerance=0", "load_ratio_tolerance"),
                                             ("hardware.ratio_probe_steps=-1", "ratio_probe_steps")])
def test_bad_ratio_settings_are_one_line(override, needle, capsys, tmp_path, monkeypatch):
    from specter.harness import run as run_mod

    monkeypatch.setattr(run_mod, "build_method", lambda *a, **k: pytest.fail("a model was loaded"))
    rc, out, err = cli([*BASE, override, f"output_dir={tmp_path / 'o'}"], capsys)
    assert rc == 2 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("specter: error:")]
    assert len(lines) == 1 and needle in lines[0]


def test_a_slow_link_on_a_busy_machine_is_not_refused(tmp_path):
    """r = 8 over a 30 ms layer step: a 0.2 MB expert takes 0.24 s (0.8 MB/s), a legitimate link."""
    p = calibrated_link(200_000, 8.0, tmp_path / "cal.json", lambda: 0.03, recalibrate=True)
    assert p.expert_load_s == pytest.approx(0.24) and p.bandwidth_bytes_per_s < 1e6
