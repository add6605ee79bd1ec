"""Every method's device footprint at a tier and batch size, from the model's config alone, before any
weights (`plan_rows`): what a runtime sizes its slots by on a real model (assembly.real_plan) and what
`experiment=plan` prints (specter/experiments/plan.py).

The numbers come from the same functions the engine calls: the meta-device skeleton of
`load_offloaded`, `scratch_bytes`, `budget_bytes`, the staging rule, MO-SM's `same_memory_slots`,
`draft_layer_nbytes`, llama.cpp's `gpu_layers_for_budget` and vLLM's `cpu_offload_gib`; the KV bytes
are the config arithmetic that tests check against the engine's one-token measurement. Nothing is
allocated.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specter.assembly.config import ConfigError, effective_K, resident_experts, validate
from specter.assembly.runners import method_names, runner_class
from specter.offload.budget import Footprint

GB = 1e9
A100_40GB = 40.0  # GB: the paper's GPU (the card has 40 GiB; 40e9 bytes leaves ~2.9 GB for the CUDA context)


@dataclass
class PlanRow:
    """One method at one batch size: its device bytes by component and whether they fit."""

    method: str
    batch: int
    resident: int | None  # expert slots per MoE layer (None: the method places whole layers or everything)
    staging: int  # staging buffers shared by all layers
    non_expert: int
    cache_slots: int  # resident slots + staging buffers
    draft: int  # INT4 draft experts (+ SpecMoEOff's separate non-expert copy; its KV and scratch are in kv_cache, scratch)
    kv_cache: int
    scratch: int
    total: int
    budget: int | None  # None: not bound by the tier (target_only: the reference)
    gpu: int
    note: str = ""
    fits_budget: bool = field(init=False)
    fits_gpu: bool = field(init=False)

    def __post_init__(self) -> None:
        self.fits_budget = self.budget is None or self.total <= self.budget
        self.fits_gpu = self.total <= self.gpu

    @property
    def fits(self) -> bool:
        return self.fits_budget and self.fits_gpu


def method_defaults(name: str, cfg: DictConfig) -> DictConfig:
    """`method=<name>` as composed with no overrides (its schema + conf/method/<name>.yaml), or the run's
    own method node when it is that method (so `method.staging_buffers=...` etc. apply)."""
    if cfg.method.name == name:
        return cfg.method
    from specter.assembly.compose import CONF_DIR
    from specter.assembly.schema import METHOD_SCHEMAS

    data = OmegaConf.load(CONF_DIR / "method" / f"{name}.yaml")
    schema = "base"
    for entry in data.pop("defaults", []) or []:
        if isinstance(entry, str) and entry.startswith("/schema/method/"):
            schema = entry.removeprefix("/schema/method/").split("@")[0]
    return OmegaConf.merge(OmegaConf.structured(METHOD_SCHEMAS[schema]), data)


def plan_model_config(cfg: DictConfig):
    """The transformers config of the configured model: a tiny model's own, a local checkpoint's
    config.json when there is one, else the shipped config.json of the real model."""
    from specter.models.footprint import load_config, real_config_path

    m = cfg.model
    if m.source == "tiny":
        from specter.models.tiny import make_config

        return make_config(m.name)
    local = Path(str(m.get("local_dir") or ""))
    if m.get("local_dir") and (local / "config.json").exists():
        return load_config(local)
    try:
        return load_config(real_config_path(m.name))
    except FileNotFoundError as err:
        raise ConfigError(f"experiment=plan: {err}") from None


def gpu_bytes(cfg: DictConfig) -> int:
    value = cfg.hardware.get("gpu_memory_gb")
    value = A100_40GB if value is None else value
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"hardware.gpu_memory_gb must be a positive number of GB, got {value!r}")
    return int(float(value) * GB)


def plan_rows(cfg: DictConfig, config=None) -> tuple[list[PlanRow], dict[str, Any]]:
    """Every method x batch size for the configured model, tier, hardware and protocol."""
    import torch

    from specter.assembly.sizing import budget_bytes
    from specter.models.footprint import model_facts
    from specter.models.loading import DTYPES
    from specter.quant.draft import draft_layer_nbytes

    validate(cfg)
    gpu = gpu_bytes(cfg)
    M = resident_experts(cfg)
    hw = cfg.hardware
    if hw.dtype not in DTYPES:
        raise ConfigError(f"hardware.dtype={hw.dtype!r} is not one of {sorted(DTYPES)}")
    dtype = DTYPES[hw.dtype]
    device_type = torch.device(hw.device).type
    sizes = [int(b) for b in cfg.batch.sizes]
    if not sizes or any(b < 1 for b in sizes):
        raise ConfigError(f"batch.sizes must be integers >= 1, got {list(cfg.batch.sizes)}")
    config = config if config is not None else plan_model_config(cfg)
    f = model_facts(config, dtype)
    L, E = f.moe_layers, f.num_experts
    if cfg.model.get("num_experts") is not None and E != int(cfg.model.num_experts):  # null: the config's own count
        raise ConfigError(f"{cfg.model.name}: the config has {E} routed experts, model.num_experts says {cfg.model.num_experts}")
    budget = budget_bytes(cfg, f.full_bytes)
    kernel = hw.get("draft_kernel") or "auto"
    draft = L * draft_layer_nbytes(E, f.hidden, f.expert_inter, device_type, dtype,
                                   kernel="torch" if kernel in ("auto", "marlin") else kernel)
    plan = MemoryPlan(cfg, config, f, dtype, sizes, budget, gpu, M, effective_K(cfg), draft)
    _target_only(plan)
    _tier_slot_methods(plan)
    # a method sized by a rule of its own design says how, on its class (`plan_rows`), in the printed order
    for rule in ("same_memory", "fit", "preset", "own"):
        for name in method_names(slots_rule=rule):
            runner_class(name).plan_rows(plan, name)
    facts = {**asdict(f), "dtype": str(dtype).removeprefix("torch."), "layer_bytes": list(f.layer_bytes),
             "full_bytes": f.full_bytes, "budget_bytes": budget, "gpu_bytes": gpu, "resident": M, "K": plan.K,
             "device": device_type, "draft_bytes": draft, **plan.facts}
    return plan.rows, facts


@dataclass
class MemoryPlan:
    """What every method's rows are computed from (the model's facts at the run's dtype, the tier's budget,
    the protocol's lengths) and the rows so far, in the order they are printed."""

    cfg: DictConfig
    config: Any  # the transformers config
    f: Any  # specter.models.footprint's facts of `config` at `dtype`
    dtype: Any  # torch.dtype
    sizes: list[int]  # batch sizes
    budget: int  # the tier's bytes
    gpu: int
    M: int  # the tier's resident experts per MoE layer
    K: int
    draft: int  # INT4 draft experts, all MoE layers
    rows: list[PlanRow] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)  # what a method's sizing adds to the plan's facts

    def context(self) -> int:
        """Positions an engine that places its own weights holds: prefix, the longer of output and warm-up, one."""
        return int(self.cfg.prefix_tokens) + max(int(self.cfg.max_new_tokens), int(self.cfg.warmup_tokens)) + 1

    def add_engine(self, method: str, on_device: int, kv: int, note: str) -> None:
        """The row of an engine that places its weights itself (B=1 only: its batching is its own)."""
        self.rows.append(PlanRow(method, 1, None, 0, on_device - kv, 0, 0, kv, 0, on_device, self.budget, self.gpu,
                                 note))

    def seq(self, K: int) -> int:
        """Positions a request's KV cache holds: prefix, output and a K+1 verification window."""
        return int(self.cfg.prefix_tokens) + int(self.cfg.max_new_tokens) + K + 1

    def scratch(self, K: int, B: int) -> int:
        from specter.assembly.sizing import scratch_bytes

        return scratch_bytes(self.config, K, B, self.dtype)

    def add(self, method: str, B: int, resident: int | None, n_staging: int, draft_b: int, kv: int, scr: int,
            note: str = "", draft_non_expert: int = 0, bound: bool = True) -> None:
        """One method's row at batch size B; `bound=False`: not bound by the tier's budget."""
        eb = self.f.expert_bytes
        fp = Footprint(non_expert=self.f.non_expert_bytes, cache_slots=(resident or 0) * self.f.moe_layers * eb,
                       draft_experts=draft_b, kv_cache=kv, scratch=scr, staging=n_staging * eb,
                       draft_non_expert=draft_non_expert)
        self.rows.append(PlanRow(method, B, resident, n_staging, fp.non_expert, fp.cache_slots + fp.staging,
                                 fp.draft_experts + fp.draft_non_expert, fp.kv_cache, fp.scratch, fp.total,
                                 self.budget if bound else None, self.gpu, note))

    def staging(self, name: str, design: Footprint, B: int) -> int:
        """The staging rule every cache-owning method follows, on this method's design at batch size B."""
        from specter.offload.budget import STAGING_PER_LAYER, staging_buffers

        m = method_defaults(name, self.cfg)
        requested = m.get("staging_buffers")
        return staging_buffers(None if requested is None else int(requested), design, self.budget,
                               self.f.expert_bytes, self.f.moe_layers, float(m.get("staging_per_layer", STAGING_PER_LAYER)))


def _target_only(p: MemoryPlan) -> None:
    """Every weight on the device (the reference and speed ceiling; not bound by the tier)."""
    for B in p.sizes:
        p.add("target_only", B, p.f.num_experts, 0, 0, B * p.f.kv_bytes_per_token * p.seq(0), p.scratch(0, B),
              bound=False, note="every expert on the device; not bound by the tier")


def _tier_slot_methods(p: MemoryPlan) -> None:
    """The tier's M slots, staging by the rule: autoregressive (offload_ar, mo_sc), then with the shared-instance
    INT4 draft and a K+1 window (specter, moe_spec)."""
    f, M, slots = p.f, p.M, p.M * p.f.moe_layers * p.f.expert_bytes
    for name in method_names(slots_rule="tier", speculative=False):
        for B in p.sizes:
            kv, scr = B * f.kv_bytes_per_token * p.seq(0), p.scratch(0, B)
            p.add(name, B, M, p.staging(name, Footprint(f.non_expert_bytes, slots, 0, kv, scr), B), 0, kv, scr)
    for name in method_names(slots_rule="tier", speculative=True):
        for B in p.sizes:
            base = Footprint(f.non_expert_bytes, slots, p.draft, B * f.kv_bytes_per_token * p.seq(p.K), p.scratch(p.K, B))
            p.add(name, B, M, p.staging(name, base, B), p.draft, base.kv_cache, base.scratch, note=f"K={p.K}")
