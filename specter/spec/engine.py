"""The speculative iteration loop over one shared model instance.

    committed prefix ──► draft K tokens (INT4 experts, ELB counts routes) ──► verify K+1 (target,
    expert-wise, offloaded experts) ──► accept/reject ──► commit accepted KV, drop the rest
                              │ at planner boundaries b_i: top-M plan → prefetch batch (copy link)

Names follow the paper: K draft length, p target probabilities, q draft probabilities, M cache
slots per layer, b_i planner boundaries. At temperature 0 the output equals target-only greedy
decoding token for token (greedy verification accepts a draft token only if it is the target's
argmax, and the correction/bonus token is the target's argmax).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from specter.decode.autoregressive import next_token
from specter.metrics import CommitClock
from specter.moe import RouteLog
from specter.offload.store import ExpertUID
from specter.predict.elb import ExpertLoadBuffer
from specter.predict.oracle import oracle_bytes
from specter.predict.planner import PlannerConfig, make_policy
from specter.spec.sampling import SamplingParams, draft_next, verify_window
from specter.spec.state import SequenceState


@dataclass
class WindowTrace:
    """Per-record accounting of speculative windows."""

    drafted: list[int] = field(default_factory=list)  # K per iteration
    accepted: list[int] = field(default_factory=list)  # accepted drafts per iteration
    predicted_hits: int = 0  # Σ |predicted ∩ actual| over windows and layers
    predicted: int = 0  # Σ |predicted|
    actual_capped: int = 0  # Σ min(|actual|, M): what any M-slot prediction could cover
    phases: list[tuple[str, int, int, int]] = field(default_factory=list)  # (phase, start, end, batch)


class SpeculativeEngine:
    """Draft with INT4 experts, prefetch by the planner, verify expert-wise with the target."""

    def __init__(self, rt: Any, K: int, params: SamplingParams, prefetch: str = "adaptive",
                 planner_config: PlannerConfig | None = None):
        if K < 1:
            raise ValueError(f"K must be >= 1, got {K}")
        self.rt, self.K, self.params, self.prefetch = rt, K, params, prefetch
        self.model = rt.model
        self.cache = rt.cache
        self.moe = rt.moe
        self.layers = rt.om.moe_layers
        self.capacity = {layer: self.cache.capacity(layer) for layer in self.layers}
        device = next(self.model.parameters()).device
        self.elb = ExpertLoadBuffer(self.layers, rt.om.num_experts, device) if prefetch in ("adaptive", "early", "late") else None
        self.planner = make_policy(prefetch, K, rt.om.store.nbytes_per_expert, planner_config)
        self.route_log = RouteLog()

    # ------------------------------------------------------------------------------ forward
    def _forward(self, ids: torch.Tensor, state: SequenceState, mode: str) -> torch.Tensor:
        self.moe.mode = mode
        self.moe.elb = self.elb if mode == "draft" else None
        self.moe.route_log = self.route_log if mode == "target" else None
        return self.model(input_ids=ids, cache=state.cache, use_cache=True).logits[0]  # [T, V]

    def _target(self, ids: torch.Tensor, state: SequenceState) -> torch.Tensor:
        self.route_log.begin_window()
        return self._forward(ids, state, "target")

    # ------------------------------------------------------------------------------ generate
    @torch.inference_mode()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None = None,
                 clock: CommitClock | None = None) -> tuple[list[int], dict[str, Any]]:
        clock = self.clock = clock or CommitClock()
        state = SequenceState.new(self.model)
        trace = WindowTrace()
        self.route_log = RouteLog()
        link = self.rt.link
        link0 = (link.bytes_copied, link.busy_seconds)
        clock.start()
        logits = self._target(prompt_ids, state)[-1]  # prefill: [V]
        state.start(prompt_ids.shape[1], next_token(logits, self.params, generator))
        clock.commit(1)
        device = prompt_ids.device
        while len(state.tokens) < max_new_tokens:
            K = min(self.K, max_new_tokens - len(state.tokens) - 1)
            last = torch.tensor([[state.last_token]], device=device)  # [1, 1]
            if K == 0:  # one token left: a plain target step
                tok = next_token(self._target(last, state)[-1], self.params, generator)
                state.commit([], tok)
                clock.commit(1)
                continue
            window0 = (link.bytes_copied, link.busy_seconds)
            drafts, q = self._draft(state, last, K, generator, trace)  # [K], [K, V] | None
            state.discard_extension()  # drop the draft scratch
            target_logits = self._target(torch.cat([last[0], drafts])[None], state)  # [K+1, V]
            self.cache.release_prefetches()  # mispredicted prefetches give their slots back
            self._score_prediction(trace)
            a, tok = verify_window(drafts, q, target_logits, self.params, generator)
            state.commit(drafts[:a].tolist(), tok)
            clock.commit(a + 1)
            trace.drafted.append(K)
            trace.accepted.append(a)
            moved, busy = link.bytes_copied - window0[0], link.busy_seconds - window0[1]
            if moved and busy > 0:  # the planner's bandwidth estimate follows the real link
                self.planner.observe_transfer(moved, busy)
        return state.tokens[:max_new_tokens], self._stats(trace, link.busy_seconds - link0[1])

    # ------------------------------------------------------------------------------ draft
    def _draft(self, state: SequenceState, last: torch.Tensor, K: int, generator, trace: WindowTrace):
        planner = self.planner
        planner.begin_window(K)
        self._window_predicted: dict[int, set[int]] = defaultdict(set)
        if self.prefetch == "oracle":
            self._oracle_prefetch(state, last, K)
        tokens, qs = [], []
        tok = last
        for step in range(1, K + 1):
            t0 = time.perf_counter()
            logits = self._forward(tok, state, "draft")[-1]  # [V]
            d, q = draft_next(logits, self.params, generator)
            tokens.append(d)
            qs.append(q)
            tok = d.view(1, 1)
            planner.observe_draft_step(time.perf_counter() - t0)
            if self.elb is not None and planner.next_boundary == step:
                self._boundary(step)
        if self.elb is not None:
            self.elb.clear()  # later evidence is discarded; nothing carries into the next window
        trace.phases.extend((c.phase, c.start, c.end, c.batch) for c in planner.trace)
        drafts = torch.stack(tokens)  # [K]
        return drafts, (torch.stack(qs) if qs[0] is not None else None)

    def _boundary(self, step: int) -> None:
        """Snapshot the ELB, pin predicted residents, prefetch the planner's incremental batch."""
        everything = {layer: self.rt.om.num_experts for layer in self.layers}
        ranked = self.elb.snapshot_plan(everything)  # every counted expert, by count; one D2H copy
        plan = {layer: experts[: self.capacity[layer]] for layer, experts in ranked.items()}  # top-M
        # A resident expert the draft routed to (count >= 1) is a likely verification hit: pin it, so
        # the batch below can only replace experts without predicted demand.
        for layer, experts in ranked.items():
            resident, pending = self.cache.resident(layer), self.cache.pending_prefetches(layer)
            for expert in experts:
                if expert in resident and expert not in pending:
                    self.cache.prefetch(ExpertUID(layer, expert))
                    self._window_predicted[layer].add(expert)
        resident = {layer: self.cache.resident(layer) for layer in self.layers}
        pending = {layer: self.cache.pending_prefetches(layer) for layer in self.layers}
        decision = self.planner.on_boundary(step, plan, resident, pending, self.capacity)
        for layer, expert in decision.batch:
            if self.cache.prefetch(ExpertUID(layer, expert)) is not None:  # None: every slot pinned
                self._window_predicted[layer].add(expert)

    def _oracle_prefetch(self, state: SequenceState, last: torch.Tensor, K: int) -> None:
        """Ablation upper bound: learn the target's true routes for this window with an untimed
        greedy dry run from the host store, then prefetch the top-M of them."""
        saved = self.route_log
        self.route_log = RouteLog()
        start = time.perf_counter()
        probe = SequenceState(state.cache, list(state.tokens), state.committed_kv)
        counts: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        tok = last
        with _host_mode(self.moe):
            for _ in range(K + 1):  # the K+1 verified positions of a fully accepted greedy window
                self.route_log.begin_window()  # one window per position: counts = positions using an expert
                tok = self._forward(tok, probe, "target")[-1].argmax().view(1, 1)
        probe.discard_extension()
        for window in self.route_log.windows:
            for layer, experts in window.items():
                for e in experts:
                    counts[layer][e] += 1
        self.route_log = saved
        for layer in self.layers:
            ranked = sorted(counts[layer], key=lambda e: (-counts[layer][e], e))[: self.capacity[layer]]
            for expert in ranked:
                self.cache.prefetch(ExpertUID(layer, expert))
            self._window_predicted[layer] |= set(ranked)
        self.clock.exclude(time.perf_counter() - start)  # the probe is not part of the measured run

    def _score_prediction(self, trace: WindowTrace) -> None:
        actual = self.route_log.windows[-1]
        for layer in self.layers:
            pred, act = self._window_predicted.get(layer, set()), actual.get(layer, set())
            trace.predicted_hits += len(pred & act)
            trace.predicted += len(pred)
            trace.actual_capped += min(len(act), self.capacity[layer])

    # ------------------------------------------------------------------------------ metrics
    def _stats(self, trace: WindowTrace, link_busy_s: float) -> dict[str, Any]:
        c = self.cache.snapshot_counters()
        drafted, accepted = sum(trace.drafted), sum(trace.accepted)
        oracle = oracle_bytes(self.rt, self.route_log)
        return {
            "K": self.K,
            "accepted_tokens": accepted,
            "drafted_tokens": drafted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_len": (accepted + len(trace.accepted)) / len(trace.accepted) if trace.accepted else None,
            "h2d_bytes": int(c["h2d_bytes"]),
            "demand_hits": int(c["demand_hits"]),
            "demand_misses": int(c["demand_misses"]),
            "copy_wait_ms": c["copy_wait_s"] * 1e3,
            "prefetch_precision": trace.predicted_hits / trace.predicted if trace.predicted else None,
            "prefetch_recall": trace.predicted_hits / trace.actual_capped if trace.predicted and trace.actual_capped else None,
            "oracle_h2d_bytes": oracle,
            "overlap_fraction": max(0.0, 1 - c["copy_wait_s"] / link_busy_s) if link_busy_s > 0 else None,
        }


@contextmanager
def _host_mode(moe):
    """Compute target experts straight from the host store (no cache traffic, no counters)."""
    moe.host_compute = True
    try:
        yield
    finally:
        moe.host_compute = False
