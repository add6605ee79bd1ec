"""The speculative iteration loop over one shared model instance.

    committed prefix ──► draft K tokens (INT4 experts, ELB counts routes) ──► verify K+1 (target,
    expert-wise, offloaded experts) ──► accept/reject ──► commit accepted KV, drop the rest
                              │ at planner boundaries b_i: top-M plan → prefetch batch (copy link)

Names follow the paper: K draft length, p target probabilities, q draft probabilities, M cache
slots per layer, b_i planner boundaries, α the per-token acceptance. At temperature 0 the output
equals target-only greedy decoding token for token (greedy verification accepts a draft token
only if it is the target's argmax, and the correction/bonus token is the target's argmax).

State between records: the expert cache is reset by the caller (outside timing). The planner's
bandwidth and draft-step estimates follow `planner_state`: "warm" restores the estimates
snapshotted by `mark_warm()` (after the warm-up) before every record, "cold" restores the paper's
initial values, "carry" keeps whatever the previous record learned.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from specter.metrics import CommitClock, io_stats
from specter.moe import ExpertFilter, RouteLog
from specter.offload.runtime import Runtime
from specter.offload.store import ExpertUID
from specter.predict.elb import ExpertLoadBuffer
from specter.predict.oracle import oracle_bytes, oracle_plan
from specter.predict.planner import POLICIES, PlannerConfig, PrefetchPlanner, make_policy
from specter.speculative.drafter import SharedDrafter
from specter.speculative.sampling import SamplingParams, draft_next, next_token, verify_window
from specter.speculative.state import SequenceState
from specter.speculative.timing import StepTimer
from specter.speculative.trace import WindowTracer

PlannerState = Literal["warm", "cold", "carry"]
PLANNER_STATES: tuple[str, ...] = ("warm", "cold", "carry")


@dataclass
class WindowTrace:
    """Per-record accounting of speculative windows."""

    drafted: list[int] = field(default_factory=list)  # K per iteration
    accepted: list[int] = field(default_factory=list)  # accepted drafts per iteration
    predicted_hits: int = 0  # Σ |predicted ∩ actual| over windows and layers
    predicted: int = 0  # Σ |predicted|: experts the planner's top-M plans named
    actual_capped: int = 0  # Σ min(|actual|, prediction size): what a prediction of that size could cover
    dropped_prefetches: int = 0  # planned loads that found every slot pinned
    phases: list[tuple[str, int, int, int]] = field(default_factory=list)  # (phase, start, end, batch)
    windows: list[dict[str, float]] = field(default_factory=list)  # per-window timing (draft, verify, link)


def acceptance_stats(drafted: list[int], accepted: list[int]) -> dict[str, float | None]:
    """accepted_fraction = Σa / ΣK; α = Σa / (Σa + rejections), the per-token acceptance whose
    geometric run length E[A] = α / (1 − α) the paper uses to bound K."""
    total_d, total_a = sum(drafted), sum(accepted)
    rejections = sum(1 for k, a in zip(drafted, accepted) if a < k)
    alpha = total_a / (total_a + rejections) if total_a + rejections else None
    return {
        "accepted_tokens": total_a,
        "drafted_tokens": total_d,
        "accepted_fraction": total_a / total_d if total_d else None,
        "acceptance_alpha": alpha,
        "mean_accepted_len": (total_a + len(accepted)) / len(accepted) if accepted else None,
    }


def plan_capacity(capacity: dict[int, int], staging: int, cap: int | None = None) -> dict[int, int]:
    """Experts a window's plan may keep per layer: its M slots plus a share of the S staging buffers,
    at most ``cap`` (the experts per layer a budgeted verification computes; None: no cap).

    Verification visits layers in order and a layer returns its borrowed buffers once it is done,
    so the buffers are split evenly, the remainder going to the earliest layers (needed first)."""
    layers = sorted(capacity)
    share, extra = divmod(staging, len(layers)) if layers else (0, 0)
    limit = cap if cap is not None else float("inf")
    return {layer: int(min(limit, capacity[layer] + share + (i < extra))) for i, layer in enumerate(layers)}


def prefetch_plan(cache, plan: dict[int, list[int]]) -> int:
    """Queue every expert of ``plan`` (layer -> experts); returns the loads dropped (every slot pinned)."""
    return sum(cache.prefetch(ExpertUID(layer, expert)) is None for layer, experts in plan.items() for expert in experts)


def prefetch_at_boundary(cache, planner, step: int, plan: dict[int, list[int]], capacity: dict[int, int]) -> int:
    """Make the plan's top-M experts resident: pin the ones already resident, load the planner's batch.

    Only residents the plan keeps are pinned, so the batch can always replace the others; a load
    that still finds every slot pinned is dropped and counted (returned), never silent.
    """
    for layer, experts in plan.items():
        resident, pending = cache.resident(layer), cache.pending_prefetches(layer)
        for expert in experts:
            if expert in resident and expert not in pending:
                cache.prefetch(ExpertUID(layer, expert))
    resident = {layer: cache.resident(layer) for layer in capacity}
    pending = {layer: cache.pending_prefetches(layer) for layer in capacity}
    decision = planner.on_boundary(step, plan, resident, pending, capacity)
    return sum(cache.prefetch(ExpertUID(layer, expert)) is None for layer, expert in decision.batch)


class SpeculativeEngine:
    """Draft with INT4 experts, prefetch by the planner, verify expert-wise with the target."""

    batched = False  # True: forwards carry per-row positions and masks (BatchedSpeculativeEngine)

    def __init__(self, rt: Runtime, K: int, params: SamplingParams, prefetch: str = "adaptive",
                 planner_config: PlannerConfig | None = None, planner_state: PlannerState = "warm",
                 expert_filter: ExpertFilter | None = None, plan_cap: int | None = None,
                 planner: PrefetchPlanner | None = None, drafter: SharedDrafter | None = None):
        """``planner`` (a policy object) replaces the named ``prefetch`` policy; ``drafter`` replaces the
        shared-instance INT4 draft; ``expert_filter`` applies to verification passes only."""
        if K < 1:
            raise ValueError(f"K must be >= 1, got {K}")
        if planner is None and prefetch not in POLICIES:
            raise ValueError(f"unknown prefetch policy {prefetch!r}; choose one of {POLICIES}")
        if planner_state not in PLANNER_STATES:
            raise ValueError(f"unknown planner_state {planner_state!r}; choose one of {PLANNER_STATES}")
        self.planner = planner or make_policy(prefetch, K, rt.om.store.nbytes_per_expert, planner_config)
        self.rt, self.K, self.params, self.prefetch = rt, K, params, self.planner.name
        self.planner_state = planner_state
        self.expert_filter = expert_filter
        # single-request forwards: the compact decoder or the transformers model; batched forwards need
        # per-row positions and masks, which only transformers' modules take
        self.model = rt.model if self.batched else rt.forward_model
        self.cache = rt.cache
        self.moe = rt.moe
        self.drafter = drafter or SharedDrafter(self.model, self.moe)
        self.layers = rt.om.moe_layers
        self.capacity = {layer: self.cache.capacity(layer) for layer in self.layers}  # M per layer
        # experts a window's plan keeps per layer; a verifier that computes at most `plan_cap` experts per
        # layer (MoE-Spec's budget) caps it, so the planner predicts no more than verification can use
        self.plan_capacity = plan_capacity(self.capacity, getattr(self.cache, "staging", 0), plan_cap)
        self.device = next(rt.model.parameters()).device
        counted = self.prefetch not in ("none", "oracle")  # the oracle plans from a probe, not the ELB
        self.elb = ExpertLoadBuffer(self.layers, rt.om.num_experts, self.device) if counted else None
        self.cold = self.warm = self.planner.snapshot()
        self.route_log = RouteLog()
        self.timer = StepTimer(self.device)
        self.trace_windows = False  # True: record a WindowTracer per generate() (host-timed links)
        self.tracer: WindowTracer | None = None

    # ------------------------------------------------------------------------------ state
    def mark_warm(self) -> None:
        """Snapshot the planner's estimates (call after the warm-up); "warm" records start from it."""
        self.warm = self.planner.snapshot()

    def reset(self) -> None:
        """Bring the planner to the documented per-record state (the caller resets the cache)."""
        if self.planner_state == "warm":
            self.planner.restore(self.warm)
        elif self.planner_state == "cold":
            self.planner.restore(self.cold)

    # ------------------------------------------------------------------------------ forward
    def _forward(self, ids: torch.Tensor, state: SequenceState, mode: str, host_compute: bool = False) -> torch.Tensor:
        if mode == "draft":
            return self.drafter.forward(ids, state, self.elb)  # [T, V]
        verifying = state.committed_kv > 0  # the prefill runs the full router
        with self.moe.mode("target", route_log=self.route_log, host_compute=host_compute,
                           expert_filter=self.expert_filter if verifying else None, tracer=self.tracer):
            return self.model(input_ids=ids, cache=state.cache, use_cache=True).logits[0]  # [T, V]

    def _target(self, ids: torch.Tensor, state: SequenceState) -> torch.Tensor:
        self.route_log.begin_window()
        return self._forward(ids, state, "target")

    # ------------------------------------------------------------------------------ generate
    @torch.inference_mode()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None = None,
                 clock: CommitClock | None = None) -> tuple[list[int], dict[str, Any]]:
        clock = self.clock = clock or CommitClock()
        state = SequenceState.new(self.model, prompt_ids.shape[1] + max_new_tokens + self.K + 2)
        self.drafter.begin(prompt_ids)
        trace = self.trace = WindowTrace()
        self.route_log = RouteLog()
        link = self.rt.link
        link0 = link.busy_seconds
        tracer = self.tracer = WindowTracer() if self.trace_windows else None
        link.observer = tracer.on_copy if tracer else None
        try:
            return self._generate(prompt_ids, max_new_tokens, generator, clock, state, trace, link, link0, tracer)
        finally:
            link.observer = None

    def _generate(self, prompt_ids, max_new_tokens, generator, clock, state, trace, link, link0, tracer):
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
            if tracer is not None:
                tracer.begin_window({layer: self.cache.resident(layer) for layer in self.layers}, K)
            t0 = time.perf_counter()
            drafts, q = self._draft(state, last, K, generator, trace)  # [K], [K, V] | None
            self.drafter.end_window(state)
            t1 = time.perf_counter()
            target_logits = self._target(torch.cat([last[0], drafts])[None], state)  # [K+1, V]
            self.cache.release_prefetches()  # mispredicted prefetches give their slots back
            self._score_prediction(trace)
            a, tok = verify_window(drafts, q, target_logits, self.params, generator)
            t2 = time.perf_counter()
            state.commit(drafts[:a].tolist(), tok)
            clock.commit(a + 1)
            trace.drafted.append(K)
            trace.accepted.append(a)
            moved, busy = link.bytes_copied - window0[0], link.busy_seconds - window0[1]
            trace.windows.append({"draft_s": t1 - t0, "verify_s": t2 - t1, "h2d_bytes": moved, "link_busy_s": busy})
            if tracer is not None:
                info = tracer.windows[-1]
                info.draft_ms, info.verify_ms, info.accepted = (t1 - t0) * 1e3, (t2 - t1) * 1e3, a
                info.used = {layer: set(e) for layer, e in self.route_log.windows[-1].items()}
                tracer.span("draft", t0, t1)
                tracer.span("verify", t1, t2)
            if moved and busy > 0:  # the planner's bandwidth estimate follows the real link
                self.planner.observe_transfer(moved, busy)
        return state.tokens[:max_new_tokens], self._stats(trace, link.busy_seconds - link0)

    # ------------------------------------------------------------------------------ draft
    def _draft(self, state: SequenceState, last: torch.Tensor, K: int, generator, trace: WindowTrace):
        planner = self.planner
        self.drafter.begin_window(state)
        planner.begin_window(K)
        self._window_predicted: dict[int, set[int]] = defaultdict(set)
        if self.prefetch == "oracle":
            self._oracle_prefetch(state, last, K)
        tokens, qs = [], []
        tok = last
        self.timer.start()
        for step in range(1, K + 1):
            logits = self._forward(tok, state, "draft")[-1]  # [V]
            d, q = draft_next(logits, self.params, generator)
            tokens.append(d)
            qs.append(q)
            tok = d.view(1, 1)
            self.timer.lap()
            if self.elb is not None and planner.next_boundary == step:
                for seconds in self.timer.harvest():
                    planner.observe_draft_step(seconds)
                self._boundary(step, trace)
        for seconds in self.timer.harvest():
            planner.observe_draft_step(seconds)
        if self.elb is not None:
            self.elb.clear()  # later evidence is discarded; nothing carries into the next window
        trace.phases.extend((c.phase, c.start, c.end, c.batch) for c in planner.trace)
        drafts = torch.stack(tokens)  # [K]
        return drafts, (torch.stack(qs) if qs[0] is not None else None)

    def _boundary(self, step: int, trace: WindowTrace) -> None:
        """Snapshot the ELB's top-M plan and act on it (see `prefetch_at_boundary`)."""
        plan = self.elb.snapshot_plan(self.plan_capacity)  # layer -> top-(M+s) counted experts; one D2H copy
        for layer, experts in plan.items():
            self._window_predicted[layer].update(experts)
        t0 = time.perf_counter()
        before = self.rt.link.bytes_copied
        trace.dropped_prefetches += prefetch_at_boundary(self.cache, self.planner, step, plan, self.plan_capacity)
        if self.tracer is not None:
            self.tracer.span("boundary", t0, time.perf_counter(), bytes=self.rt.link.bytes_copied - before,
                             phase=f"step {step}: {self.planner.trace[-1].phase}")

    def _oracle_prefetch(self, state: SequenceState, last: torch.Tensor, K: int) -> None:
        """Ablation upper bound: learn the target's true routes for this window with an untimed
        greedy dry run from the host store, then prefetch the top-M of them."""
        saved = self.route_log
        self.route_log = RouteLog()
        start = time.perf_counter()
        probe = SequenceState(state.cache, list(state.tokens), state.committed_kv)
        tok = last
        for _ in range(K + 1):  # the K+1 verified positions of a fully accepted greedy window
            self.route_log.begin_window()  # one window per position: counts = positions using an expert
            tok = self._forward(tok, probe, "target", host_compute=True)[-1].argmax().view(1, 1)
        probe.discard_extension()
        windows, self.route_log = self.route_log.windows, saved
        self._prefetch_oracle_plan(oracle_plan(windows, self.plan_capacity))
        self.clock.exclude(time.perf_counter() - start)  # the probe is not part of the measured run

    def _prefetch_oracle_plan(self, plan: dict[int, list[int]]) -> None:
        self.trace.dropped_prefetches += prefetch_plan(self.cache, plan)
        for layer, experts in plan.items():
            self._window_predicted[layer] |= set(experts)

    def _score_prediction(self, trace: WindowTrace) -> None:
        actual = self.route_log.windows[-1]
        for layer in self.layers:
            pred, act = self._window_predicted.get(layer, set()), actual.get(layer, set())
            trace.predicted_hits += len(pred & act)
            trace.predicted += len(pred)
            trace.actual_capped += min(len(act), max(len(pred), self.plan_capacity[layer]))

    # ------------------------------------------------------------------------------ metrics
    def _stats(self, trace: WindowTrace, link_busy_s: float) -> dict[str, Any]:
        io = io_stats(self.cache, link_busy_s)
        return {
            "K": self.K,
            **acceptance_stats(trace.drafted, trace.accepted),
            **io,
            "prefetch_precision": trace.predicted_hits / trace.predicted if trace.predicted else None,
            "prefetch_recall": trace.predicted_hits / trace.actual_capped if trace.predicted and trace.actual_capped else None,
            "dropped_prefetches": trace.dropped_prefetches,
            "oracle_h2d_bytes": oracle_bytes(self.rt, self.route_log),
        }
