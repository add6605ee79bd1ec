"""The effective load ratio of every record: what the emulated link ran under, measured in the run.

`model.load_ratio` says how long one expert load should take relative to one layer's decode step.
The link is calibrated from a layer step measured in the run's warm-up, but a machine that gets
busier (or quieter) while a run goes on changes the step and not the link. So every record also
carries the ratio it actually ran under, measured by `specter.offload.calibrate.LoadRatioMonitor`:
the link's mean expert-load time during the record over the layer step probed just before and
just after it (outside timing), next to the configured ratio; a record off by more than
`hardware.load_ratio_tolerance` (relative) is flagged in `load_ratio_off` and warned about.

The link is timed twice. Building the runtime calibrates it from a first layer step (the model
is cold then; the warm-up needs a link), and right after the warm-up `calibrate_after_warmup`
re-times it from the median of `CALIBRATION_PROBES` probes (after one discarded: the probe model
runs cold after the build): the same probe, in the same process
state, that then brackets every record, so a quiet run's records agree with their own link.
The probe (`measure_layer_step`: one-token decode steps of the plain model with every weight on
the device, per layer) runs on a copy of the model kept for the run; `hardware.ratio_probe_steps=0`
skips it (no in-run recalibration; the layer step is then the build-time calibration's). With
`hardware.retime_per_record` (the default) each record's closing probe also re-times the link for
the next record: a machine that drifts by 15 % over a minute (this 2-core VM does) then moves the
link with it, and a record is flagged only when the step changed while it ran.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from specter.offload.calibrate import (
    DEFAULT_TOLERANCE,
    RATIO_COLUMNS,
    EffectiveRatio,
    LinkParams,
    LoadRatioMonitor,
    measure_layer_step,
    write_calibration,
)

PROBE_STEPS = 36  # one-token decode steps per in-run probe (3 rounds of 12; the median is kept)
CALIBRATION_PROBES = 3  # probes whose median re-times the link after the warm-up


@lru_cache(maxsize=1)
def probe_model(checkpoint: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The plain model with every weight on the device, loaded once for a run's calibration and probes
    (the last one is kept: a sweep over one model loads it once)."""
    from specter.models.loading import load_full_model

    return load_full_model(checkpoint, dtype, device)


@lru_cache(maxsize=1)
def _compact_probe(checkpoint: Path, dtype: torch.dtype, device: torch.device) -> Any:
    from specter.models.compact import build_compact

    return build_compact(probe_model(checkpoint, dtype, device), max_length=64)


def probe_decoder(checkpoint: Path, dtype: torch.dtype, device: torch.device, decode_path: str = "hf") -> Any:
    """What the layer-step probe decodes with: the plain model on the run's own decode path (the
    compact decoder's step is several times shorter, and r is relative to the step the run takes)."""
    if decode_path == "compact":
        return _compact_probe(checkpoint, dtype, device)
    return probe_model(checkpoint, dtype, device)


class RecordRatios:
    """Per-record load-ratio columns of one run (empty columns where the method has no emulated link)."""

    def __init__(self, monitor: LoadRatioMonitor | None, warn: Callable[[str], None] | None = None):
        self.monitor = monitor
        self.warn = warn or (lambda msg: print(f"specter: warning: {msg}", file=sys.stderr, flush=True))
        self.flagged = 0

    def columns(self, what: str) -> dict[str, Any]:
        """Measure the record that just finished (`what` names it in the warning) -> RATIO_COLUMNS."""
        if self.monitor is None:
            return dict.fromkeys(RATIO_COLUMNS)
        ratio = self.monitor.record()
        if ratio.off:
            self.flagged += 1
            self.warn(f"{what} ran at an {ratio.describe()}; flagged (load_ratio_off=1)")
        return ratio.columns()


def _probe_steps(cfg: DictConfig) -> int:
    steps = cfg.hardware.get("ratio_probe_steps")
    return int(steps if steps is not None else PROBE_STEPS)


def _layer_step_probe(cfg: DictConfig, checkpoint: Path, method: Any) -> Callable[[], float] | None:
    steps = _probe_steps(cfg)
    if steps <= 0:
        return None
    model = probe_decoder(checkpoint, method.dtype, method.device, method.spec.decode_path)
    return lambda: measure_layer_step(model, steps=steps)


def calibrate_after_warmup(cfg: DictConfig, checkpoint: Path, method: Any) -> float | None:
    """Re-time the method's emulated link from the layer step probed now, right after its warm-up
    (the per-record monitor's probe, median of CALIBRATION_PROBES) -> that step in seconds; None
    where nothing is recalibrated (no emulated link, a pinned bandwidth, recalibrate=false, no probe)."""
    rt = method.rt
    params: LinkParams | None = getattr(rt, "link_params", None)
    if params is None or params.kind != "emulated" or not params.calibrated or not cfg.hardware.get("recalibrate"):
        return None
    probe = _layer_step_probe(cfg, checkpoint, method)
    if probe is None:
        return None
    built = params.per_layer_step_s
    probe()  # discarded: the probe model's first steps since the build run cold
    step = statistics.median(probe() for _ in range(CALIBRATION_PROBES))
    params = method.retime_link(step, cfg.hardware.get("latency_us"), "warm-up probe")
    if params.calibration_file:
        write_calibration(Path(params.calibration_file), step)
    print(f"emulated link re-timed after the warm-up: layer step {step * 1e3:.3f} ms (at build {built * 1e3:.3f} ms) "
          f"x load_ratio {params.load_ratio:.3g} -> expert load {params.expert_load_s * 1e3:.3f} ms", flush=True)
    return step


def run_load_ratios(cfg: DictConfig, checkpoint: Path, method: Any, calibrated_step_s: float | None = None) -> RecordRatios:
    """The per-record monitor of a run, started right after its warm-up; its first layer step is
    `calibrated_step_s` (what `calibrate_after_warmup` measured) or a probe of its own."""
    rt = method.rt
    params: LinkParams | None = getattr(rt, "link_params", None)
    if rt is None or params is None:  # target_only, engine baselines: no link of ours
        return RecordRatios(None)
    tolerance = float(cfg.hardware.get("load_ratio_tolerance") or DEFAULT_TOLERANCE)
    probe = retime = None
    if params.kind == "emulated":
        probe = _layer_step_probe(cfg, checkpoint, method)
        if probe is None and params.per_layer_step_s:
            probe = lambda: method.rt.link_params.per_layer_step_s
        if calibrated_step_s is not None and cfg.hardware.get("retime_per_record"):
            latency_us = cfg.hardware.get("latency_us")
            retime = lambda step: method.retime_link(step, latency_us, "record probe")
    return RecordRatios(LoadRatioMonitor(rt.link, params, probe, tolerance, first_step_s=calibrated_step_s,
                                         retime=retime))


def ratio_summary(records) -> dict[str, Any]:
    """Mean effective ratio, its range and the flagged count of a set of records (a DataFrame)."""
    eff = records["effective_load_ratio"].dropna() if "effective_load_ratio" in records else []
    off = records["load_ratio_off"].dropna() if "load_ratio_off" in records else []
    return {"effective_load_ratio": float(eff.mean()) if len(eff) else None,
            "effective_load_ratio_min": float(eff.min()) if len(eff) else None,
            "effective_load_ratio_max": float(eff.max()) if len(eff) else None,
            "load_ratio_off": int(off.sum()) if len(off) else None}


__all__ = ["CALIBRATION_PROBES", "EffectiveRatio", "PROBE_STEPS", "RecordRatios", "calibrate_after_warmup", "probe_decoder",
           "probe_model", "ratio_summary", "run_load_ratios"]
