"""A tiny model's cache sizes taken from the real model's memory plan, so a CPU cell and a projected
cell compare the same memory split.

A tiny model keeps its experts in fp32 and its INT4 draft is cheap beside them, so its own tier
budget pays for a different split than the real model's (same-memory MO-SM held 25 slots on
tiny_dsv2 at the high tier where DeepSeek-V2-Lite's plan gives it 32). With `memory.slots=real_plan`
(the default for a tiny model that names its `real` model) every offloading method runs with the
resident slots per layer that `experiment=plan` computes for the real model at the same tier, on the
paper's GPU and dtype (hardware=cuda, an A100 40 GB), and with the plan's staging buffers per MoE
layer scaled to the tiny model's layer count. The plan's own budget check is the one that counts;
a method whose minimum does not fit the real model's tier (SpecMoEOff's separate draft at Phi-3.5-MoE's
low tier) runs at the plan's minimum, as the projection runs it, and its `slots_source` says by how
much it is over.

`memory.slots=budget` keeps the tiny model's own budget rule (each method sizes itself against
the tiny tier's bytes); an explicit `memory.resident_experts` or `memory.budget_mb` does too.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf, open_dict

from specter.assembly.config import ConfigError, effective_K
from specter.assembly.runners import is_method

SLOT_SOURCES = ("real_plan", "budget")


@dataclass(frozen=True)
class PlannedSlots:
    """One method's cache on a tiny model, as the real model's plan sizes it."""

    resident: int  # slots per MoE layer (the real model's, unchanged: the tiny models keep E and top-k)
    staging_per_layer: float  # the plan's staging buffers over the real model's MoE layers
    source: str  # e.g. "plan of dsv2 at memory=high (A100 40 GB, float16)"

    def staging(self, moe_layers: int) -> int:
        """Staging buffers for a model with `moe_layers` MoE layers (shared by all layers, as on the real one)."""
        return int(round(self.staging_per_layer * moe_layers))


def wants_real_plan(cfg: DictConfig) -> bool:
    """Whether this run sizes its cache from the real model's plan."""
    mem, m = cfg.memory, cfg.model
    source = str(mem.get("slots") or "real_plan")
    if source not in SLOT_SOURCES:
        raise ConfigError(f"memory.slots={source!r}: choose one of {', '.join(SLOT_SOURCES)}")
    user_sized = mem.get("resident_experts") is not None or mem.get("budget_mb") is not None
    return source == "real_plan" and m.get("source") == "tiny" and bool(m.get("real")) and not user_sized


def largest_batch(cfg: DictConfig) -> int:
    """The largest batch this run serves: its layout must hold that many requests' KV and scratch."""
    if cfg.get("experiment") == "batch" and cfg.get("batch"):
        return max(int(b) for b in cfg.batch.sizes)
    return 1


def real_plan_config(cfg: DictConfig) -> DictConfig:
    """The run's config with the real model in place of the tiny one, on the paper's GPU and dtype."""
    from specter.assembly.compose import CONF_DIR, hardware_defaults
    from specter.assembly.schema import HardwareConfig, ModelConfig

    real = str(cfg.model.real)
    path = CONF_DIR / "model" / f"{real}.yaml"
    if not path.exists():
        raise ConfigError(f"{cfg.model.name} mirrors model.real={real!r}, which has no conf/model/{real}.yaml")
    data = OmegaConf.load(path)
    data.pop("defaults", None)
    plan = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    with open_dict(plan):
        plan.model = OmegaConf.merge(OmegaConf.structured(ModelConfig), data)
        plan.hardware = OmegaConf.merge(OmegaConf.structured(HardwareConfig), hardware_defaults("cuda"))
        # experiment=batch runs every size on one device layout: the plan's at the largest size
        plan.batch = {"sizes": [largest_batch(cfg)]}
        if is_method(cfg.method.name, reads_specter_profile=True):
            plan.K = effective_K(cfg)  # the window this run verifies (a profiled K too): its KV and scratch
        plan.pop("k_profile", None)  # (SpecMoEOff reads its own K, as the plan does)
    return plan


def planned_slots(cfg: DictConfig) -> PlannedSlots | None:
    """The run's method sized by the real model's plan at this tier, or None (not a tiny model with a
    real one, `memory.slots=budget`, a user-sized tier, or a method the plan does not size)."""
    if not wants_real_plan(cfg):
        return None
    from specter.assembly.plan import plan_rows

    method = str(cfg.method.name)
    if not is_method(method, owns_cache=True):
        return None
    plan_cfg = real_plan_config(cfg)
    rows, facts = plan_rows(plan_cfg)
    row = next(r for r in rows if r.method == method and r.batch == largest_batch(cfg))
    where = f"plan of {plan_cfg.model.name} at memory={cfg.memory.name} ({facts['gpu_bytes'] / 1e9:.0f} GB GPU, {facts['dtype']})"
    if not row.fits_budget:  # the plan's minimum (one slot per layer) runs, as the projection runs it; said, not hidden
        where += (f"; over the tier's budget by {(row.total - row.budget) / 1e9:.2f} GB at its minimum of "
                  f"{row.resident} slot(s) per layer (the real model would refuse it)")
    return PlannedSlots(int(row.resident), row.staging / facts["moe_layers"], where)
