"""Calibrate the emulated link: one expert load costs `load_ratio` x one layer's decode step.

The ratio is what the projection's cost model gives the real model on a device file: one expert's
H2D over one draft layer step (`specter.projection.link_ratio`; ~3.8 for DeepSeek-V2-Lite, ~3.5 for
Qwen1.5-MoE, ~30 for Phi-3.5-MoE on the paper's A100 over PCIe 4.0). By default the layer step is
measured again in each run's warm-up (`recalibrate=True`), so the link a run uses follows the
machine as it is at that moment; the last measurement is cached (a JSON file the caller names)
and is what a run with `recalibrate=False` reuses.

What a run actually ran under is measured too: :class:`LoadRatioMonitor` divides the link's mean
expert-load time during a record by the layer step probed around it, the record's *effective*
load ratio, and flags a record whose effective ratio is off the configured one by more than a
relative tolerance.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from specter.paths import atomic_write_text

GB = 1e9
# Bounds that keep a bad calibration or override from hanging a run (or making loads free). The
# expert-load bound is what keeps a run finite; the bandwidth floor is only a sanity bound (a tiny
# model's 0.2 MB expert at r = 8 on a busy machine, 30 ms per layer step, needs 0.8 MB/s).
MIN_BANDWIDTH_BYTES_PER_S = 1e4
MAX_LATENCY_S = 1.0
MAX_EXPERT_LOAD_S = 5.0


class CalibrationError(ValueError):
    """A link calibration file is unreadable, or the link parameters are out of bounds."""


@dataclass(frozen=True)
class LinkParams:
    kind: str  # "cpu" | "emulated" | "cuda"
    bandwidth_bytes_per_s: float | None = None
    latency_s: float | None = None
    per_layer_step_s: float | None = None
    expert_load_s: float | None = None
    load_ratio: float | None = None
    calibrated: bool = False
    calibration_file: str | None = None
    calibration_source: str | None = None  # "measured" (in this run) | "cached" (an earlier run's step)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_layer_step(model: Any, steps: int = 24) -> float:
    """Median one-token decode step of a model with every weight on its device, per layer: a
    transformers model, or the compact decoder over one (the step of the decode path a run uses)."""
    from transformers import DynamicCache

    device = model.device if hasattr(model, "new_cache") else next(model.parameters()).device
    ids = torch.arange(16, device=device)[None]  # [1, 16]
    times = []
    with torch.inference_mode():
        for _ in range(3):
            cache = model.new_cache(16 + steps) if hasattr(model, "new_cache") else DynamicCache(config=model.config)
            model(input_ids=ids, cache=cache)
            tok = ids[:, -1:]
            for _ in range(steps // 3):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                model(input_ids=tok, cache=cache)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
    return statistics.median(times) / model.config.num_hidden_layers


def fixed_link(expert_bytes: int, bandwidth_gbps: float, latency_us: float | None) -> LinkParams:
    """An emulated link with user-given parameters (no measurement)."""
    bw = float(bandwidth_gbps) * GB
    lat = float(latency_us or 0) * 1e-6
    return _checked(LinkParams("emulated", bw, lat, expert_load_s=lat + expert_bytes / bw))


def calibrated_link(expert_bytes: int, load_ratio: float, calibration_file: Path, measure,
                    latency_us: float | None = None, recalibrate: bool = False) -> LinkParams:
    """Link parameters so one expert load takes `load_ratio` x the (cached) per-layer step.

    `measure()` returns the per-layer step in seconds; it runs when `recalibrate` is set (the
    default of hardware=emulated: every run measures its own step) or when the cache is absent;
    otherwise the cached step of an earlier run is reused (a fallback).
    """
    if calibration_file.exists() and not recalibrate:
        per_layer, source = read_calibration(calibration_file), "cached"
    else:
        per_layer, source = float(measure()), "measured"
        write_calibration(calibration_file, per_layer)
    return link_for_step(expert_bytes, load_ratio, per_layer, latency_us, str(calibration_file), source)


def link_for_step(expert_bytes: int, load_ratio: float, per_layer_step_s: float, latency_us: float | None,
                  calibration_file: str | None, source: str) -> LinkParams:
    """The emulated link on which one expert load takes `load_ratio` x `per_layer_step_s`."""
    load_s = load_ratio * per_layer_step_s
    latency = float(latency_us) * 1e-6 if latency_us is not None else 0.05 * load_s
    bandwidth = expert_bytes / max(load_s - latency, 1e-9)
    try:
        return _checked(LinkParams("emulated", bandwidth, latency, per_layer_step_s, load_s, load_ratio, calibrated=True,
                                   calibration_file=calibration_file, calibration_source=source))
    except CalibrationError as err:
        raise CalibrationError(
            f"{err} (link calibration {calibration_file}: layer step {per_layer_step_s:.3g} s x load_ratio "
            f"{load_ratio}); rerun with hardware.recalibrate=true, or fix hardware.bandwidth_gbps") from None


def write_calibration(path: Path, per_layer_step_s: float) -> None:
    atomic_write_text(path, json.dumps({"per_layer_step_s": per_layer_step_s, "measured": time.strftime("%F %T")}))


def read_calibration(path: Path) -> float:
    try:
        value = json.loads(path.read_text())["per_layer_step_s"]
        if not isinstance(value, (int, float)) or not 0 < value < 10:
            raise ValueError(f"per_layer_step_s={value!r} is not a plausible step time")
        return float(value)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CalibrationError(
            f"link calibration {path} is unreadable ({type(err).__name__}: {err}); rerun with "
            f"hardware.recalibrate=true or delete the file") from None


def _checked(p: LinkParams) -> LinkParams:
    if p.expert_load_s is not None and p.expert_load_s > MAX_EXPERT_LOAD_S:
        raise CalibrationError(f"one expert load would take {p.expert_load_s:.3g} s (> {MAX_EXPERT_LOAD_S} s); "
                               "check model.load_ratio / hardware.bandwidth_gbps")
    if p.bandwidth_bytes_per_s is not None and p.bandwidth_bytes_per_s < MIN_BANDWIDTH_BYTES_PER_S:
        raise CalibrationError(f"emulated link bandwidth {p.bandwidth_bytes_per_s:.3g} B/s is below the "
                               f"{MIN_BANDWIDTH_BYTES_PER_S:.0e} B/s bound")
    if p.latency_s is not None and not 0 <= p.latency_s <= MAX_LATENCY_S:
        raise CalibrationError(f"emulated link latency {p.latency_s:.3g} s is outside [0, {MAX_LATENCY_S}] s")
    return p


# --------------------------------------------------------------------------- effective ratio
DEFAULT_TOLERANCE = 0.25  # relative: a record is flagged when |effective / configured - 1| > this
RATIO_COLUMNS = ("load_ratio", "effective_load_ratio", "layer_step_ms", "expert_load_ms", "load_ratio_off")


@dataclass(frozen=True)
class EffectiveRatio:
    """What one record ran under: the link's mean expert load over the layer step measured around it.

    `configured` is the ratio the link was calibrated for (None when nothing set it from a ratio:
    a pinned `bandwidth_gbps`, a real GPU); `layer_step_s` is None when no step was measured."""

    configured: float | None
    layer_step_s: float | None
    expert_load_s: float | None
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def effective(self) -> float | None:
        if self.layer_step_s is None or self.expert_load_s is None or self.layer_step_s <= 0:
            return None
        return self.expert_load_s / self.layer_step_s

    @property
    def off(self) -> bool | None:
        """True when the effective ratio is outside the tolerance of the configured one."""
        eff = self.effective
        if eff is None or not self.configured:
            return None
        return abs(eff / self.configured - 1.0) > self.tolerance

    def columns(self) -> dict[str, float | int | None]:
        """The record columns (RATIO_COLUMNS); what was not measured stays empty."""
        off = self.off
        ms = lambda s: None if s is None else round(s * 1e3, 6)
        eff = self.effective
        return {"load_ratio": self.configured, "effective_load_ratio": None if eff is None else round(eff, 4),
                "layer_step_ms": ms(self.layer_step_s), "expert_load_ms": ms(self.expert_load_s),
                "load_ratio_off": None if off is None else int(off)}

    def describe(self) -> str:
        return (f"effective load ratio {self.effective:.3g} (expert load {self.expert_load_s * 1e3:.3g} ms / "
                f"layer step {self.layer_step_s * 1e3:.3g} ms) against the configured {self.configured:g}, "
                f"outside the ±{self.tolerance:.0%} tolerance")


class LoadRatioMonitor:
    """Measures every record's effective load ratio on a link.

    The expert-load time is the link's busy time per copy over the record (its modelled time when
    the record copied nothing); the layer step is the mean of two probes, one just before the
    record (the warm-up probe for the first, or `first_step_s`) and one just after, both outside
    timing. `probe` returns a per-layer step in seconds (None: no probe, the layer step stays empty).
    `retime` (optional) re-times the link from each closing probe and returns the new parameters,
    so a machine that drifts during a run moves the link with it and each record is judged against
    the step it was timed from.
    """

    def __init__(self, link: Any, params: LinkParams, probe: Callable[[], float] | None = None,
                 tolerance: float = DEFAULT_TOLERANCE, first_step_s: float | None = None,
                 retime: Callable[[float], LinkParams] | None = None):
        if not tolerance > 0:
            raise ValueError(f"load-ratio tolerance must be > 0, got {tolerance}")
        self.link = link
        self.params = params
        self.probe = probe
        self.tolerance = float(tolerance)
        self.retime = retime  # called with each record's closing probe: the next record's link follows it
        self.configured = float(params.load_ratio) if params.calibrated and params.load_ratio else None
        # the step right after the warm-up (given: the in-run calibration just measured it)
        self.warmup_step_s = first_step_s if first_step_s is not None else probe() if probe is not None else None
        self._last_step_s = self.warmup_step_s
        self._busy, self._copies = self._link_state()

    def _link_state(self) -> tuple[float, int]:
        if self.link is None:
            return 0.0, 0
        self.link.synchronize()  # copies still in flight count toward the record that submitted them
        stats = self.link.stats
        return stats.busy_seconds, stats.copies

    def record(self) -> EffectiveRatio:
        """The ratio of the record that ran since the previous call (or since the monitor started)."""
        busy, copies = self._link_state()
        d_busy, d_copies = busy - self._busy, copies - self._copies
        self._busy, self._copies = busy, copies
        load = d_busy / d_copies if d_copies > 0 else self.params.expert_load_s
        step = None
        if self.probe is not None:
            after = self.probe()
            step = (self._last_step_s + after) / 2 if self._last_step_s is not None else after
            self._last_step_s = after
            if self.retime is not None:
                self.params = self.retime(after)  # the next record runs on these
        return EffectiveRatio(self.configured, step, load, self.tolerance)
