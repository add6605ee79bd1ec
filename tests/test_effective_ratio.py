"""Every record carries the effective load ratio it ran under; a run off the configured ratio is flagged."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from conftest import FIXTURES, cli_in_process
from specter.assembly import load_ratio
from specter.assembly import runtime
from specter.records.records import COLUMNS
from specter.offload.calibrate import (
    RATIO_COLUMNS,
    EffectiveRatio,
    LinkParams,
    LoadRatioMonitor,
    calibrated_link,
)
from specter.offload.link import EmulatedLink

BASE = ["num_prompts=1", "max_new_tokens=3", "warmup_tokens=0", "progress=false", f"assets_dir={FIXTURES / 'datasets'}",
        "method=offload_ar", "memory=low", "hardware=emulated", "hardware.threads=1",
        "model.load_ratio=0.7"]  # a stated ratio: these tests time the link by hand


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


def _fake_probe(steps_ms: list[float]):
    """A layer-step probe that returns `steps_ms` in turn, then keeps the last (seconds)."""
    calls = []

    def probe(model, steps=24):
        calls.append(steps)
        return steps_ms[min(len(calls), len(steps_ms)) - 1] * 1e-3
    return probe, calls


@pytest.mark.parametrize("probe_step_s,flagged", [(10e-3, False), (40e-3, True)], ids=["steady", "slowed"])
def test_a_run_whose_machine_slows_down_is_flagged(probe_step_s, flagged, monkeypatch, capsys, tmp_path,
                                                   tiny_checkpoint):
    """The warm-up re-times the link to a 10 ms layer step (r = 0.7: 7 ms per expert load); the
    probes around the records then find the step unchanged (steady) or 4x slower (a CPU-bound
    process arrived: r ~ 0.18, flagged)."""
    tiny_checkpoint("tiny_qwen")
    monkeypatch.setattr(runtime, "specter_home", lambda: tmp_path / "home")
    monkeypatch.setattr(runtime, "measure_layer_step", lambda model, steps=24: 25e-3)  # cold, at build
    probe, _ = _fake_probe([10.0] * (1 + load_ratio.CALIBRATION_PROBES) + [probe_step_s * 1e3])
    monkeypatch.setattr(load_ratio, "measure_layer_step", probe)
    out = tmp_path / "run"
    rc, stdout, err = cli([*BASE, f"output_dir={out}"], capsys)
    assert rc == 0, err[-2000:]
    rec = pd.read_csv(out / "records.csv")
    step_ms = (10.0 + probe_step_s * 1e3) / 2  # the first record: warm-up step and the probe after it
    assert rec.load_ratio.eq(0.7).all() and rec.layer_step_ms.iloc[0] == pytest.approx(step_ms)
    assert (rec.expert_load_ms >= 7.0).all()
    assert rec.effective_load_ratio.iloc[0] == pytest.approx(rec.expert_load_ms.iloc[0] / step_ms, rel=1e-3)
    assert rec.load_ratio_off.eq(int(flagged)).all()
    assert ("load_ratio_off=1" in err) is flagged
    summary = pd.read_csv(out / "summary.csv")
    assert summary.load_ratio_off.iloc[0] == int(flagged)
    assert summary.effective_load_ratio.iloc[0] == pytest.approx(rec.effective_load_ratio.mean())
    assert "layer step measured" in stdout and "re-timed after the warm-up" in stdout


def test_the_link_is_re_timed_by_the_probe_that_measures_the_records(monkeypatch, capsys, tmp_path, tiny_checkpoint):
    """At build the model is cold (25 ms per layer step); after the warm-up the same probe that brackets
    the records finds 10 ms. The link follows the probe: records at r = 0.7, none flagged, and env.json
    and the calibration cache hold the warm-up step. (Calibrated at build only, every record ran at
    r = 1.75 and was flagged.)"""
    tiny_checkpoint("tiny_qwen")
    monkeypatch.setattr(runtime, "specter_home", lambda: tmp_path / "home")
    monkeypatch.setattr(runtime, "measure_layer_step", lambda model, steps=24: 25e-3)
    probe, calls = _fake_probe([30.0, 12.0, 10.0, 9.0, 10.0])  # one discarded (cold), then the median of three
    monkeypatch.setattr(load_ratio, "measure_layer_step", probe)
    out = tmp_path / "run"
    rc, _, err = cli([*BASE, "num_prompts=2", f"output_dir={out}"], capsys)
    assert rc == 0, err[-2000:]
    assert calls[: 1 + load_ratio.CALIBRATION_PROBES] == [load_ratio.PROBE_STEPS] * (1 + load_ratio.CALIBRATION_PROBES)
    rec = pd.read_csv(out / "records.csv")
    assert rec.layer_step_ms.to_numpy() == pytest.approx([10.0, 10.0])
    assert rec.load_ratio_off.eq(0).all() and "load_ratio_off=1" not in err
    assert rec.effective_load_ratio.to_numpy() == pytest.approx((rec.expert_load_ms / 10.0).to_numpy(), rel=1e-3)
    link = json.loads((out / "env.json").read_text())["method"]["link"]
    assert link["per_layer_step_s"] == pytest.approx(10e-3) and link["calibration_source"] == "warm-up probe"
    assert link["expert_load_s"] == pytest.approx(7e-3)
    cached = json.loads((tmp_path / "home" / "calibration").glob("*.json").__next__().read_text())
    assert cached["per_layer_step_s"] == pytest.approx(10e-3)


@pytest.mark.parametrize("override", ["hardware.recalibrate=false", "hardware.ratio_probe_steps=0",
                                      "hardware.bandwidth_gbps=0.5"])
def test_no_in_run_re_timing_when_the_user_pins_the_link(override, monkeypatch, capsys, tmp_path, tiny_checkpoint):
    tiny_checkpoint("tiny_qwen")
    monkeypatch.setattr(runtime, "specter_home", lambda: tmp_path / "home")
    monkeypatch.setattr(runtime, "measure_layer_step", lambda model, steps=24: 25e-3)
    probe, calls = _fake_probe([10.0])
    monkeypatch.setattr(load_ratio, "measure_layer_step", probe)
    out = tmp_path / "run"
    rc, stdout, err = cli([*BASE, override, f"output_dir={out}"], capsys)
    assert rc == 0, err[-2000:]
    assert "re-timed" not in stdout
    link = json.loads((out / "env.json").read_text())["method"]["link"]
    assert link["calibration_source"] != "warm-up probe"


def test_retune_changes_the_copies_that_follow():
    link = EmulatedLink(bandwidth_bytes_per_s=1e6, latency_s=0.0)
    try:
        assert link.transfer_seconds(1000) == pytest.approx(1e-3)
        link.retune(2e6, 1e-4)
        assert link.transfer_seconds(1000) == pytest.approx(6e-4)
        with pytest.raises(ValueError):
            link.retune(0, 0)
    finally:
        link.close()


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
    from specter.experiments import run as run_mod

    monkeypatch.setattr(run_mod, "build_method", lambda *a, **k: pytest.fail("a model was loaded"))
    rc, out, err = cli([*BASE, override, f"output_dir={tmp_path / 'o'}"], capsys)
    assert rc == 2 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("specter: error:")]
    assert len(lines) == 1 and needle in lines[0]


def test_a_slow_link_on_a_busy_machine_is_not_refused(tmp_path):
    """r = 8 over a 30 ms layer step: a 0.2 MB expert takes 0.24 s (0.8 MB/s), a legitimate link."""
    p = calibrated_link(200_000, 8.0, tmp_path / "cal.json", lambda: 0.03, recalibrate=True)
    assert p.expert_load_s == pytest.approx(0.24) and p.bandwidth_bytes_per_s < 1e6


def test_a_late_waking_link_thread_still_gives_modelled_copy_times():
    """On a virtual clock where every sleep wakes 0.4 ms late (the link thread waits for the GIL
    behind the decode loop): the link learns the lag and sleeps it off in advance, so 2 ms copies
    last 2 ms, not 2.4 ms. (Deterministic: the clock only moves when the link sleeps.)"""
    import threading

    class LateClock:
        def __init__(self):
            self.t, self.lock = 0.0, threading.Lock()

        def now(self) -> float:
            with self.lock:
                return self.t

        def sleep(self, s: float) -> None:
            with self.lock:
                self.t += s + 4e-4

    clock = LateClock()
    n, copies = 4096, 40
    link = EmulatedLink(bandwidth_bytes_per_s=n / 2e-3, clock=clock.now, sleep=clock.sleep)
    try:
        src, dst = torch.ones(n // 4), torch.zeros(n // 4)
        for _ in range(copies // 2):  # the lag is learned over the first copies
            link.submit(src, dst).wait()
        before = link.stats.busy_seconds
        for _ in range(copies // 2):
            link.submit(src, dst).wait()
        per_copy = (link.stats.busy_seconds - before) / (copies // 2)
    finally:
        link.close()
    assert 2e-3 <= per_copy < 2e-3 * 1.01, f"{per_copy * 1e3:.4f} ms per 2 ms copy"  # uncompensated: 2.4 ms


@pytest.mark.parametrize("retime", [True, False])
def test_the_link_follows_a_machine_that_drifts_between_records(retime, monkeypatch, capsys, tmp_path, tiny_checkpoint):
    """The step doubles during record 0 (10 -> 20 ms): that record is flagged either way; re-timed from
    its closing probe, records 1 and 2 load at 0.7 x 20 ms again, while a link timed once stays at
    0.7 x 10 ms (r = 0.35 against the new step: flagged)."""
    tiny_checkpoint("tiny_qwen")
    monkeypatch.setattr(runtime, "specter_home", lambda: tmp_path / "home")
    monkeypatch.setattr(runtime, "measure_layer_step", lambda model, steps=24: 10e-3)
    probe, _ = _fake_probe([10.0] * (1 + load_ratio.CALIBRATION_PROBES) + [20.0])
    monkeypatch.setattr(load_ratio, "measure_layer_step", probe)
    out = tmp_path / "run"
    rc, _, err = cli([*BASE, "num_prompts=3", f"hardware.retime_per_record={str(retime).lower()}",
                      f"output_dir={out}"], capsys)
    assert rc == 0, err[-2000:]
    rec = pd.read_csv(out / "records.csv").sort_values("prompt_index")
    assert rec.layer_step_ms.to_numpy() == pytest.approx([15.0, 20.0, 20.0])
    load = rec.expert_load_ms.to_numpy()  # measured: at least the modelled time, more on a busy machine
    if retime:  # re-timed to the 20 ms step after record 0: 14 ms per load
        assert load[0] >= 7.0 and (load[1:] >= 14.0).all()
        assert rec.load_ratio_off.iloc[0] == 1
    else:  # still timed for 10 ms: 7 ms per load against a 20 ms step, every record off
        assert (load >= 7.0).all() and (load[1:] < 14.0).all()
        assert rec.load_ratio_off.tolist() == [1, 1, 1]


def test_the_gil_switch_interval_is_short_while_links_are_open_and_restored_after():
    import sys

    from specter.offload.link import SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    a, b = EmulatedLink(1e9), EmulatedLink(1e9)
    try:
        assert sys.getswitchinterval() <= SWITCH_INTERVAL_S
        a.close()
        assert sys.getswitchinterval() <= SWITCH_INTERVAL_S  # b still runs
    finally:
        a.close()
        b.close()
    assert sys.getswitchinterval() == before
    b.close()  # closing twice releases nothing twice
    assert sys.getswitchinterval() == before
