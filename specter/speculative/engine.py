"""The speculative window loop over one shared model instance, for B requests (B = 1 included).

    committed prefixes ──► draft Kb tokens each (INT4 experts, the ELB counts every request's routes)
         ──► verify B×(Kb+1) (target, expert-wise, offloaded experts; one load serves every request)
         ──► accept/reject per request ──► commit accepted KV, drop the rest
                   │ at planner boundaries b_i: top-M plan → prefetch batch (copy link)

One loop, two kinds of rows: `generate()` decodes one request on the decode path's own cache
(`state.SequenceKV`: the compact decoder's StaticKVCache, or a DynamicCache), `generate_batch()`
B requests on transformers' modules (`batch_state.BatchKV`: per-row positions, masks, holes).
Admission, retirement and the commit of every request come from `batched.BatchLoop`.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from specter.metrics import CommitClock, io_stats, window_routing
from specter.moe import ExpertFilter, RouteLog
from specter.offload.instruments import Instruments
from specter.offload.runtime import Runtime
from specter.offload.store import ExpertUID
from specter.predict.elb import ExpertLoadBuffer
from specter.predict.oracle import load_columns, oracle_bytes, oracle_plan
from specter.predict.planner import POLICIES, PlannerConfig, PrefetchPlanner, make_policy
from specter.speculative.batch_state import Request
from specter.speculative.batched import BatchLoop, BatchRun, greedy_verify_batch, padding_filter, working_set
from specter.speculative.drafter import SharedDrafter
from specter.speculative.sampling import SamplingParams, draft_next, next_token, verify_window
from specter.speculative.state import SequenceKV
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
    retention_hits: int = 0  # Σ over windows and layers: experts resident at the window's start that it used
    retention_reloads: int = 0  # of those, the ones evicted during the window and loaded again
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


class WindowRecorder:
    """Everything one run records about its windows, kept apart from the loop that makes them.

    Per run (`begin_run`): the `WindowTrace` counters, the target's route log, the verification
    windows among its entries, the optional `WindowTracer`, the iterations and the link's busy
    time at the start. Per window: its timing marks, the link's bytes and busy time, the experts
    the window's plans predicted (scored against what verification used)."""

    def __init__(self, link, layers: list[int], trace_windows: bool = False):
        self.link, self.layers, self.trace_windows = link, layers, trace_windows
        self.begin_run()

    def begin_run(self) -> None:
        self.trace = WindowTrace()
        self.route_log = RouteLog()
        self.tracer = WindowTracer() if self.trace_windows else None
        self.verify_windows: list[int] = []  # route-log windows of verification passes
        self.iterations = 0
        self.busy0 = self.link.busy_seconds
        self.predicted: dict[int, set[int]] = defaultdict(set)
        self.marks: list[float] = []
        self.window0 = (0, 0.0)
        self.start_residents: dict[int, set[int]] = {}
        self.loads0 = 0

    def observing(self):
        """While the run steps: the link reports every copy to the tracer (when tracing)."""
        return _LinkObserver(self.link, self.tracer.on_copy if self.tracer is not None else None)

    def begin_window(self, cache, Kb: int) -> None:
        self.window0 = (self.link.bytes_copied, self.link.busy_seconds)
        self.predicted = defaultdict(set)
        self.cache = cache
        self.start_residents = {layer: cache.resident(layer) for layer in self.layers}
        self.loads0 = len(cache.load_log)
        if self.tracer is not None:
            self.tracer.begin_window({layer: cache.resident(layer) for layer in self.layers}, Kb)
        self.marks = [time.perf_counter()]

    def lap(self) -> None:
        """The window's current phase ended (draft, then verification)."""
        self.marks.append(time.perf_counter())

    def verified(self) -> None:
        """The last route-log window was a verification pass (the working-set columns count those)."""
        self.verify_windows.append(len(self.route_log.windows) - 1)

    def plan(self, plan: dict[int, list[int]]) -> None:
        """Experts a plan of this window predicted (scored by `score_prediction`)."""
        for layer, experts in plan.items():
            self.predicted[layer].update(experts)

    def boundary(self, start: float, bytes_before: int, step: int, phase: str, dropped: int) -> None:
        self.trace.dropped_prefetches += dropped
        if self.tracer is not None:
            self.tracer.span("boundary", start, time.perf_counter(), bytes=self.link.bytes_copied - bytes_before,
                             phase=f"step {step}: {phase}")

    def score_prediction(self, plan_capacity: dict[int, int]) -> None:
        actual, trace = self.route_log.windows[-1], self.trace
        for layer in self.layers:
            pred, act = self.predicted.get(layer, set()), actual.get(layer, set())
            trace.predicted_hits += len(pred & act)
            trace.predicted += len(pred)
            trace.actual_capped += min(len(act), max(len(pred), plan_capacity[layer]))

    def end_window(self, reqs: list[Request], limits: list[int], accepted: list[int], Kb: int) -> tuple[int, float]:
        """Count the window's drafts and acceptances; returns the link's (bytes, busy seconds) during it."""
        t0, t1, t2 = self.marks
        for b, req in enumerate(reqs):
            if limits[b] > 0:
                req.drafted.append(limits[b])
                req.accepted.append(accepted[b])
        self.trace.drafted.append(sum(limits))
        self.trace.accepted.append(sum(accepted))
        used = self.route_log.windows[-1]
        reloaded = set(self.cache.load_log[self.loads0:])
        for layer in self.layers:
            kept = self.start_residents.get(layer, set()) & used.get(layer, set())
            self.trace.retention_hits += len(kept)
            self.trace.retention_reloads += sum((layer, e) in reloaded for e in kept)
        moved, busy = self.link.bytes_copied - self.window0[0], self.link.busy_seconds - self.window0[1]
        self.trace.windows.append({"draft_s": t1 - t0, "verify_s": t2 - t1, "h2d_bytes": moved,
                                   "link_busy_s": busy, "batch": len(reqs), "Kb": Kb})
        if self.tracer is not None:
            info = self.tracer.windows[-1]
            info.draft_ms, info.verify_ms, info.accepted = (t1 - t0) * 1e3, (t2 - t1) * 1e3, sum(accepted)
            info.used = {layer: set(e) for layer, e in self.route_log.windows[-1].items()}
            self.tracer.span("draft", t0, t1)
            self.tracer.span("verify", t1, t2)
        self.iterations += 1
        return moved, busy


class _LinkObserver:
    def __init__(self, link, observer):
        self.link, self.observer = link, observer

    def __enter__(self):
        self.link.observer = self.observer

    def __exit__(self, *exc):
        self.link.observer = None


class PlannerMemory:
    """The planner's estimates at the start of each record: "warm" (the snapshot `mark_warm` took after
    the warm-up), "cold" (the paper's initial values) or "carry" (whatever the previous record learned)."""

    def __init__(self, planner: PrefetchPlanner, state: PlannerState):
        if state not in PLANNER_STATES:
            raise ValueError(f"unknown planner_state {state!r}; choose one of {PLANNER_STATES}")
        self.planner, self.state = planner, state
        self.cold = self.warm = planner.snapshot()

    def mark_warm(self) -> None:
        self.warm = self.planner.snapshot()

    def reset(self) -> None:
        if self.state == "warm":
            self.planner.restore(self.warm)
        elif self.state == "cold":
            self.planner.restore(self.cold)


class WindowPrefetch:
    """What a window prefetches while it drafts. This one: nothing (``prefetch=none``)."""

    elb: ExpertLoadBuffer | None = None  # the draft's route counts (None: nothing counts them)

    def before_draft(self, engine: SpeculativeEngine, last: torch.Tensor, Kb: int) -> None:
        """Before the window's first draft step."""

    def boundary(self, engine: SpeculativeEngine, step: int) -> None:
        """At a planner boundary (after draft step ``step``), where the draft's routes are counted."""

    def end_draft(self) -> None:
        """After the window's last draft step."""


class BoundaryPrefetch(WindowPrefetch):
    """The paper's prefetch: the ELB counts the draft's routes; at each planner boundary b_i its top-M
    plan per layer is made resident (`prefetch_at_boundary`)."""

    def __init__(self, layers: list[int], num_experts: int, device: torch.device):
        self.elb = ExpertLoadBuffer(layers, num_experts, device)

    def boundary(self, engine: SpeculativeEngine, step: int) -> None:
        cache = engine.rt.cache
        if cache.wants_hints:  # the residency policy keeps every resident the draft has routed to so far
            ranked = self.elb.snapshot_plan({layer: self.elb.num_experts for layer in engine.plan_capacity})
            for layer, experts in ranked.items():
                cache.predict(layer, experts, {e: len(experts) - i for i, e in enumerate(experts)})
            plan = {layer: ranked[layer][:m] for layer, m in engine.plan_capacity.items()}  # the same top-(M+s)
        else:
            plan = self.elb.snapshot_plan(engine.plan_capacity)  # layer -> top-(M+s) counted experts; one D2H copy
        if engine.rt.moe.meter is not None:
            engine.rt.moe.meter.readback()
        engine.recorder.plan(plan)
        t0, before = time.perf_counter(), engine.rt.link.bytes_copied
        dropped = prefetch_at_boundary(engine.rt.cache, engine.planner, step, plan, engine.plan_capacity)
        engine.recorder.boundary(t0, before, step, engine.planner.trace[-1].phase, dropped)

    def end_draft(self) -> None:
        self.elb.clear()  # later evidence is discarded; nothing carries into the next window


class OraclePrefetch(WindowPrefetch):
    """Ablation upper bound: an untimed greedy dry run of Kb+1 steps from the host store learns the
    target's true experts for every request; the top-M per layer (by steps using them) are prefetched."""

    def before_draft(self, engine: SpeculativeEngine, last: torch.Tensor, Kb: int) -> None:
        log, start, tok = RouteLog(), time.perf_counter(), last
        for _ in range(Kb + 1):  # the Kb+1 verified positions of a fully accepted greedy window
            log.begin_window()  # one window per position: counts = positions using an expert
            tok = engine.probe_pass(tok, log)[:, -1].argmax(-1)[:, None]
        engine.kv.discard_pending()
        plan = oracle_plan(log.windows, engine.plan_capacity)
        if engine.rt.cache.wants_hints:
            for layer, experts in plan.items():
                engine.rt.cache.predict(layer, experts)
        engine.recorder.trace.dropped_prefetches += prefetch_plan(engine.rt.cache, plan)
        engine.recorder.plan(plan)
        spent = time.perf_counter() - start
        for req in engine.active:
            req.clock.exclude(spent)  # the probe is not part of the measured run


def window_prefetch(policy: str, layers: list[int], num_experts: int, device: torch.device) -> WindowPrefetch:
    """The prefetch a named policy makes: none, the oracle's, or the ELB's at the planner's boundaries."""
    if policy == "none":
        return WindowPrefetch()
    if policy == "oracle":
        return OraclePrefetch()
    return BoundaryPrefetch(layers, num_experts, device)


RowFactory = Callable[[list[Request]], Any]  # entering requests -> empty KV rows for them


@dataclass(frozen=True)
class WindowSettings:
    """What every window of an engine drafts, verifies and keeps by: up to ``K`` draft tokens per
    request, the sampling ``params``, the verification-time ``expert_filter`` (None: every routed
    expert, lossless) and the rejected KV columns kept masked before a compaction (``max_holes``)."""

    K: int
    params: SamplingParams
    expert_filter: ExpertFilter | None = None
    max_holes: int = 0

    def __post_init__(self) -> None:
        if self.K < 1:
            raise ValueError(f"K must be >= 1, got {self.K}")


class SpeculativeEngine(BatchLoop):
    """Draft with INT4 experts, prefetch by the planner, verify expert-wise with the target.

    The ELB counts the draft routes of all B requests, so the planner's top-M plan per layer is the
    union working set ranked by how many (request, step) pairs routed to each expert.
    """

    # The time source the planner's draft-step estimate is read from (seconds); None: the host's clock
    # (CUDA events on a GPU). A modelled device hands in its own (`Instruments`, specter/projection/virtual.py).
    step_clock: Callable[[], float] | None = None

    def __init__(self, rt: Runtime, K: int, params: SamplingParams, prefetch: str = "adaptive",
                 planner_config: PlannerConfig | None = None, planner_state: PlannerState = "warm",
                 expert_filter: ExpertFilter | None = None, plan_cap: int | None = None,
                 planner: PrefetchPlanner | None = None, drafter: SharedDrafter | None = None, max_holes: int = 0,
                 trace_windows: bool = False, instruments: Instruments | None = None):
        """``planner`` (a policy object) replaces the named ``prefetch`` policy; ``drafter`` replaces the
        shared-instance INT4 draft; ``expert_filter`` applies to verification passes only;
        ``trace_windows`` records a `WindowTracer` per run (host-timed links); ``instruments``: the clocks a
        modelled device hands in (``rt`` already carries their link and meter: `Runtime.instrumented`)."""
        settings = WindowSettings(K, params, expert_filter, max_holes)
        if planner is None and prefetch not in POLICIES:
            raise ValueError(f"unknown prefetch policy {prefetch!r}; choose one of {POLICIES}")
        self.rt, self.settings = rt, settings
        self.memory = PlannerMemory(planner or make_policy(prefetch, K, rt.om.store.nbytes_per_expert, planner_config),
                                    planner_state)
        self.drafter = drafter or SharedDrafter(rt.moe)
        capacity = {layer: rt.cache.capacity(layer) for layer in self.layers}  # M per layer
        # experts a window's plan keeps per layer; a verifier that computes at most `plan_cap` experts per
        # layer (MoE-Spec's budget) caps it, so the planner predicts no more than verification can use
        self.plan_capacity = plan_capacity(capacity, getattr(rt.cache, "staging", 0), plan_cap)
        self.prefetcher = window_prefetch(self.planner.name, self.layers, rt.om.num_experts, self.device)
        self.recorder = WindowRecorder(rt.link, self.layers, trace_windows)
        self._use_clocks(instruments)
        self.begin_run()

    def _use_clocks(self, instruments: Instruments | None) -> None:
        if instruments is not None and instruments.step_clock is not None:
            self.step_clock = instruments.step_clock
        if instruments is not None and instruments.commit_clock is not None:
            self.commit_clock = instruments.commit_clock

    def use_runtime(self, rt: Runtime) -> None:
        """Decode through ``rt`` from now on: the same model, cache and link as the one built over, with other
        parameters (`Runtime.recalibrate_link`)."""
        self.rt = rt

    def instrument(self, rt: Runtime, instruments: Instruments) -> None:
        """An engine built before its method was instrumented: decode through the instrumented runtime ``rt``,
        its link timing the windows' copies, and read ``instruments``' clocks; a fresh run."""
        self.rt = rt
        self.recorder.link = rt.link
        self.recorder.begin_run()
        self._use_clocks(instruments)

    # ------------------------------------------------------------------------------ views
    K = property(lambda self: self.settings.K, doc="the most draft tokens per request and window")
    params = property(lambda self: self.settings.params, doc="sampling: drafts, verification, next tokens")
    expert_filter = property(lambda self: self.settings.expert_filter, doc="verification passes only")
    max_holes = property(lambda self: self.settings.max_holes)
    model = property(lambda self: self.rt.model, doc="batched rows run transformers' modules")
    device = property(lambda self: next(self.rt.model.parameters()).device)
    cache = property(lambda self: self.rt.cache)
    layers = property(lambda self: self.rt.om.moe_layers)
    planner = property(lambda self: self.memory.planner)
    prefetch = property(lambda self: self.planner.name, doc="the prefetch policy's name")
    planner_state = property(lambda self: self.memory.state)
    elb = property(lambda self: self.prefetcher.elb)
    trace = property(lambda self: self.recorder.trace)
    route_log = property(lambda self: self.recorder.route_log)
    tracer = property(lambda self: self.recorder.tracer)
    iterations = property(lambda self: self.recorder.iterations)

    # ------------------------------------------------------------------------------ state
    def mark_warm(self) -> None:
        """Snapshot the planner's estimates (call after the warm-up); "warm" records start from it."""
        self.memory.mark_warm()

    def reset(self) -> None:
        """Bring the planner to the documented per-record state (the caller resets the cache)."""
        self.memory.reset()

    def begin_run(self, rows: RowFactory | None = None) -> None:
        """Fresh run state, its requests' KV rows from ``rows`` (default: batched rows, `BatchKV`)."""
        self.rows = rows or super().new_rows
        super().begin_run()
        self.drafter.begin_run(self.device, self.max_holes)
        self.recorder.begin_run()

    def new_rows(self, entering: list[Request]):
        return self.rows(entering)

    def sequence_rows(self, entering: list[Request]) -> SequenceKV:
        """One request's rows on the decode path's own cache, with room for its last window's K+1."""
        need = max((r.prompt_len + r.max_new_tokens for r in entering), default=0)
        return SequenceKV(self.rt.forward_model, need + self.K + 2)

    # the drafter keeps its per-row state in step with the target's rows
    def _join(self, fresh, prompts: list[torch.Tensor]) -> None:
        super()._join(fresh, prompts)
        self.drafter.join(fresh, prompts)

    def _keep_rows(self, rows: list[int]) -> None:
        super()._keep_rows(rows)
        self.drafter.keep_rows(rows)

    # ------------------------------------------------------------------------------ run
    @torch.inference_mode()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None = None,
                 clock: CommitClock | None = None) -> tuple[list[int], dict[str, Any]]:
        """One request (``prompt_ids [1, P]``): the B = 1 case of the window loop. Returns its tokens
        and record columns (acceptance, I/O, prefetch scores)."""
        self.begin_run(self.sequence_rows)
        req = self.submit(prompt_ids, max_new_tokens, generator, clock=clock)
        self.run()
        stats = {k: v for k, v in self.batch_stats().items() if k not in BATCH_ONLY}
        tokens = req.tokens[:max_new_tokens]
        stats.update(load_columns(self.rt, self.route_log, stats["h2d_bytes"], stats["oracle_h2d_bytes"], len(tokens)))
        return tokens, {**stats, **req.stats}

    @torch.inference_mode()
    def run(self) -> list[Request]:
        with self.recorder.observing():
            return super().run()

    # ------------------------------------------------------------------------------ target passes
    def _target(self, rows, ids: torch.Tensor, expert_filter: ExpertFilter | None, log: RouteLog, tracer=None,
                host_compute: bool = False) -> torch.Tensor:
        with self.rt.moe.mode("target", route_log=log, host_compute=host_compute, expert_filter=expert_filter,
                              tracer=tracer):
            return rows.run(ids)  # [B, T, V]

    def _prefill(self, rows, ids: torch.Tensor, token_valid: torch.Tensor | None) -> torch.Tensor:
        """The prompts' pass: the full router (no verification filter); padded tokens route to no expert."""
        flt = padding_filter(token_valid, self.rt.om.num_experts) if token_valid is not None else None
        self.route_log.begin_window()
        return self._target(rows, ids, flt, self.route_log, self.tracer)

    def verify_pass(self, ids: torch.Tensor) -> torch.Tensor:
        """The target over the running rows' window ``ids [B, T]`` (logits ``[B, T, V]``), one route-log window."""
        self.route_log.begin_window()
        logits = self._target(self.kv, ids, self.expert_filter, self.route_log, self.tracer)
        self.recorder.verified()
        return logits

    def probe_pass(self, ids: torch.Tensor, log: RouteLog) -> torch.Tensor:
        """An untimed pass from the host store (the oracle's dry run): routes into ``log``, no tracer;
        its KV stays pending until the caller discards it."""
        return self._target(self.kv, ids, self.expert_filter, log, host_compute=True)

    # ------------------------------------------------------------------------------ one window
    def _iterate(self) -> None:
        reqs, rec = self.active, self.recorder
        limits = [max(0, min(self.K, r.remaining - 1)) for r in reqs]  # K_b: never negative
        Kb, last = max(limits), self._last_tokens()  # Kb, [B, 1]
        if Kb == 0:  # one token left everywhere: a plain target step
            logits = self.verify_pass(last)[:, -1]  # [B, V]
            self._commit([0] * len(reqs), [next_token(logits[b], self.params, r.generator) for b, r in enumerate(reqs)],
                         None)
            return
        rec.begin_window(self.cache, Kb)
        drafts, q = self._draft(last, Kb, limits)  # [B, Kb], [B, Kb, V] | None; prefetches at the boundaries
        rec.lap()
        target_logits = self.verify_pass(torch.cat([last, drafts], dim=1))  # [B, Kb+1, V]
        self.cache.release_prefetches()  # mispredicted prefetches give their slots back
        self.cache.end_window()  # the residency policy's window evidence ends here
        rec.score_prediction(self.plan_capacity)
        accepted, tokens = self._accept(drafts, q, target_logits, limits)
        rec.lap()
        self._commit(accepted, tokens, drafts.tolist())
        self.drafter.commit(accepted)
        moved, busy = rec.end_window(reqs, limits, accepted, Kb)
        if moved and busy > 0:  # the planner's bandwidth estimate follows the real link
            self.planner.observe_transfer(moved, busy)

    def _accept(self, drafts, q, target_logits, limits: list[int]) -> tuple[list[int], list[int]]:
        if self.params.greedy:
            return greedy_verify_batch(drafts, target_logits, torch.tensor(limits, device=drafts.device))
        accepted, tokens = [], []
        for b, req in enumerate(self.active):  # each request's own generator, in the B=1 order
            k = limits[b]
            if k == 0:
                a, tok = 0, next_token(target_logits[b, 0], self.params, req.generator)
            else:
                a, tok = verify_window(drafts[b, :k], q[b, :k], target_logits[b, : k + 1], self.params, req.generator)
            accepted.append(a)
            tokens.append(tok)
        return accepted, tokens

    # ------------------------------------------------------------------------------ draft
    def _draft(self, last: torch.Tensor, Kb: int, limits: list[int]):
        planner, prefetcher, timer = self.planner, self.prefetcher, StepTimer(self.device, now=self.step_clock)
        planner.begin_window(Kb)
        prefetcher.before_draft(self, last, Kb)
        tokens, qs = [], []
        tok = self.drafter.first_input(self.active, last)  # [B, T]
        timer.start()
        for step in range(1, Kb + 1):
            logits = self.drafter.step(tok, self.kv, prefetcher.elb)  # [B, V]
            d, q = self._draft_sample(logits, step, limits)  # [B], [B, V] | None
            tokens.append(d)
            qs.append(q)
            tok = d[:, None]
            timer.lap()
            if prefetcher.elb is not None and planner.next_boundary == step:
                for seconds in timer.harvest():  # the planner's step estimate before it plans
                    planner.observe_draft_step(seconds)
                prefetcher.boundary(self, step)
        for seconds in timer.harvest():
            planner.observe_draft_step(seconds)
        prefetcher.end_draft()
        self.trace.phases.extend((c.phase, c.start, c.end, c.batch) for c in planner.trace)
        self.drafter.end(self.kv)
        drafts = torch.stack(tokens, dim=1)  # [B, Kb]
        return drafts, (torch.stack(qs, dim=1) if qs[0] is not None else None)

    def _draft_sample(self, logits: torch.Tensor, step: int, limits: list[int]):
        """Draft tokens ``[B]`` (and q ``[B, V]`` when sampling); a request past its K_b takes the
        argmax without touching its generator (that position is never accepted)."""
        if self.params.greedy:
            return draft_next(logits, self.params)
        toks, qs = [], []
        for b, req in enumerate(self.active):
            if step <= limits[b]:
                d, q = draft_next(logits[b], self.params, req.generator)
            else:
                d, q = logits[b].argmax(), torch.zeros_like(logits[b], dtype=torch.float32)
            toks.append(d.reshape(()))
            qs.append(q)
        return torch.stack(toks), torch.stack(qs)

    # ------------------------------------------------------------------------------ metrics
    def request_stats(self, req: Request) -> dict[str, Any]:
        """Per-request record columns: K and acceptance."""
        return {"K": self.K, **acceptance_stats(req.drafted, req.accepted)}

    def batch_stats(self) -> dict[str, Any]:
        return speculative_run_stats([self])


BATCH_ONLY = ("iterations", "kv_compactions", "distinct_experts_per_layer")  # run columns a single record omits


def speculative_run_stats(engines: Sequence[SpeculativeEngine]) -> dict[str, Any]:
    """Batch-level columns of one run decoded by `engines` over one runtime (one engine, or the
    microbatches of `generate_microbatched`, which share one route log): I/O of the shared cache and
    link, the working set over every verification, prefetch scores summed over the microbatches."""
    first = engines[0]
    traces = [e.trace for e in engines]
    predicted, hits = sum(t.predicted for t in traces), sum(t.predicted_hits for t in traces)
    capped = sum(t.actual_capped for t in traces)
    verified = sorted(w for e in engines for w in e.recorder.verify_windows)  # route-log windows of verifications
    om = first.rt.om
    return {
        "K": first.K,
        "iterations": sum(e.iterations for e in engines),
        "kv_compactions": sum(e.kv.compactions for e in engines),
        "distinct_experts_per_layer": working_set(first.route_log, verified, first.layers),
        # each verification pass is one window (its Kb+1 tokens per request; prefills are not windows)
        **window_routing(first.route_log, [[w] for w in verified], first.layers, om.num_experts, om.top_k),
        **io_stats(first.cache, first.rt.link.busy_seconds - first.recorder.busy0),
        "prefetch_precision": hits / predicted if predicted else None,
        "prefetch_recall": hits / capped if predicted and capped else None,
        "dropped_prefetches": sum(t.dropped_prefetches for t in traces),
        "retention_hits": sum(t.retention_hits for t in traces),
        "retention_reloads": sum(t.retention_reloads for t in traces),
        "oracle_h2d_bytes": oracle_bytes(first.rt, first.route_log),
    }


def generate_microbatched(engines: Sequence[SpeculativeEngine], prompts: list[torch.Tensor],
                          max_new_tokens: int | list[int],
                          generators: list[torch.Generator | None] | None = None) -> BatchRun:
    """Decode the prompts as ``len(engines)`` microbatches over one runtime: contiguous slices of the
    prompts, each on its own engine (its own KV, draft state, ELB and planner), taking windows in
    turn on the one expert cache and link (SpecMoEOff's batched schedule: a microbatch's prefetches
    may evict what the other one loaded). Outputs in prompt order; at temperature 0 each request's
    tokens equal its B=1 output. Fewer prompts than engines use fewer microbatches."""
    n = len(prompts)
    limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * n
    gens = generators if generators is not None else [None] * n
    if len(limits) != n or len(gens) != n:
        raise ValueError("prompts, max_new_tokens and generators must have the same length")
    if not engines or any(e.rt is not engines[0].rt for e in engines):
        raise ValueError("microbatches need at least one engine, all over the same runtime")
    bounds = [-(-i * n // len(engines)) for i in range(len(engines) + 1)]  # the first microbatches take the extra
    parts = [range(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    used = list(engines[:len(parts)])
    for engine in used:
        engine.begin_run()
    for engine in used[1:]:  # one log of verification windows in time order: one working set, one oracle
        engine.recorder.route_log = used[0].route_log
    reqs: list[Request] = [None] * n  # type: ignore[list-item]
    for engine, part in zip(used, parts):
        for i in part:
            reqs[i] = engine.submit(prompts[i], limits[i], gens[i], rid=i)
    while any(e.queue or e.active for e in used):
        for engine in used:
            if engine.queue or engine.active:
                engine.step()
    return BatchRun(reqs, {**speculative_run_stats(used), "microbatches": len(used)})
