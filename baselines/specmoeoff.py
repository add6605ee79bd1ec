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
target keeps fewer residents because the draft's copy takes their memory. Greedy output equals
target-only decoding (same verification).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import DynamicCache

from specter.harness.compose import CONF_DIR
from specter.harness.config import ConfigError
from specter.harness.methods import Method, Specter
from specter.harness.runtime import build_runtime, gptq_draft_for, resize_cache
from specter.kernels.select import select_draft_kernel
from specter.models.loading import non_expert_bytes
from specter.moe import MoERuntime
from specter.offload.budget import Footprint
from specter.offload.runtime import Runtime
from specter.predict.planner import PlannerConfig, PrefetchPlanner
from specter.quant.draft import build_draft, draft_forward
from specter.speculative.batch_state import BatchKV
from specter.speculative.batched import BatchedSpeculativeEngine
from specter.speculative.engine import SpeculativeEngine
from specter.speculative.sampling import SamplingParams
from specter.speculative.state import SequenceState


class RouteFrequencyPlanner(PrefetchPlanner):
    """Plans at fixed draft-step counts int(f·K), each the top-M experts the draft routed to most."""

    name = "route_frequency"

    def __init__(self, K: int, expert_bytes: int, fractions: Sequence[float]):
        self.fractions = tuple(float(f) for f in fractions)
        super().__init__(PlannerConfig(), K, expert_bytes)

    def steps(self) -> list[int]:
        """Boundaries of this window; a step count of 0 has no routes to rank and is skipped."""
        return sorted({int(f * self.K) for f in self.fractions} & set(range(1, self.K + 1)))

    def _first_boundary(self) -> int | None:
        steps = self.steps()
        return steps[0] if steps else None

    def _schedule(self, step: int, batch_bytes: int) -> int | None:
        return next((s for s in self.steps() if s > step), None)


class SeparateDraftEngine(SpeculativeEngine):
    """The speculative loop with a draft that is its own model instance and keeps its own KV cache.

    The draft's cache holds draft KV for a prefix of the committed sequence; before each window it
    is cropped to what the target committed (accepted drafts keep their KV) and the committed
    tokens it has not seen yet (the prompt, a bonus-accepted last draft) are fed with the window's
    first draft step.
    """

    def __init__(self, rt: Runtime, draft_model: torch.nn.Module, draft_moe: MoERuntime, K: int,
                 params: SamplingParams, planner: PrefetchPlanner):
        super().__init__(rt, K, params, prefetch="early")  # a counted policy: the engine keeps an ELB
        self.planner, self.prefetch = planner, planner.name
        self._cold = self._warm = (planner.bandwidth, planner.draft_step)
        self.draft_model, self.draft_moe = draft_model, draft_moe

    def generate(self, prompt_ids, max_new_tokens, generator=None, clock=None):
        self._prompt: list[int] = prompt_ids[0].tolist()
        self._draft_cache = DynamicCache(config=self.draft_model.config)
        self._unseen: list[int] = []
        return super().generate(prompt_ids, max_new_tokens, generator, clock)

    def _draft(self, state: SequenceState, last: torch.Tensor, K: int, generator, trace):
        have = self._draft_cache.get_seq_length()
        if have > state.committed_kv:  # rejected drafts
            self._draft_cache.crop(state.committed_kv - have)
        committed = self._prompt + state.tokens  # the last one is the uncached input `last`
        self._unseen = committed[min(have, state.committed_kv):state.committed_kv]
        return super()._draft(state, last, K, generator, trace)

    def _forward(self, ids: torch.Tensor, state: SequenceState, mode: str, host_compute: bool = False) -> torch.Tensor:
        if mode != "draft":
            return super()._forward(ids, state, mode, host_compute)
        if self._unseen:
            ids = torch.cat([torch.tensor([self._unseen], device=ids.device), ids], dim=1)  # [1, n+1]
            self._unseen = []
        with self.draft_moe.mode("draft", elb=self.elb):
            return self.draft_model(input_ids=ids, cache=self._draft_cache, use_cache=True).logits[0]  # [T, V]


class BatchedSeparateDraftEngine(BatchedSpeculativeEngine):
    """`SeparateDraftEngine` over B requests: the draft model keeps its own batched cache (a `BatchKV`
    in the target's row order); verification, acceptance and the target cache are Specter's batched ones.

    Between windows the draft cache holds each request's committed tokens but the last two, and the
    window's first draft step feeds those two (``[B, 2]``), so every row has the same shape whatever
    it accepted before; after verification a row keeps a+1 of the window's Kb+1 draft columns, which
    restores that invariant. At admission the prompts are prefilled (padding masked) and their last
    position given back. Prompt routes are not counted into the ELB (padded rows would be counted).
    """

    def __init__(self, rt: Runtime, draft_model: torch.nn.Module, draft_moe: MoERuntime, K: int,
                 params: SamplingParams, planner: PrefetchPlanner, max_holes: int = 0):
        self.draft_model, self.draft_moe = draft_model, draft_moe
        super().__init__(rt, K, params, prefetch="early", max_holes=max_holes)  # counted: keeps an ELB
        self.planner, self.prefetch = planner, planner.name
        self._cold = self._warm = (planner.bandwidth, planner.draft_step)

    def begin_run(self) -> None:
        super().begin_run()
        self.draft_kv = BatchKV(self.draft_model.config, self.device, self.max_holes)

    def _run_draft(self, ids, position_ids, mask, cache, elb) -> torch.Tensor:
        with self.draft_moe.mode("draft", elb=elb):
            return self.draft_model(input_ids=ids, position_ids=position_ids, attention_mask=mask, cache=cache,
                                    use_cache=True).logits  # [B, T, V]

    def _join(self, fresh: BatchKV, prompts: list[torch.Tensor]) -> None:
        super()._join(fresh, prompts)
        draft = BatchKV(self.draft_model.config, self.device, self.max_holes)
        ids, positions, mask = draft.prefill_inputs(prompts, getattr(self.draft_model.config, "pad_token_id", None) or 0)
        self._run_draft(ids, positions, mask, draft.cache, elb=None)
        draft.uncommit_last()  # the first window feeds it again, beside the first uncached token
        self.draft_kv.merge(draft)

    def _keep_rows(self, rows: list[int]) -> None:
        super()._keep_rows(rows)
        self.draft_kv.select(rows)

    def _first_draft_input(self, last: torch.Tensor) -> torch.Tensor:
        before = torch.tensor([(r.prompt + r.tokens)[-2] for r in self.active], device=last.device)  # [B]
        return torch.cat([before[:, None], last], dim=1)  # [B, 2]

    def _draft_step(self, tok: torch.Tensor) -> torch.Tensor:
        position_ids, mask = self.draft_kv.forward_inputs(tok.shape[1])
        self.draft_kv.appended(tok.shape[1])
        return self._run_draft(tok, position_ids, mask, self.draft_kv.cache, self.elb)[:, -1]  # [B, V]

    def _end_draft(self) -> None:
        """The target's cache holds no draft scratch."""

    def _commit_draft(self, accepted: list[int]) -> None:
        self.draft_kv.commit([a + 1 for a in accepted])


def real_expert_count(cfg: DictConfig) -> int:
    """Routed experts of the real model a tiny one mirrors (the presets are counts of those)."""
    real = cfg.model.get("real")
    if cfg.model.source != "tiny" or not real:
        return int(cfg.model.num_experts)
    return int(OmegaConf.load(CONF_DIR / "model" / f"{real}.yaml").published.num_experts)  # the published checkpoint's


class SpecMoEOff(Specter):
    """SpecMoEOff's preset: K=3, separate draft and KV, route-frequency prefetch, fewer residents."""

    name = "specmoeoff"

    def __init__(self, cfg: DictConfig, checkpoint: Path):
        Method.__init__(self, cfg, checkpoint)  # not Specter's: no shared-instance draft here
        m = cfg.method
        self.K = int(cfg.K) if cfg.get("K") is not None else int(m.K)
        if self.K < 1:
            raise ConfigError(f"method.K must be >= 1, got {self.K}")
        if not m.prefetch_at or not all(0 <= f <= 1 for f in m.prefetch_at):
            raise ConfigError(f"method.prefetch_at must be fractions of K in [0, 1], got {list(m.prefetch_at)}")
        if cfg.memory.name not in m.residents:
            raise ConfigError(f"method.residents has no entry for memory={cfg.memory.name} (it has {list(m.residents)})")
        E = int(cfg.model.num_experts)
        preset = max(1, min(E, round(int(m.residents[cfg.memory.name]) * E / real_expert_count(cfg))))
        self.quant = m.quant
        self.rt = build_runtime(cfg, checkpoint, K=self.K, resident=preset)
        try:
            packed, self.draft_info = gptq_draft_for(cfg, self.rt, checkpoint) if self.quant == "gptq" else (None, {})
            self.kernel_choice = select_draft_kernel(cfg.hardware.draft_kernel, self.device, self.dtype)
            experts = build_draft(self.rt.om, self.quant, self.device, self.dtype, packed_layers=packed,
                                  kernel=self.kernel_choice.selected)
            self.draft_bytes = sum(d.nbytes for d in experts.values())
            fp = self.rt.footprint
            # The draft's own copy of every non-expert tensor, its KV for the same positions, its scratch.
            self.draft_extra = {"non_expert": non_expert_bytes(self.rt.model), "kv_cache": fp.kv_cache,
                                "scratch": fp.scratch}
            fixed = fp.total - fp.cache_slots + self.draft_bytes + sum(self.draft_extra.values())
            slot_row = len(self.rt.om.moe_layers) * self.rt.om.store.nbytes_per_expert
            fits = max(1, (self.rt.budget_bytes - fixed) // slot_row)
            self.residents = {"preset": int(m.residents[cfg.memory.name]), "of_real_experts": real_expert_count(cfg),
                              "scaled": preset, "fit_in_budget": int(fits), "used": int(min(preset, fits))}
            if self.residents["used"] != preset:
                self.rt = resize_cache(self.rt, self.residents["used"])
            # The draft instance only ever runs in draft mode; the target's cache is never read through it.
            self.draft_moe = MoERuntime(self.rt.cache, draft=experts, draft_forward=draft_forward)
            self.draft_model = copy.deepcopy(self.rt.model, memo={id(self.rt.moe): self.draft_moe})
        except BaseException:
            self.rt.close()
            raise
        self.rt.enforce_budget(f"{cfg.model.name} specmoeoff at memory={cfg.memory.name} (M={self.rt.resident})",
                               draft_bytes=self.draft_bytes, extra_bytes=sum(self.draft_extra.values()))
        planner = RouteFrequencyPlanner(self.K, self.rt.om.store.nbytes_per_expert, m.prefetch_at)
        self.engine = SeparateDraftEngine(self.rt, self.draft_model, self.draft_moe, self.K, self.params, planner)
        self.verify = bool(cfg.verify_lossless) and self.params.temperature == 0
        self.tie_tolerance = float(cfg.get("lossless_tie_tolerance", 0.0))

    def make_batch_engine(self) -> BatchedSeparateDraftEngine:
        planner = RouteFrequencyPlanner(self.K, self.rt.om.store.nbytes_per_expert, self.cfg.method.prefetch_at)
        return BatchedSeparateDraftEngine(self.rt, self.draft_model, self.draft_moe, self.K, self.params, planner)

    def batch_footprint(self, B: int) -> Footprint:
        """At batch size B the separate draft's KV cache and scratch grow with B too."""
        fp, d = self.rt.footprint, self.draft_extra
        return replace(fp, kv_cache=B * fp.kv_cache, scratch=B * fp.scratch,
                       draft_experts=fp.draft_experts + (B - 1) * (d["kv_cache"] + d["scratch"]))

    def static_fields(self) -> dict[str, Any]:
        return {"K": self.K, "draft_quant": self.quant, "schedule": self.rt.moe.schedule,
                "prefetch": self.engine.prefetch, "resident_experts": self.rt.resident}

    def environment(self) -> dict[str, Any]:
        return {**self.rt.environment(), "K": self.K, "draft_quant": self.quant, "draft_bytes": self.draft_bytes,
                "separate_draft_bytes": self.draft_extra, "residents": self.residents,
                "prefetch_steps": self.engine.planner.steps(), **self.draft_info}
