"""SpecMoEOff (Wang et al., 2025) on the shared runtime: `method=specmoeoff` and `method=specmoeoff_artifact`.

Speculative decoding over an offloaded MoE with a *separate* draft:

    committed prefix ──► draft instance (own weights, own KV) drafts K tokens; its routes are counted
                     ──► after draft steps int(0.2K) and int(0.6K): prefetch each layer's top-M counted experts
                     ──► target verifies K+1 positions (expert-wise, same cache and link) ──► accept, commit

What differs from Specter, and nothing else: the draft is a second model instance (a copy of
every non-expert tensor plus INT4 routed experts, its whole footprint on the device and in the
budget) with its own KV cache that re-reads what the target committed; prefetch points are fixed
fractions of K ranked by route frequency (no bandwidth/step-time model); a batch is decoded as two
microbatches taking windows in turn on the one expert cache (`generate_microbatched`), as the
Specter paper runs it. Greedy output equals target-only decoding (same verification).

Two ways to size it:
- `SpecMoEOff` (method=specmoeoff), as its design says: the target keeps every slot the budget
  holds beside the separate draft (`fitting_residents`), and K is the one SpecMoEOff's own K profile
  chose (experiment=k_sweep method=specmoeoff sweeps method.k_range; `k_profile=` feeds it back),
  else the fixed default method.K; env.json says which (`K_source`).
- `SpecMoEOffArtifact` (method=specmoeoff_artifact), the Specter paper artifact's preset: 12/2
  residents of the real model's experts (scaled, capped by the same fit) and K = 3.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, OmegaConf

from specter.assembly.compose import CONF_DIR
from specter.assembly.config import ConfigError, profiled_k_of
from specter.assembly.methods import Specter
from specter.assembly.runtime import final_runtime, staging_for
from specter.models.loading import non_expert_bytes
from specter.offload.budget import MB, BudgetError, Footprint
from specter.moe import DraftExecutor, MoERuntime, SpecterExperts
from specter.offload.instruments import Instruments
from specter.offload.runtime import Runtime
from specter.predict.planner import PlannerConfig, PrefetchPlanner
from specter.quant.draft import draft_forward
from specter.spec import MethodSpec, extend_spec
from specter.speculative.drafter import SeparateDrafter

if TYPE_CHECKING:
    from specter.assembly.plan import MemoryPlan


@dataclass(frozen=True)
class SpecMoEOffSpec(MethodSpec):
    """SpecMoEOff's spec: the common fields, plus the draft-step fractions its prefetches follow."""

    prefetch_at: tuple[float, ...] = (0.2, 0.6)
    K_source: str = ""  # where K came from: the K= override, a K profile, or the fixed default
    preset_residents: int = 0  # artifact: method.residents at this tier, slots per layer of the real model
    real_experts: int = 0  # artifact: routed experts of the real model the preset counts
    resident_cap: int = 0  # memory.resident_experts when given: at most this many residents (0: no cap)


class RouteFrequencyPlanner(PrefetchPlanner):
    """Plans at fixed draft-step counts int(f·K), each the top-M experts the draft routed to most."""

    name = "route_frequency"

    def __init__(self, K: int, expert_bytes: int, fractions: Sequence[float]):
        self.fractions = tuple(float(f) for f in fractions)
        super().__init__(PlannerConfig(), K, expert_bytes)

    def steps(self) -> list[int]:
        """Boundaries of this window; a step count of 0 has no routes to rank and is skipped."""
        return sorted({int(f * self.K) for f in self.fractions} & set(range(1, self.K + 1)))

    def schedule_first(self) -> int | None:
        steps = self.steps()
        return steps[0] if steps else None

    def schedule_next(self, step: int, batch_bytes: int) -> int | None:
        return next((s for s in self.steps() if s > step), None)


def real_expert_count(cfg: DictConfig) -> int:
    """Routed experts of the real model a tiny one mirrors (the presets are counts of those)."""
    real = cfg.model.get("real")
    if cfg.model.source != "tiny" or not real:
        published = cfg.model.get("published") or {}
        count = published.get("num_experts") or cfg.model.get("num_experts")
        if count is None:
            raise ConfigError(f"model {cfg.model.name}: no published expert count to scale SpecMoEOff's residents by")
        return int(count)
    return int(OmegaConf.load(CONF_DIR / "model" / f"{real}.yaml").published.num_experts)  # the published checkpoint's


def separate_draft_instance(rt: Runtime, experts: dict) -> tuple[torch.nn.Module, MoERuntime]:
    """A copy of `rt`'s model (its own copy of every non-expert tensor; the routed experts hold no
    tensors) whose experts consult a runtime of their own, which drafts with `experts` (it only ever
    runs in draft mode; the target's cache is never read through it)."""
    target_modules = list(rt.om.experts.values())
    for module in target_modules:  # copy the instance without its runtime (and the cache behind it)
        module.runtime = None
    try:
        model = copy.deepcopy(rt.model)
    finally:
        rt.moe.attach(target_modules)
    draft_modules = [m for m in model.modules() if isinstance(m, SpecterExperts)]
    return model, MoERuntime(rt.moe.target, DraftExecutor(experts, draft_forward)).attach(draft_modules)


class NoResidentFits(BudgetError, ConfigError):
    """Not even one resident expert per layer fits the budget beside the separate draft."""


@dataclass(frozen=True)
class ResidentFit:
    """What the budget holds beside the separate draft: `slots` per layer (may be < 1) at batch size `batch`."""

    slots: int
    batch: int
    fixed_bytes: int  # everything but the slots: target and draft non-expert copies, INT4 experts, KV, scratch
    slot_row_bytes: int  # one slot in every MoE layer


def fitting_residents(budget: int, fixed: int, per_request: int, slot_row: int, batch_sizes: Sequence[int],
                      num_experts: int) -> ResidentFit:
    """Slots per MoE layer the budget holds beside `fixed` bytes (the footprint at B = 1 without slots),
    at most every expert. With several batch sizes (experiment=batch) the slots leave room for the KV
    and scratch (`per_request` bytes each) of the largest size beside which one slot still fits, so one
    device layout serves every size (the staging rule's choice); larger sizes are refused by the harness."""
    sizes = sorted({int(b) for b in batch_sizes} | {1})
    room = {b: budget - fixed - (b - 1) * per_request for b in sizes}  # bytes left for slots at each size
    B = max((b for b in sizes if room[b] >= slot_row), default=1)
    return ResidentFit(min(num_experts, room[B] // slot_row), B, fixed, slot_row)


def profiled_K(cfg: DictConfig) -> int:
    """The K of `k_profile=`, which must be a profile SpecMoEOff measured (its own range, its own draft)."""
    K = profiled_k_of(cfg)  # exists, parses, same model, a usable K
    method = json.loads(Path(cfg.k_profile).read_text()).get("method", "specter")  # older profiles: Specter's
    if method != cfg.method.name:
        raise ConfigError(f"k_profile={cfg.k_profile} was measured for method={method}, not {cfg.method.name}; "
                          f"profile its own K: python run.py experiment=k_sweep method={cfg.method.name} "
                          f"model={cfg.model.name} memory={cfg.memory.name}")
    return K


class SpecMoEOff(Specter):
    """SpecMoEOff as designed: separate draft and KV, route-frequency prefetch, residents = what fits, profiled K."""

    name = "specmoeoff"

    @classmethod
    def plan_rows(cls, p: MemoryPlan, name: str) -> None:
        """The memory plan's rows: a separate draft (its own non-expert copy, INT4 experts, KV, scratch) beside
        the target, K= else method.K (profiles are not read by the plan), and `planned_residents` slots."""
        from specter.assembly.plan import method_defaults

        f, cfg, E, L, eb = p.f, p.cfg, p.f.num_experts, p.f.moe_layers, p.f.expert_bytes
        so = method_defaults(name, cfg)
        K_so = int(cfg.K) if cfg.get("K") is not None else int(so.K)
        kv1, scr1 = f.kv_bytes_per_token * p.seq(K_so), p.scratch(K_so, 1)
        fixed = f.non_expert_bytes + kv1 + scr1 + p.draft + f.non_expert_bytes + kv1 + scr1
        fit = min(E, (p.budget - fixed) // (L * eb))
        M_so, how = cls.planned_residents(so, cfg, E, fit)
        st_so = p.staging(name, Footprint(f.non_expert_bytes, M_so * L * eb, p.draft, 2 * kv1, 2 * scr1,
                                          draft_non_expert=f.non_expert_bytes), 1)
        for B in p.sizes:
            p.add(name, B, M_so, st_so, p.draft, 2 * B * kv1, 2 * B * scr1, draft_non_expert=f.non_expert_bytes,
                  note=f"K={K_so}; {how}, budget fits {fit}")

    @classmethod
    def planned_residents(cls, method: DictConfig, cfg: DictConfig, E: int, fit: int) -> tuple[int, str]:
        """Resident slots per layer in the plan, and how they were chosen: as designed, every slot that fits."""
        return max(1, fit), "every slot that fits"
    microbatches = 2  # the Specter paper's SpecMoEOff decodes a batch as two microbatches sharing one cache

    def residency(self) -> str:
        return "lru"  # the design's cache; the window-aware policy is Specter's

    def draft_length(self, cfg: DictConfig) -> tuple[int, str]:
        """K and where it came from: K=, else its own K profile (k_profile=), else the fixed method.K."""
        if cfg.get("K") is not None:
            return int(cfg.K), "K= override"
        if cfg.get("k_profile"):
            return profiled_K(cfg), f"k_profile {cfg.k_profile}"
        return int(cfg.method.K), "default method.K (no K profile given)"

    def preset_fields(self, cfg: DictConfig) -> dict[str, Any]:
        """Spec fields of a resident preset: none, the design spends the budget (an explicit
        memory.resident_experts caps it, so a run can hold another machine's M)."""
        cap = cfg.memory.get("resident_experts")
        return {} if cap is None else {"resident_cap": int(cap)}

    def make_spec(self, cfg: DictConfig) -> MethodSpec:
        m = cfg.method
        K, source = self.draft_length(cfg)
        if K < 1:
            raise ConfigError(f"method.K must be >= 1, got {K}")
        if not m.prefetch_at or not all(0 <= f <= 1 for f in m.prefetch_at):
            raise ConfigError(f"method.prefetch_at must be fractions of K in [0, 1], got {list(m.prefetch_at)}")
        preset = self.preset_fields(cfg)
        resident = preset.pop("resident", None)  # None: the tier's M, until the budget's fit is known
        base = replace(super().make_spec(cfg), K=K, quant=m.quant, prefetch=RouteFrequencyPlanner.name,
                       **({} if resident is None else {"resident": resident}))
        return extend_spec(base, SpecMoEOffSpec, prefetch_at=tuple(float(f) for f in m.prefetch_at), K_source=source,
                           **preset)

    def fit_batch_sizes(self) -> Sequence[int]:
        """The batch sizes whose KV and scratch the residents leave room for (experiment=batch: every size)."""
        return self.spec.batch_sizes

    def target_residents(self, fit: ResidentFit) -> dict[str, Any]:
        """env.json's `residents`; "used" is the M the target keeps: every slot that fits (at most an
        explicit memory.resident_experts, which is how a run pins SpecMoEOff to another machine's M)."""
        cap = self.spec.resident_cap
        return {"rule": "every slot the budget holds beside the separate draft", "fit_in_budget": fit.slots,
                "fit_at_batch": fit.batch, "used": min(fit.slots, cap) if cap else fit.slots,
                **({"cap": cap} if cap else {})}

    def finish_runtime(self, rt: Runtime, draft: dict) -> Runtime:
        """The target's residents beside the separate draft instance (its own copy of every non-expert
        tensor, its KV for the same positions, its scratch), which is built here; what the budget still
        holds after them becomes staging buffers by the engine's one rule."""
        spec = self.spec
        fp = rt.footprint
        self.draft_extra = {"non_expert": non_expert_bytes(rt.model), "kv_cache": fp.kv_cache, "scratch": fp.scratch}
        fixed = fp.total - fp.cache_slots - fp.staging + self.draft_bytes + sum(self.draft_extra.values())
        per_request = 2 * (fp.kv_cache + fp.scratch)  # the target's and the draft's
        slot_row = len(rt.om.moe_layers) * rt.om.store.nbytes_per_expert
        fit = fitting_residents(rt.budget_bytes, fixed, per_request, slot_row, self.fit_batch_sizes(),
                                rt.om.num_experts)
        self.residents = self.target_residents(fit)
        M = self.residents["used"]
        what = f"{spec.model} {spec.method} at memory={spec.memory}"
        if M < 1:
            raise NoResidentFits(
                f"{what}: not one resident expert per layer fits beside the separate draft: "
                f"{fixed / MB:.2f} MB (target and draft non-expert copies, INT4 draft experts, both KV caches and "
                f"scratch) + {slot_row / MB:.2f} MB for one slot per layer > the budget of {rt.budget_bytes / MB:.2f} MB. "
                f"Use a larger tier (memory=high) or memory.budget_mb")
        design = replace(fp, cache_slots=M * slot_row, staging=0, draft_experts=self.draft_bytes,
                         draft_non_expert=self.draft_extra["non_expert"],
                         kv_cache=fp.kv_cache + self.draft_extra["kv_cache"],
                         scratch=fp.scratch + self.draft_extra["scratch"])
        final = final_runtime(rt, M, staging_for(spec, rt, design), draft_bytes=self.draft_bytes,
                              separate_draft=self.draft_extra, what=f"{what} (M={M})")
        self.draft_model, self.draft_moe = separate_draft_instance(final, draft)
        return final

    def instrument(self, instruments: Instruments) -> None:
        """The target's runtime and engines as every method's, and the separate draft instance reports to the
        meter too."""
        super().instrument(instruments)
        if instruments.meter is not None:
            self.draft_moe.meter = instruments.meter

    def planner(self) -> RouteFrequencyPlanner:
        return RouteFrequencyPlanner(self.K, self.rt.om.store.nbytes_per_expert, self.spec.prefetch_at)

    def drafter(self) -> SeparateDrafter:
        """A drafter per engine (each microbatch keeps its own draft KV), over the one draft instance."""
        return SeparateDrafter(self.draft_model, self.draft_moe)

    def environment(self) -> dict[str, Any]:
        return {**self.rt.environment(), "K": self.K, "K_source": self.spec.K_source, "draft_quant": self.quant,
                "draft_bytes": self.draft_bytes, "separate_draft_bytes": self.draft_extra,
                "residents": self.residents, "prefetch_steps": self.engine.planner.steps(),
                "microbatches": self.microbatches, **self.draft_info}


class SpecMoEOffArtifact(SpecMoEOff):
    """The Specter paper artifact's SpecMoEOff preset: K = 3, 12/2 residents (scaled), capped by what fits."""

    name = "specmoeoff_artifact"

    @classmethod
    def planned_residents(cls, method: DictConfig, cfg: DictConfig, E: int, fit: int) -> tuple[int, str]:
        """The artifact's preset count, scaled to the model's experts and capped by what fits."""
        preset = max(1, min(E, round(int(method.residents[cfg.memory.name]) * E / real_expert_count(cfg))))
        return int(min(preset, max(1, fit))), f"preset {preset}"

    def draft_length(self, cfg: DictConfig) -> tuple[int, str]:
        """K=, else the preset's method.K; a K profile is not read (the preset fixes K)."""
        if cfg.get("K") is not None:
            return int(cfg.K), "K= override"
        return int(cfg.method.K), "artifact preset method.K"

    def preset_fields(self, cfg: DictConfig) -> dict[str, Any]:
        m = cfg.method
        if cfg.memory.name not in m.residents:
            raise ConfigError(f"method.residents has no entry for memory={cfg.memory.name} (it has {list(m.residents)})")
        E, listed, real = int(cfg.model.num_experts), int(m.residents[cfg.memory.name]), real_expert_count(cfg)
        return {"resident": max(1, min(E, round(listed * E / real))), "preset_residents": listed, "real_experts": real}

    def fit_batch_sizes(self) -> Sequence[int]:
        return (1,)  # the artifact caps its preset by what fits at B = 1 whatever the batch sweep

    def target_residents(self, fit: ResidentFit) -> dict[str, Any]:
        """The preset's residents (scaled to this model's experts), capped by what fits beside the draft."""
        spec = self.spec
        return {"preset": spec.preset_residents, "of_real_experts": spec.real_experts, "scaled": spec.resident,
                "fit_in_budget": max(1, fit.slots), "used": int(min(spec.resident, max(1, fit.slots)))}
