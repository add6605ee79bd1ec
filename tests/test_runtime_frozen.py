"""The runtime and its link parameters are values: re-timing the link gives a new runtime, the old one is unchanged."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from specter.offload.calibrate import LinkParams, link_for_step
from specter.offload.link import EmulatedLink
from specter.offload.runtime import Runtime

EXPERT_BYTES = 4096


def _runtime(link: EmulatedLink, params: LinkParams) -> Runtime:
    om = SimpleNamespace(store=SimpleNamespace(nbytes_per_expert=EXPERT_BYTES))  # all recalibration reads of the model
    return Runtime(om=om, cache=None, link=link, moe=None, link_params=params, footprint=None, budget_bytes=0, resident=1)


@pytest.fixture
def calibrated():
    params = link_for_step(EXPERT_BYTES, 0.7, 10e-3, None, None, "measured")
    link = EmulatedLink(params.bandwidth_bytes_per_s, params.latency_s)
    yield link, params
    link.close()


def test_fields_cannot_be_assigned(calibrated):
    link, params = calibrated
    rt = _runtime(link, params)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rt.resident = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        rt.link_params = LinkParams("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.per_layer_step_s = 1.0


def test_recalibration_returns_a_new_runtime_and_leaves_the_old_one(calibrated):
    link, params = calibrated
    rt = _runtime(link, params)
    before = dataclasses.asdict(params)
    new = rt.recalibrate_link(20e-3, None, "warm-up probe")
    assert new is not rt and new.link_params is not params
    assert rt.link_params is params and dataclasses.asdict(params) == before  # the old value is untouched
    assert new.link_params.per_layer_step_s == pytest.approx(20e-3)
    assert new.link_params.expert_load_s == pytest.approx(0.7 * 20e-3)
    assert new.link_params.calibration_source == "warm-up probe" and new.link_params.load_ratio == 0.7
    assert new.link is link and new.resident == rt.resident  # everything else is shared
    # the shared link was re-tuned explicitly: its copies now follow the new parameters
    assert link.transfer_seconds(EXPERT_BYTES) == pytest.approx(new.link_params.expert_load_s)


def test_only_a_ratio_calibrated_emulated_link_is_recalibrated(calibrated):
    link, _ = calibrated
    pinned = _runtime(link, LinkParams("emulated", 1e6, 0.0, expert_load_s=4e-3))
    with pytest.raises(ValueError, match="recalibrated"):
        pinned.recalibrate_link(20e-3, None, "warm-up probe")


def test_the_monitor_judges_the_next_record_by_the_parameters_retime_returns(calibrated):
    from specter.offload.calibrate import LoadRatioMonitor

    link, params = calibrated
    rt = [_runtime(link, params)]

    def retime(step):
        rt[0] = rt[0].recalibrate_link(step, None, "record probe")
        return rt[0].link_params

    steps = iter([10e-3, 20e-3, 20e-3])
    monitor = LoadRatioMonitor(link, params, probe=lambda: next(steps), retime=retime)
    first = monitor.record()  # no copies: the modelled load of the link it ran on (timed for 10 ms)
    assert first.expert_load_s == pytest.approx(0.7 * 10e-3)
    second = monitor.record()  # re-timed after the first record to the 20 ms step
    assert second.expert_load_s == pytest.approx(0.7 * 20e-3)
    assert params.expert_load_s == pytest.approx(0.7 * 10e-3)
