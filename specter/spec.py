"""What one method run is, as typed frozen values: the only thing the engine is built from.

The harness turns the composed config into a `MethodSpec` exactly once
(`specter.assembly.runtime.method_spec`); a baseline is that spec with its own fields replaced
(`dataclasses.replace`) plus the public pieces it swaps (drafter, planner, expert filter).
`MethodSpec.record()` is what env.json records under "spec".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from specter.models.loading import DTYPES
from specter.offload.budget import STAGING_PER_LAYER
from specter.predict.planner import PlannerConfig
from specter.speculative.sampling import SamplingParams


@dataclass(frozen=True)
class LinkSpec:
    """The transfer link: `kind` (emulated | cuda | immediate) and, for an emulated link, either a fixed
    bandwidth/latency or a calibration target (one expert load = `load_ratio` × a layer's decode step)."""

    kind: str = "immediate"
    bandwidth_gbps: float | None = None
    latency_us: float | None = None
    load_ratio: float = 1.0
    recalibrate: bool = False
    load_ratio_source: str = ""  # where load_ratio comes from (the cost model and device file, or model.load_ratio)


@dataclass(frozen=True)
class BudgetSpec:
    """The tier's device budget: absolute bytes, or a fraction of the whole model's bytes."""

    bytes: int | None = None
    fraction: float | None = None

    def resolve(self, full_model_bytes: int) -> int:
        if self.bytes is not None:
            return int(self.bytes)
        return int(float(self.fraction or 1.0) * full_model_bytes)


@dataclass(frozen=True)
class CalibrationSpec:
    """Where a GPTQ draft's calibration prompts come from: the run's own datasets, after the prompts
    it evaluates (so no measured prompt calibrates its own draft)."""

    prompts: int = 16  # calibration prompts in all, split over the datasets
    datasets: tuple[str, ...] = ()
    evaluated: int = 0  # prompts per dataset the run evaluates
    assets_dir: str = "assets"
    allow_hub: bool = False


@dataclass(frozen=True)
class MethodSpec:
    """A method run, typed: model and tier, device, speculation, prefetch, cache sizing, link, budget."""

    method: str
    model: str
    memory: str
    device: str = "cpu"
    dtype: str = "float32"
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # speculation (K = 0: autoregressive)
    K: int = 0
    quant: str | None = None  # draft experts: gptq | rtn (None: no draft)
    calibration: CalibrationSpec = field(default_factory=CalibrationSpec)  # quant=gptq
    draft_kernel: str = "auto"
    draft_bits: int = 4  # GPTQ draft precision (the paper: 4); a proxy's calibrated acceptance may set fewer
    draft_group_size: int = 128
    prefetch: str = "adaptive"  # planner policy (see specter.predict.planner.POLICIES)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    planner_state: str = "warm"  # warm | cold | carry
    residency: str = "lru"  # the expert cache's residency policy: lru | window (specter.offload.policy)
    schedule: str = "expert"  # verification schedule: expert | token
    decode_path: str = "hf"  # single-request forwards: hf (transformers' modules) | compact (specter.models.compact)
    # | compiled (the compact decoder, its one-token step traced by torch.compile; target_only only)
    # the device cache
    resident: int = 1  # M: slots per MoE layer
    staging: int | None = None  # staging buffers shared by all layers (None: the one rule, offload.budget.staging_buffers)
    staging_per_layer: float = STAGING_PER_LAYER  # the cap of `staging=None`, per MoE layer
    plan_cap: int | None = None  # at most this many experts per layer in a window's plan (a verifier's budget)
    planned: Any = None  # a tiny model's slots and staging from the real model's plan (assembly.real_plan.PlannedSlots)
    budget: BudgetSpec = field(default_factory=BudgetSpec)
    link: LinkSpec = field(default_factory=LinkSpec)
    sequence_tokens: int = 0  # prefix + new tokens a request holds in KV (before the K+1 window)
    batch_sizes: tuple[int, ...] = (1,)  # experiment=batch: the sizes the device layout must hold
    # checks
    verify_lossless: bool = False
    tie_tolerance: float = 0.0
    # measurement
    trace_windows: bool = False  # record every window's pipeline events (trace.csv.gz; host-timed links)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def describe(self) -> str:
        """The run in a few words, for budget refusals."""
        return f"{self.model} {self.method} at memory={self.memory} (M={self.resident})"

    def record(self) -> dict[str, Any]:
        """The spec as env.json records it (plain values only)."""
        out = asdict(self)
        out["batch_sizes"] = list(self.batch_sizes)
        out["calibration"]["datasets"] = list(self.calibration.datasets)
        return out


def extend_spec(base: MethodSpec, cls: type[MethodSpec], **extra: Any) -> MethodSpec:
    """`base` as the spec subclass `cls` (a baseline's own typed fields, `extra`, beside the common ones)."""
    return cls(**{f.name: getattr(base, f.name) for f in fields(base)}, **extra)
