"""Mixtral-Offloading (Eliseev & Mazur, 2023) on the shared runtime: `method=mo_sc` and `method=mo_sm`.

Greedy autoregressive decoding. Each MoE layer keeps an LRU cache of experts on the device; an
expert the router asks for and the cache lacks is loaded on demand through the transfer link.
No prefetch, no speculation. A pool of staging buffers shared by all layers takes loads while
every slot of a layer is in use; it is device memory and counts against the budget. Its size
follows the resource rule every cache-owning method follows (`specter.offload.budget.staging_buffers`:
what the tier's budget holds beyond the method's design, at most 1.2 per MoE layer); the
original's fixed buffer_size of 4 is `method.staging_buffers=4`.

    mo_sc  same cache:  M slots per layer, the memory tier's resident experts (Specter's M)
    mo_sm  same memory: the bytes Specter spends on its INT4 draft and its (K+1)-token window
                        (KV positions, activations, logits) become extra slots; its staging
                        buffers are Specter's (the same count, so they cancel):

           M' = min(E, floor((F_specter − non_expert − staging − KV_1 − scratch_1) / (L · expert_bytes)))

           F_specter = non_expert + M·L·expert_bytes + INT4 draft + KV_{K+1} + scratch_{K+1} + staging,
           the accounting every method's budget check uses; the numbers go to env.json.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from specter.assembly.config import ConfigError, effective_K
from specter.assembly.methods import OffloadAR
from specter.assembly.runtime import final_runtime, scratch_bytes, staging_for
from specter.models.facts import matching_preset, read_facts
from specter.offload.budget import STAGING_PER_LAYER, Footprint, staging_buffers
from specter.offload.runtime import Runtime
from specter.quant.draft import build_draft
from specter.spec import MethodSpec, extend_spec

if TYPE_CHECKING:
    from specter.assembly.plan import MemoryPlan


class MixtralOffloading(OffloadAR):
    """MO-SC: the tier's M slots per layer plus the shared staging buffers."""

    name = "mo_sc"


@dataclass(frozen=True)
class SameMemorySpec(MethodSpec):
    """MO-SM's spec: the common fields, plus what its slot count is derived from."""

    specter_K: int = 0  # the K Specter runs at this tier (its window's KV and scratch are in its bytes)
    residents: int | None = None  # method.residents: slots per layer, overriding preset and derivation
    presets: tuple[dict, ...] = ()  # the paper artifact's slots, each bound to a checkpoint's facts


class MixtralOffloadingSM(MixtralOffloading):
    """MO-SM: as many slots as Specter's device bytes at this tier pay for (or the artifact's preset)."""

    name = "mo_sm"

    @classmethod
    def plan_rows(cls, p: MemoryPlan, name: str) -> None:
        """The memory plan's rows (experiment=plan, a real model's slots): Specter's bytes at B=1 as extra
        slots, or the artifact's preset; Specter's staging count. The derivation goes into the plan's facts."""
        from specter.assembly.plan import method_defaults
        from specter.models.facts import facts_from_config

        f, L, eb, kv_tok = p.f, p.f.moe_layers, p.f.expert_bytes, p.f.kv_bytes_per_token
        sm = method_defaults(name, p.cfg)
        derivation = same_memory_slots(
            non_expert=f.non_expert_bytes, L=L, E=f.num_experts, expert_bytes=eb, kv_token=kv_tok, seq1=p.seq(0),
            K=p.K, specter_resident=p.M, int4_draft=p.draft, scratch_K=p.scratch(p.K, 1), scratch_0=p.scratch(0, 1),
            budget=p.budget, staging=None if sm.get("staging_buffers") is None else int(sm.staging_buffers),
            staging_per_layer=float(sm.get("staging_per_layer", STAGING_PER_LAYER)))
        found = matching_preset(sm.get("presets"), facts_from_config(p.config))  # presets bind to checkpoint facts
        preset = (found[1].get("slots") or {}).get(p.cfg.memory.name) if found else None
        explicit = sm.get("residents")
        M_sm = explicit if explicit is not None else preset if preset is not None else derivation["resident"]
        source = "method.residents" if explicit is not None else "preset" if preset is not None else "derived"
        st_sm = derivation["staging_buffers"]
        if int(M_sm) != derivation["resident"]:  # a preset's slots: no more staging than the rule leaves beside them
            st_sm = min(st_sm, p.staging(name, Footprint(f.non_expert_bytes, int(M_sm) * L * eb, 0, kv_tok * p.seq(0),
                                                         p.scratch(0, 1)), 1))
        for B in p.sizes:
            p.add(name, B, int(M_sm), st_sm, 0, B * kv_tok * p.seq(0), p.scratch(0, B),
                  note=f"{source}; derived M'={derivation['resident']}")
        p.facts["mo_sm_derivation"] = derivation

    def make_spec(self, cfg: DictConfig) -> SameMemorySpec:
        base = super().make_spec(cfg)
        presets = OmegaConf.to_container(cfg.method.presets, resolve=True) if cfg.method.get("presets") else []
        return extend_spec(base, SameMemorySpec, specter_K=effective_K(cfg), residents=cfg.method.get("residents"),
                           presets=tuple(presets))

    def finish_runtime(self, rt: Runtime) -> Runtime:
        """M' slots per layer: method.residents, else the artifact's preset for this checkpoint, else derived."""
        spec = self.spec
        self.derivation = same_memory_residents(rt, K=spec.specter_K, specter_resident=spec.resident,
                                                sequence_tokens=spec.sequence_tokens, staging=spec.staging,
                                                staging_per_layer=spec.staging_per_layer)
        found = matching_preset(spec.presets, read_facts(self.checkpoint))  # by the checkpoint's facts
        preset = (found[1].get("slots") or {}).get(spec.memory) if found else None
        explicit = spec.residents
        M = explicit if explicit is not None else preset if preset is not None else self.derivation["resident"]
        self.derivation["used"] = {"resident": M, "from": "method.residents" if explicit is not None else
                                   f"method.presets[{found[0]}]" if preset is not None else "derived"}
        if not isinstance(M, int) or not 1 <= M <= rt.om.num_experts:
            raise ConfigError(f"mo_sm: {M!r} resident experts per layer; {spec.model} has {rt.om.num_experts}")
        # Specter's staging count; with a preset's slots, no more than the rule leaves beside them
        staging = self.derivation["staging_buffers"]
        if M != self.derivation["resident"]:
            design = replace(rt.footprint, cache_slots=M * len(rt.om.moe_layers) * rt.om.store.nbytes_per_expert)
            staging = min(staging, staging_for(spec, rt, design))
        final = final_runtime(rt, M, staging, what=f"{spec.model} mo_sm at memory={spec.memory} (M={M})")
        self.derivation["used"]["footprint_bytes"] = final.footprint.total
        return final

    def environment(self) -> dict[str, Any]:
        return {**super().environment(), "same_memory_derivation": self.derivation}


def int4_draft_bytes(rt: Runtime) -> int:
    """Device bytes of the INT4 draft experts Specter keeps resident on this runtime's device.

    The packed layout is the same for RTN and GPTQ, and every MoE layer has the same shape, so
    one layer is quantized (RTN, fast) and its bytes are multiplied by the number of layers."""
    om, cache = rt.om, rt.cache
    one_layer = SimpleNamespace(moe_layers=om.moe_layers[:1], store=om.store)
    per_layer = sum(d.nbytes for d in build_draft(one_layer, "rtn", cache.device, cache.dtype).values())
    return per_layer * len(om.moe_layers)


def same_memory_residents(rt: Runtime, K: int, specter_resident: int, sequence_tokens: int,
                          staging: int | None, staging_per_layer: float) -> dict[str, Any]:
    """MO-SM's slot count with the footprint accounting of the budget check, and its derivation."""
    om, fp = rt.om, rt.footprint
    seq1 = sequence_tokens + 1  # positions of an autoregressive run (K = 0)
    if fp.kv_cache % seq1:
        raise ValueError(f"KV bytes {fp.kv_cache} are not a multiple of the {seq1} positions they were sized for")
    cfgm, dtype = om.model.config, rt.cache.dtype
    return same_memory_slots(
        non_expert=fp.non_expert, L=len(om.moe_layers), E=om.num_experts, expert_bytes=om.store.nbytes_per_expert,
        kv_token=fp.kv_cache // seq1, seq1=seq1, K=K, specter_resident=specter_resident,
        int4_draft=int4_draft_bytes(rt), scratch_K=scratch_bytes(cfgm, K, 1, dtype),
        scratch_0=scratch_bytes(cfgm, 0, 1, dtype), budget=rt.budget_bytes, staging=staging,
        staging_per_layer=staging_per_layer)


def same_memory_slots(*, non_expert: int, L: int, E: int, expert_bytes: int, kv_token: int, seq1: int, K: int,
                      specter_resident: int, int4_draft: int, scratch_K: int, scratch_0: int,
                      budget: int, staging: int | None, staging_per_layer: float) -> dict[str, Any]:
    """The derivation of MO-SM's slots from the facts alone (bytes and counts, no model): what
    `same_memory_residents` reports for a loaded runtime and the memory plan reports from a config.
    `staging` is the requested count (method.staging_buffers; None: the rule, applied to Specter)."""
    eb = expert_bytes
    specter = {
        "K": K, "resident": specter_resident, "non_expert": non_expert,
        "cache_slots": specter_resident * L * eb, "int4_draft": int4_draft,
        "kv_cache": kv_token * (seq1 + K), "scratch": scratch_K,
    }
    specter["total"] = sum(v for k, v in specter.items() if k not in ("K", "resident"))
    # Specter's staging buffers by the rule every cache-owning method follows; MO-SM holds as many
    design = Footprint(non_expert, specter["cache_slots"], int4_draft, specter["kv_cache"], scratch_K)
    n_staging = staging_buffers(staging, design, budget, eb, L, staging_per_layer)
    specter["staging_buffers"] = int(n_staging) * eb
    specter["total"] += specter["staging_buffers"]
    staging_b = n_staging * eb
    fixed = non_expert + staging_b + kv_token * seq1 + scratch_0
    slot_row = L * eb  # one more slot in every MoE layer
    resident = min(E, (specter["total"] - fixed) // slot_row)
    return {
        "formula": "M' = min(E, floor((F_specter - non_expert - staging - kv_1 - scratch_1) / (L * expert_bytes)))",
        "specter_footprint": specter,
        "mo_sm_fixed": {"non_expert": non_expert, "staging_buffers": staging_b, "kv_cache": kv_token * seq1,
                        "scratch": scratch_0, "total": fixed},
        "L": L, "E": E, "expert_bytes": eb, "resident": int(resident), "staging_buffers": int(n_staging),
        "mo_sm_footprint": fixed + int(resident) * slot_row,
    }
