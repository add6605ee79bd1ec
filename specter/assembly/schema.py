"""Typed schema of the run configuration (Hydra structured configs).

Every YAML file under conf/ is merged onto one of these dataclasses, so a misspelt key or a
value of the wrong type (`temperature=abc`, `hardware.threads=x`) fails at composition with
Hydra's own one-line message, before anything loads. `???` marks values a user must give.
Choices (datasets, links, dtypes, policies, ...) are listed once, in the engine module that
implements them, and checked by `specter.assembly.config.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


@dataclass
class TierConfig:
    resident_experts: int = MISSING  # M: device slots per MoE layer
    budget_gb: Optional[float] = None  # device budget of a real model (GB)
    budget_fraction: Optional[float] = None  # tiny models: budget as a fraction of the full footprint


@dataclass
class ModelConfig:
    name: str = MISSING
    source: str = MISSING  # "tiny" (built locally) | "hub" (real weights)
    num_experts: Optional[int] = None  # routed experts per layer; null = the checkpoint's (a stated value must match it)
    top_k: Optional[int] = None  # experts per token; null = the checkpoint's (a stated value must match it)
    K: int = MISSING  # the model's default speculation depth (the paper's profiled K)
    context_length: int = MISSING
    # (one expert load over the real link) / (one layer's draft step); null = from the cost model of `real`
    # (or this model) on hardware.device_model (specter/projection/link_ratio.py)
    load_ratio: Optional[float] = None
    tiers: dict[str, TierConfig] = field(default_factory=dict)
    trained: bool = False  # tiny models: the briefly trained variant
    # the GPTQ draft's precision in the INT4 layout: the paper's 4 bits, groups of 128; a tiny model states the
    # bits that put its draft's acceptance where the real one's is (docs/tiny_models.md, "Acceptance")
    draft_bits: int = 4
    draft_group_size: int = 128
    real: Optional[str] = None  # tiny models: the real model mirrored
    hf_id: Optional[str] = None
    revision: Optional[str] = None
    local_dir: Optional[str] = None
    published: dict[str, Any] = field(default_factory=dict)  # hub models: the published checkpoint's facts


@dataclass
class MemoryConfig:
    name: str = MISSING
    budget_mb: Optional[float] = None  # overrides the model's tier budget
    resident_experts: Optional[int] = None  # overrides the model's tier M
    # a tiny model's cache sizes: real_plan (each method's slots and staging as experiment=plan gives the real
    # model at this tier; specter/assembly/real_plan.py) | budget (each method sizes itself in the tiny tier's bytes)
    slots: str = "real_plan"


@dataclass
class DatasetConfig:
    name: str = MISSING


@dataclass
class HardwareConfig:
    name: str = MISSING
    device: str = MISSING  # torch device: cpu | cuda
    dtype: str = MISSING  # float32 | float16 | bfloat16
    link: str = MISSING  # cpu | emulated | cuda
    threads: Optional[int] = None  # torch compute threads (null = torch default)
    bandwidth_gbps: Optional[float] = None  # emulated link: fixed bandwidth (null = calibrate)
    latency_us: Optional[float] = None  # emulated link: fixed latency (null = 5% of a load)
    recalibrate: bool = True  # emulated link: measure the layer step in this run's warm-up (false: reuse the cached one)
    retime_per_record: bool = True  # emulated link: re-time it before each record from the probe just taken (the machine drifts)
    load_ratio_tolerance: float = 0.25  # a record whose effective load ratio is off the configured one by more (relative) is flagged
    ratio_probe_steps: int = 36  # decode steps of the in-run layer-step probe around each record (0: no probe)
    draft_kernel: str = "auto"  # INT4 draft MoE kernel on CUDA: auto | triton | marlin | torch
    device_model: str = "a100_40gb_pcie4"  # the device file (specter/projection/devices/) the emulated link's default load ratio models
    gpu_memory_gb: Optional[float] = None  # experiment=plan: the GPU's memory in GB (null = an A100 40 GB)


@dataclass
class MethodConfig:
    name: str = MISSING
    runner: str = MISSING  # "package.module:Class" implementing specter.assembly.methods.Method
    speculative: bool = False
    decode_path: str = "hf"  # single-request decoding: hf (transformers modules) | compact (specter.models.compact)
    # | compiled (the compact decoder, its one-token step traced by torch.compile; target_only only)


@dataclass
class OffloadMethodConfig(MethodConfig):
    """A method that owns an expert cache on the offloading runtime (offload_ar, mo_sc, mo_sm,
    specmoeoff, specter, moe_spec): one staging rule for all of them (offload.budget.staging_buffers)."""

    schedule: str = "expert"  # target-mode schedule: expert | token
    staging_buffers: Optional[int] = None  # extra expert buffers shared by all layers; null = what the budget fits
    staging_per_layer: float = 1.2  # automatic count: at most this many per MoE layer (the paper's artifact: 32 for 26-27 layers)


@dataclass
class SpecterMethodConfig(OffloadMethodConfig):
    speculative: bool = True
    quant: str = "gptq"  # gptq | rtn
    calibration_prompts: int = 16
    prefetch: str = "adaptive"  # adaptive | none | early | late | oracle
    planner_state: str = "warm"  # warm | cold | carry
    residency: str = "window"  # expert cache residency: window (window-aware, specter.offload.policy) | lru
    planner: dict[str, float] = field(default_factory=dict)  # PlannerConfig overrides
    trace_windows: bool = False  # write every window's pipeline events to trace.csv.gz (host-timed links)


@dataclass
class KSweepConfig:
    values: list[int] = field(default_factory=lambda: [2, 4, 6, 8, 12, 16, 20, 24, 32, 48, 64, 96])


@dataclass
class BatchConfig:
    """experiment=batch: batch sizes; every size decodes the same prompts per dataset (`num_prompts`, at
    least the largest size), B at a time."""

    sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])


@dataclass
class LoadRatioSweepConfig:
    """experiment=load_ratio_sweep: TPOT of each method against the emulated link's load ratio r."""

    ratios: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0, 2.0, 4.0, 8.0])
    methods: list[str] = field(default_factory=lambda: ["target_only", "offload_ar", "mo_sm", "specmoeoff", "specter"])
    tiers: list[str] = field(default_factory=lambda: ["high", "low"])
    models: Optional[list[str]] = None  # null = the run's model
    # named per-model points added to `ratios`: legacy (the old hand estimate 0.7 / 6) and device (the cost
    # model on hardware.device_model: what a run without model.load_ratio emulates)
    points: list[str] = field(default_factory=lambda: ["legacy", "device"])


@dataclass
class ProjectConfig:
    """experiment=project: projected TPOT at the real model's sizes on a modelled device (specter/projection)."""

    device: str = "a100_40gb_pcie4"  # a device file in specter/projection/devices/ (or a path to one)
    methods: list[str] = field(default_factory=lambda: ["target_only", "offload_ar", "mo_sc", "mo_sm", "specmoeoff",
                                                        "moe_spec", "specter"])  # run by the engine on the virtual clock
    prompts: int = 2  # held-out prompts of prefix_tokens tokens
    new_tokens: int = 128  # tokens generated per prompt
    warmup_tokens: int = 64  # one warm-up record first
    quant: str = "gptq"  # the INT4 g128 draft: gptq (the paper's) | rtn
    profile: list[str] = field(default_factory=lambda: ["specter", "specmoeoff"])  # methods whose K is profiled
    k_values: list[int] = field(default_factory=lambda: [2, 4, 6, 8, 12, 16, 20, 24, 32, 48, 64, 96])  # Specter's K set
    profile_prompts: int = 2  # held-out prompts after the measured ones, for the K profile
    batch: bool = False  # batching step: batch_methods at each of batch_sizes
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    batch_methods: list[str] = field(default_factory=lambda: ["specter", "specmoeoff"])
    batch_new_tokens: int = 128
    alpha: bool = False  # alpha curve: alpha_methods with each of alpha_drafts
    alpha_methods: list[str] = field(default_factory=lambda: ["specter", "specmoeoff"])
    alpha_drafts: list[str] = field(default_factory=lambda: ["gptq4g128", "gptq4g32", "gptq3g128", "gptq3g32",
                                                             "gptq2g128", "gptq2g32", "rtn4g128", "rtn3g128",
                                                             "rtn2g128"])
    timeline_window: int = 2  # the window of Specter's first record that timeline.csv holds
    tokens: int = 128  # replay: decode steps replayed
    routes: str = "auto"  # replay: auto (the tiny proxy's if its checkpoint exists, else independent) | proxy | independent


@dataclass
class CellConfig:
    """experiment=cell: the methods of one (model, memory tier) cell, measured in one process and
    interleaved record by record (specter/experiments/cell.py); each writes its own run folder."""

    methods: list[str] = field(default_factory=list)
    hardware: dict[str, str] = field(default_factory=dict)  # method -> hardware option (default: the cell's)
    k_profile_methods: list[str] = field(default_factory=lambda: ["specter", "moe_spec"])  # the ones k_profile applies to
    k_profiles: dict[str, str] = field(default_factory=dict)  # method -> a K profile of its own (SpecMoEOff's)
    method_overrides: dict[str, Any] = field(default_factory=dict)  # method -> {key: value} on its method group


@dataclass
class RunConfig:
    model: ModelConfig = MISSING
    memory: MemoryConfig = MISSING
    dataset: DatasetConfig = MISSING
    method: Any = MISSING  # each method file extends a MethodConfig subclass
    hardware: HardwareConfig = MISSING
    experiment: str = "run"  # run | k_sweep | batch | compare | plan | project: what `python run.py` does
    num_prompts: int = 5
    repeats: int = 1
    max_new_tokens: int = 128
    prefix_tokens: int = 16
    seed: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    K: Optional[int] = None
    k_profile: Optional[str] = None
    k_sweep: KSweepConfig = field(default_factory=KSweepConfig)
    warmup_tokens: int = 16
    verify_lossless: bool = False
    lossless_tie_tolerance: float = 0.0
    assets_dir: str = "assets"
    allow_hub: bool = True
    output_dir: str = MISSING
    progress: bool = True
    verbose: bool = False  # show third-party libraries' banners and log lines (quiet by default)
    batch: BatchConfig = field(default_factory=BatchConfig)  # experiment=batch settings
    compare: dict[str, Any] = field(default_factory=dict)  # experiment=compare settings
    load_ratio_sweep: LoadRatioSweepConfig = field(default_factory=LoadRatioSweepConfig)  # experiment=load_ratio_sweep
    project: ProjectConfig = field(default_factory=ProjectConfig)  # experiment=project
    cell: CellConfig = field(default_factory=CellConfig)  # experiment=cell


METHOD_SCHEMAS: dict[str, type] = {
    "base": MethodConfig,
    "offload": OffloadMethodConfig,
    "specter": SpecterMethodConfig,
}

_registered = False


def register_method_schema(name: str, node: type) -> None:
    """Make `defaults: [/schema/method/<name>@_here_]` available to a method's YAML file."""
    METHOD_SCHEMAS[name] = node
    if _registered:
        from hydra.core.config_store import ConfigStore

        ConfigStore.instance().store(group="schema/method", name=name, node=node)


def register_schemas() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent; call before composing)."""
    global _registered
    from hydra.core.config_store import ConfigStore

    import os

    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("tiny"):  # conf/model/tiny_*.yaml read their dimensions from models/tiny.py
        from specter.models.tiny import tiny_dimension

        OmegaConf.register_new_resolver("tiny", tiny_dimension)
    if not OmegaConf.has_resolver("abspath"):  # hydra.sweep.subdir: each job's folder is its output_dir
        OmegaConf.register_new_resolver("abspath", os.path.abspath)
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RunConfig)
    for group, node in (("model", ModelConfig), ("memory", MemoryConfig), ("dataset", DatasetConfig),
                        ("hardware", HardwareConfig)):
        cs.store(group=f"schema/{group}", name="base", node=node)
    for name, node in METHOD_SCHEMAS.items():
        cs.store(group="schema/method", name=name, node=node)
    _registered = True


# -- offloading baselines (runners in baselines/) ------------------------------------------------
@dataclass
class MixtralOffloadingMethodConfig(OffloadMethodConfig):
    """MO-SC: the offloading runtime's LRU cache as Mixtral-Offloading runs it (its buffer_size=4 is
    method.staging_buffers=4; by default the staging rule of every cache-owning method)."""


@dataclass
class SlotPreset:
    """MO-SM slots measured on one checkpoint: the facts that identify it, and the slots per memory tier."""

    checkpoint: dict[str, Any] = field(default_factory=dict)  # CheckpointFacts fields, all of which must match
    slots: dict[str, int] = field(default_factory=dict)  # tier -> slots per layer


@dataclass
class MixtralOffloadingSMMethodConfig(MixtralOffloadingMethodConfig):
    residents: Optional[int] = None  # slots per layer; null = a preset matching the checkpoint, else derived
    presets: Optional[list[SlotPreset]] = field(default_factory=list)  # the paper artifact's; [] or null clears them


@dataclass
class SeparateDraftMethodConfig(OffloadMethodConfig):
    """What both SpecMoEOff variants share: a separate draft instance and route-frequency prefetch."""

    speculative: bool = True
    K: int = 3  # draft length without a K profile (the top-level K= overrides it)
    quant: str = "gptq"  # the separate draft's routed experts: gptq | rtn
    calibration_prompts: int = 16
    prefetch_at: list[float] = field(default_factory=lambda: [0.2, 0.6])  # prefetch after int(f*K) draft steps


@dataclass
class SpecMoEOffMethodConfig(SeparateDraftMethodConfig):
    """SpecMoEOff as designed: residents = what fits the budget; K from its own profile (k_profile=)."""

    k_range: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96])  # what experiment=k_sweep sweeps


@dataclass
class SpecMoEOffArtifactMethodConfig(SeparateDraftMethodConfig):
    """The Specter paper artifact's SpecMoEOff preset: fixed residents per tier and K = 3."""

    residents: dict[str, int] = field(default_factory=lambda: {"high": 12, "low": 2})  # of the real model's experts


@dataclass
class MoESpecMethodConfig(SpecterMethodConfig):
    residency: str = "lru"  # MoE-Spec keeps the LRU cache of its design
    budget: Optional[int] = None  # experts kept per MoE layer per verification pass; null = half the routed experts
    budget_mode: str = "substitute"  # truncate | substitute


METHOD_SCHEMAS.update({
    "mixtral_offloading": MixtralOffloadingMethodConfig,
    "mixtral_offloading_sm": MixtralOffloadingSMMethodConfig,
    "specmoeoff": SpecMoEOffMethodConfig,
    "specmoeoff_artifact": SpecMoEOffArtifactMethodConfig,
    "moe_spec": MoESpecMethodConfig,
})


# -- engine baselines (runners in baselines/: transformers, llama.cpp, vLLM) ------------------------
@dataclass
class EngineMethodConfig(MethodConfig):
    reference_check: Optional[bool] = None  # greedy records vs target-only tokens (untimed); null = on for CPU runs


@dataclass
class TransformersMethodConfig(EngineMethodConfig):
    experts_implementation: Optional[str] = None  # null = transformers' default | eager | batched_mm | grouped_mm


@dataclass
class LlamaCppMethodConfig(EngineMethodConfig):
    gguf_type: Optional[str] = None  # f32 | f16; null = f32 for float32 runs, else f16
    n_gpu_layers: Optional[int] = None  # null = CUDA: as many layers as the tier's budget holds; CPU: 0
    n_threads: Optional[int] = None  # null = hardware.threads (else llama.cpp's default)
    n_batch: int = 512


@dataclass
class VllmMethodConfig(EngineMethodConfig):
    python: Optional[str] = None  # the vLLM env's interpreter; null = $SPECTER_VLLM_PYTHON, else $SPECTER_HOME/venvs/vllm
    cpu_offload_gb: Optional[float] = None  # null = CUDA: weights over the tier's budget; CPU: 0
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = True  # no torch.compile / CUDA graphs (minutes of compilation on small machines)
    startup_timeout_s: float = 900.0


METHOD_SCHEMAS.update({
    "engine": EngineMethodConfig,
    "transformers": TransformersMethodConfig,
    "llamacpp": LlamaCppMethodConfig,
    "vllm": VllmMethodConfig,
})
