"""SpecMoEOff (Wang et al., 2025) on the shared runtime: `method=specmoeoff`.

Speculative decoding over an offloaded MoE with a *separate* draft, as the Specter paper's
adapter preset runs it:

    committed prefix ──► draft instance (own weights, own KV) drafts K = 3 tokens; its routes are counted
                     ──► after draft steps int(0.2K) and int(0.6K): prefetch each layer's top-M counted experts
                     ──► target verifies K+1 positions (expert-wise, same cache and link) ──► accept, commit

What differs from Specter, and nothing else: the draft is a second model instance (a copy of
every non-expert tensor plus INT4 routed experts, its whole footprint on the device and in the
budget) with its own KV cache that re-reads what the target committed; K is short; prefetch
points are fixed fractions of K ranked by route frequency (no bandwidth/step-time model); the
target keeps fewer residents because the draft's copy takes their memory; a batch is decoded as
two microbatches taking windows in turn on the one expert cache (`generate_microbatched`), as the
Specter paper runs it. Greedy output equals target-only decoding (same verification).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from specter.harness.compose import CONF_DIR
from specter.harness.config import ConfigError
from specter.harness.methods import Specter
from specter.harness.runtime import final_runtime, staging_for
from specter.models.loading import non_expert_bytes
from specter.moe import DraftExecutor, MoERuntime, SpecterExperts
from specter.offload.runtime import Runtime
from specter.predict.planner import PlannerConfig, PrefetchPlanner
from specter.quant.draft import draft_forward
from specter.spec import MethodSpec, extend_spec
from specter.speculative.drafter import SeparateDrafter


@dataclass(frozen=True)
class SpecMoEOffSpec(MethodSpec):
    """SpecMoEOff's spec: the common fields, plus the draft-step fractions its prefetches follow."""

    prefetch_at: tuple[float, ...] = (0.2, 0.6)
    preset_residents: int = 0  # method.residents at this tier: slots per layer of the real model
    real_experts: int = 0  # routed experts of the real model the preset counts


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


class SpecMoEOff(Specter):
    """SpecMoEOff's preset: K=3, separate draft and KV, route-frequency prefetch, fewer residents."""

    name = "specmoeoff"
    microbatches = 2  # the Specter paper's SpecMoEOff decodes a batch as two microbatches sharing one cache

    def make_spec(self, cfg: DictConfig) -> MethodSpec:
        m = cfg.method
        K = int(cfg.K) if cfg.get("K") is not None else int(m.K)
        if K < 1:
            raise ConfigError(f"method.K must be >= 1, got {K}")
        if not m.prefetch_at or not all(0 <= f <= 1 for f in m.prefetch_at):
            raise ConfigError(f"method.prefetch_at must be fractions of K in [0, 1], got {list(m.prefetch_at)}")
        if cfg.memory.name not in m.residents:
            raise ConfigError(f"method.residents has no entry for memory={cfg.memory.name} (it has {list(m.residents)})")
        E, listed, real = int(cfg.model.num_experts), int(m.residents[cfg.memory.name]), real_expert_count(cfg)
        preset = max(1, min(E, round(listed * E / real)))
        base = replace(super().make_spec(cfg), K=K, quant=m.quant, resident=preset, prefetch=RouteFrequencyPlanner.name)
        return extend_spec(base, SpecMoEOffSpec, prefetch_at=tuple(float(f) for f in m.prefetch_at),
                           preset_residents=listed, real_experts=real)

    def finish_runtime(self, rt: Runtime, draft: dict) -> Runtime:
        """The preset's residents, capped by what fits beside the separate draft instance (its own copy of
        every non-expert tensor, its KV for the same positions, its scratch), which is built here."""
        spec = self.spec
        fp = rt.footprint
        self.draft_extra = {"non_expert": non_expert_bytes(rt.model), "kv_cache": fp.kv_cache, "scratch": fp.scratch}
        fixed = fp.total - fp.cache_slots + self.draft_bytes + sum(self.draft_extra.values())
        slot_row = len(rt.om.moe_layers) * rt.om.store.nbytes_per_expert
        fits = max(1, (rt.budget_bytes - fixed) // slot_row)
        self.residents = {"preset": spec.preset_residents, "of_real_experts": spec.real_experts,
                          "scaled": spec.resident, "fit_in_budget": int(fits), "used": int(min(spec.resident, fits))}
        M = self.residents["used"]
        design = replace(fp, cache_slots=M * slot_row, draft_experts=self.draft_bytes,
                         draft_non_expert=self.draft_extra["non_expert"],
                         kv_cache=fp.kv_cache + self.draft_extra["kv_cache"],
                         scratch=fp.scratch + self.draft_extra["scratch"])
        final = final_runtime(rt, M, staging_for(spec, rt, design), draft_bytes=self.draft_bytes,
                              separate_draft=self.draft_extra,
                              what=f"{spec.model} specmoeoff at memory={spec.memory} (M={M})")
        self.draft_model, self.draft_moe = separate_draft_instance(final, draft)
        return final

    def planner(self) -> RouteFrequencyPlanner:
        return RouteFrequencyPlanner(self.K, self.rt.om.store.nbytes_per_expert, self.spec.prefetch_at)

    def drafter(self) -> SeparateDrafter:
        """A drafter per engine (each microbatch keeps its own draft KV), over the one draft instance."""
        return SeparateDrafter(self.draft_model, self.draft_moe)

    def environment(self) -> dict[str, Any]:
        return {**self.rt.environment(), "K": self.K, "draft_quant": self.quant, "draft_bytes": self.draft_bytes,
                "separate_draft_bytes": self.draft_extra, "residents": self.residents,
                "prefetch_steps": self.engine.planner.steps(), "microbatches": self.microbatches, **self.draft_info}
