"""Calibrate the emulated link: one expert load costs `load_ratio` x one layer's decode step.

The ratio is what PCIe 4.0 has to an A100 layer step for the real model (~0.7 for
DeepSeek-V2-Lite and Qwen1.5-MoE, ~6 for Phi-3.5-MoE; an estimate). The layer step is measured
on the running machine once and cached (a JSON file the caller names), so every method of a
benchmark sees the same link.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specter.paths import atomic_write_text

GB = 1e9
# Bounds that keep a bad calibration or override from hanging a run (or making loads free).
MIN_BANDWIDTH_BYTES_PER_S = 1e6
MAX_LATENCY_S = 1.0
MAX_EXPERT_LOAD_S = 5.0


class CalibrationError(ValueError):
    """A link calibration file is unreadable, or the link parameters are out of bounds."""


@dataclass
class LinkParams:
    kind: str  # "cpu" | "emulated" | "cuda"
    bandwidth_bytes_per_s: float | None = None
    latency_s: float | None = None
    per_layer_step_s: float | None = None
    expert_load_s: float | None = None
    load_ratio: float | None = None
    calibrated: bool = False
    calibration_file: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_layer_step(model: torch.nn.Module, steps: int = 24) -> float:
    """Median one-token decode step of a model with every weight on its device, per layer."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids = torch.arange(16, device=device)[None]  # [1, 16]
    times = []
    with torch.inference_mode():
        for _ in range(3):
            cache = DynamicCache(config=model.config)
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

    `measure()` returns the per-layer step in seconds; it runs only when the cache is absent or
    `recalibrate` is set.
    """
    if calibration_file.exists() and not recalibrate:
        per_layer = read_calibration(calibration_file)
    else:
        per_layer = float(measure())
        atomic_write_text(calibration_file, json.dumps({"per_layer_step_s": per_layer, "measured": time.strftime("%F %T")}))
    load_s = load_ratio * per_layer
    latency = float(latency_us) * 1e-6 if latency_us is not None else 0.05 * load_s
    bandwidth = expert_bytes / max(load_s - latency, 1e-9)
    try:
        return _checked(LinkParams("emulated", bandwidth, latency, per_layer, load_s, load_ratio, calibrated=True,
                                   calibration_file=str(calibration_file)))
    except CalibrationError as err:
        raise CalibrationError(
            f"{err} (link calibration {calibration_file}: layer step {per_layer:.3g} s x load_ratio {load_ratio}); "
            "rerun with hardware.recalibrate=true, or fix hardware.bandwidth_gbps") from None


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
