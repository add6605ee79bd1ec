"""Batched decoding over the offloaded model: B requests share every forward pass and every expert load.

    submit ──► admit: padded prefill (target, padded tokens routed to no expert) ──► merge into BatchKV
    step   ──► speculative: draft Kb steps for all B (ELB counts all routes, planner prefetches the
               union top-M) ──► verify B×(Kb+1) positions in one target pass, expert-wise (one
               load per expert serves every request) ──► per-request accept / rollback / commit
           ──► autoregressive: one target step over B tokens (each expert loaded once per step)
           ──► retire finished requests (rows leave the cache); queued requests join at the next step

Per-request state (`Request`): committed tokens, its own sampling generator, commit clock and
acceptance. Per-request KV lives in one left-padded cache (`batch_state.BatchKV`, which explains
why padding and rollback holes never enter a request's softmax). Each request's greedy output is
its own B=1 output token for token.

K is uniform across the batch: every iteration drafts ``Kb = max_b K_b`` steps in lockstep, with
``K_b = min(K, remaining_b - 1)``; a request accepts at most its own K_b drafts (extra drafted
positions of a request near its end are verified and ignored). Sampling draws from each request's
own generator in the B=1 engine's order, so a seeded stochastic request does not depend on which
requests share its batch.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specter.metrics import io_stats
from specter.moe import ExpertFilter, MoERuntime, RouteLog
from specter.predict.oracle import oracle_bytes, oracle_plan
from specter.speculative.batch_state import BatchKV, Request
from specter.speculative.drafter import run_model
from specter.speculative.engine import SpeculativeEngine, WindowTrace, acceptance_stats
from specter.speculative.sampling import (
    SamplingParams,
    draft_next,
    next_token,
    verify_window,
)


# ---------------------------------------------------------------------------------- helpers
def padding_filter(token_valid: torch.Tensor, num_experts: int, inner: ExpertFilter | None = None) -> ExpertFilter:
    """Expert filter for a padded forward: padded token rows go to the "no expert" sentinel E (skipped
    by the expert-wise MoE and the route log, so they load nothing); ``inner`` sees only the real tokens."""
    keep = token_valid.reshape(-1)  # [B*T] in the MoE block's row order (batch-major)

    def apply(layer: int, topk_idx: torch.Tensor, topk_w: torch.Tensor):
        if topk_idx.shape[0] != keep.numel():
            raise RuntimeError(f"padding filter: {topk_idx.shape[0]} routed rows for {keep.numel()} tokens")
        if inner is not None:
            idx_v, w_v = inner(layer, topk_idx[keep], topk_w[keep])
            topk_idx, topk_w = topk_idx.clone(), topk_w.clone()
            topk_idx[keep], topk_w[keep] = idx_v, w_v.to(topk_w.dtype)
        m = keep[:, None]  # [B*T, 1]
        return torch.where(m, topk_idx, num_experts), torch.where(m, topk_w, torch.zeros_like(topk_w))

    return apply


def greedy_verify_batch(drafts: torch.Tensor, target_logits: torch.Tensor, limits: torch.Tensor) -> tuple[list[int], list[int]]:
    """Greedy verification of B windows at once: ``(accepted [B], next_token [B])``.

    ``drafts [B, K]``, ``target_logits [B, K+1, V]``, ``limits [B]``: request b accepts at most
    ``limits[b]`` drafts (its own K_b). Row b equals ``greedy_verify(drafts[b, :K_b], target_logits[b, :K_b+1])``.
    """
    K = drafts.shape[1]
    target_ids = target_logits.argmax(dim=-1)  # [B, K+1]
    match = target_ids[:, :K] == drafts.to(target_ids.device)  # [B, K]
    run = torch.cumprod(match.long(), dim=1).sum(dim=1)  # [B] leading matches
    n = torch.minimum(run, limits.to(run.device))  # [B]
    nxt = target_ids.gather(1, n[:, None])[:, 0]  # [B] correction or bonus
    accepted, tokens = torch.stack([n, nxt]).tolist()  # the one D2H copy
    return accepted, tokens


def working_set(log: RouteLog, windows: list[int], layers: list[int]) -> float | None:
    """Mean distinct experts per MoE layer per window over the given window indices (Fig. 16)."""
    sizes = [len(log.windows[w].get(layer, ())) for w in windows for layer in layers]
    return sum(sizes) / len(sizes) if sizes else None


@dataclass
class BatchRun:
    """The outcome of one batched generation: requests in submission order and batch-level stats."""

    requests: list[Request]
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> list[list[int]]:
        return [r.tokens[: r.max_new_tokens] for r in self.requests]

    def wall_seconds(self) -> float:
        """Batch start (first admission) to the last commit of any request."""
        start = min(r.clock.start_s for r in self.requests)
        end = max(r.clock.stamps[-1] for r in self.requests if r.clock.stamps)
        return end - start


# ---------------------------------------------------------------------------------- batch loop
class BatchLoop:
    """Request admission, retirement and the step loop shared by the batched decoders.

    A subclass provides ``_forward_batch`` and ``_iterate``.
    Requests may be submitted at any time; they join at the next step, after a prefill of their own.
    """

    model: torch.nn.Module
    params: SamplingParams
    device: torch.device

    max_holes: int = 0  # rejected KV columns kept masked before a compaction (see BatchKV)

    def submit(self, prompt_ids: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None = None,
               rid: int | None = None) -> Request:
        """Queue a request (``prompt_ids [P]`` or ``[1, P]``); it is prefilled at the next step."""
        prompt = prompt_ids.reshape(-1)
        if prompt.numel() == 0:
            raise ValueError("a prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        req = Request(self._next_rid if rid is None else rid, int(prompt.numel()), max_new_tokens, generator,
                      prompt=prompt.tolist())
        self._next_rid += 1
        self.queue.append((req, prompt))
        self.submitted.append(req)
        return req

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Admit queued requests, run one iteration for every active request, retire finished ones."""
        if self.queue:
            self._admit()
        if self.active:
            self._iterate()
        return self._retire()

    @torch.inference_mode()
    def run(self) -> list[Request]:
        """Step until every submitted request is finished."""
        while self.queue or self.active:
            self.step()
        return self.submitted

    def generate_batch(self, prompts: list[torch.Tensor], max_new_tokens: int | list[int],
                       generators: list[torch.Generator | None] | None = None) -> BatchRun:
        """Decode the prompts together; outputs in prompt order, each equal to its B=1 greedy output."""
        self.begin_run()
        n = len(prompts)
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * n
        gens = generators if generators is not None else [None] * n
        if len(limits) != n or len(gens) != n:
            raise ValueError("prompts, max_new_tokens and generators must have the same length")
        reqs = [self.submit(p, m, g, rid=i) for i, (p, m, g) in enumerate(zip(prompts, limits, gens))]
        self.run()
        return BatchRun(reqs, self.batch_stats())

    # -- hooks --------------------------------------------------------------------------------
    def begin_run(self) -> None:
        """Fresh batch state (the caller resets the expert cache outside timing)."""
        self.kv = BatchKV(self.model.config, self.device, self.max_holes)
        self.active: list[Request] = []
        self.queue: list[tuple[Request, torch.Tensor]] = []
        self.submitted: list[Request] = []
        self._next_rid = 0

    def batch_stats(self) -> dict[str, Any]:
        """Batch-level columns of the run since `begin_run` (I/O, working set, iterations)."""
        return {}

    def request_stats(self, req: Request) -> dict[str, Any]:
        """Per-request record columns, taken when the request finishes."""
        return {}

    def _forward_batch(self, ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, mode: str,
                       token_valid: torch.Tensor | None = None, host_compute: bool = False, cache=None) -> torch.Tensor:
        """Logits ``[B, T, V]`` of ``ids [B, T]``; ``mode`` is prefill | draft | verify | probe."""
        raise NotImplementedError

    def _iterate(self) -> None:
        raise NotImplementedError

    # -- membership ---------------------------------------------------------------------------
    def _admit(self) -> None:
        """Prefill the queued requests as one padded batch, sample their first tokens, join the batch."""
        entering, self.queue = self.queue, []
        for req, _ in entering:
            req.clock.start()
        fresh = BatchKV(self.model.config, self.device, self.max_holes)
        pad = getattr(self.model.config, "pad_token_id", None) or 0
        ids, positions, mask = fresh.prefill_inputs([p for _, p in entering], pad)  # [B_new, P] each
        token_valid = mask.bool() if not bool(mask.all()) else None
        # the forward appends P columns to the fresh cache, all covered by its `valid`
        logits = self._forward_batch(ids, positions, mask, "prefill", token_valid=token_valid,
                                     cache=fresh.cache)[:, -1]  # [B_new, V]
        for b, (req, _) in enumerate(entering):
            req.tokens = [next_token(logits[b], self.params, req.generator)]
            req.clock.commit(1)
        self._join(fresh, [p for _, p in entering])
        self.active.extend(req for req, _ in entering)

    def _join(self, fresh: BatchKV, prompts: list[torch.Tensor]) -> None:
        """New rows (their prefilled KV) join the running batch; a subclass with more per-row state extends it."""
        self.kv.merge(fresh)

    def _keep_rows(self, rows: list[int]) -> None:
        """Only ``rows`` stay in the batch (finished requests leave)."""
        self.kv.select(rows)

    def _retire(self) -> list[Request]:
        done = [r for r in self.active if r.done]
        for req in done:
            req.stats = self.request_stats(req)
        if done:
            keep = [b for b, r in enumerate(self.active) if not r.done]
            self._keep_rows(keep)
            self.active = [self.active[b] for b in keep]
        return done

    def _commit(self, accepted: list[int], next_tokens: list[int], drafts: list[list[int]] | None) -> None:
        """Per request: keep KV of its last input + accepted drafts, queue its next token, stamp its clock."""
        self.kv.commit([1 + a for a in accepted])
        for b, req in enumerate(self.active):
            a = accepted[b]
            if drafts is not None:
                req.tokens.extend(drafts[b][:a])
            req.tokens.append(next_tokens[b])
            req.clock.commit(a + 1)

    def _step_inputs(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and mask for ``ids [B, T]`` on the running cache; records the appended columns."""
        position_ids, mask = self.kv.forward_inputs(ids.shape[1])
        self.kv.appended(ids.shape[1])
        return position_ids, mask

    def _last_tokens(self) -> torch.Tensor:
        return torch.tensor([[r.last_token] for r in self.active], device=self.device)  # [B, 1]


# ---------------------------------------------------------------------------------- autoregressive
class BatchedAutoregressive(BatchLoop):
    """Autoregressive decoding of B requests: one target step per iteration over B tokens.

    With an offloading `MoERuntime` each step's expert-wise MoE loads every needed expert once for
    the whole batch (`offload_ar` batched); without one it is plain batched decoding of any model.
    """

    def __init__(self, model: torch.nn.Module, params: SamplingParams, moe: MoERuntime | None = None,
                 num_experts: int | None = None, max_holes: int = 0):
        self.model, self.params, self.moe = model, params, moe
        self.device = next(model.parameters()).device
        self.num_experts = num_experts
        self.max_holes = max_holes
        self.begin_run()

    def begin_run(self) -> None:
        super().begin_run()
        self.route_log = RouteLog()
        self.step_windows: list[int] = []  # route-log windows of decode steps (not prefills)
        self.iterations = 0
        self._busy0 = self.moe.cache.link.busy_seconds if self.moe is not None else 0.0

    def _forward_batch(self, ids, position_ids, mask, mode, token_valid=None, host_compute=False, cache=None):
        cache = self.kv.cache if cache is None else cache
        if self.moe is None:
            return run_model(self.model, ids, position_ids, mask, cache)
        self.route_log.begin_window()
        flt = padding_filter(token_valid, self.num_experts) if token_valid is not None else None
        with self.moe.mode("target", route_log=self.route_log, expert_filter=flt):
            return run_model(self.model, ids, position_ids, mask, cache)

    def _iterate(self) -> None:
        ids = self._last_tokens()  # [B, 1]
        position_ids, mask = self._step_inputs(ids)
        logits = self._forward_batch(ids, position_ids, mask, "target")[:, -1]  # [B, V]
        if self.moe is not None:
            self.step_windows.append(len(self.route_log.windows) - 1)
        if self.params.greedy:
            tokens = logits.argmax(dim=-1).tolist()  # one D2H copy
        else:
            tokens = [next_token(logits[b], self.params, r.generator) for b, r in enumerate(self.active)]
        self._commit([0] * len(tokens), tokens, None)
        self.iterations += 1

    def batch_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {"iterations": self.iterations, "kv_compactions": self.kv.compactions}
        if self.moe is None:
            return stats
        stats["distinct_experts_per_layer"] = working_set(self.route_log, self.step_windows, self.moe.cache.layers)
        stats.update(io_stats(self.moe.cache, self.moe.cache.link.busy_seconds - self._busy0))
        return stats


# ---------------------------------------------------------------------------------- speculative
class BatchedSpeculativeEngine(BatchLoop, SpeculativeEngine):
    """Specter over B requests: shared draft windows, one expert-wise verification per iteration.

    The ELB counts the draft routes of all B requests, so the planner's top-M plan per layer is the
    union working set ranked by how many (request, step) pairs routed to each expert; verification
    runs B×(Kb+1) positions expert-wise. `generate()` (inherited) remains the single-request loop.
    """

    batched = True

    def __init__(self, rt, K: int, params: SamplingParams, prefetch: str = "adaptive", planner_config=None,
                 planner_state="warm", expert_filter: ExpertFilter | None = None, max_holes: int = 0,
                 plan_cap: int | None = None, planner=None, drafter=None):
        SpeculativeEngine.__init__(self, rt, K, params, prefetch, planner_config, planner_state, expert_filter,
                                   plan_cap, planner, drafter)
        self.num_experts = rt.om.num_experts
        self.max_holes = max_holes
        self.begin_run()

    # -- run state ------------------------------------------------------------------------------
    def begin_run(self) -> None:
        super().begin_run()
        self.drafter.begin_run(self.device, self.max_holes)
        self.trace = WindowTrace()
        self.route_log = RouteLog()
        self.verify_windows: list[int] = []
        self.iterations = 0
        self._busy0 = self.rt.link.busy_seconds

    # -- forward --------------------------------------------------------------------------------
    def _forward_batch(self, ids, position_ids, mask, mode, token_valid=None, host_compute=False, cache=None):
        """Target logits ``[B, T, V]`` (drafting goes through the drafter)."""
        cache = self.kv.cache if cache is None else cache
        flt = self.expert_filter if mode != "prefill" else None  # the prefill runs the full router
        if token_valid is not None:
            flt = padding_filter(token_valid, self.num_experts, flt)
        if mode in ("prefill", "verify"):
            self.route_log.begin_window()
        with self.moe.mode("target", route_log=self.route_log, host_compute=host_compute, expert_filter=flt):
            return run_model(self.model, ids, position_ids, mask, cache)  # [B, T, V]

    # -- one iteration ----------------------------------------------------------------------------
    def _iterate(self) -> None:
        reqs = self.active
        limits = [min(self.K, r.remaining - 1) for r in reqs]  # K_b
        Kb = max(limits)
        last = self._last_tokens()  # [B, 1]
        link = self.rt.link
        if Kb == 0:  # one token left everywhere: a plain target step
            position_ids, mask = self._step_inputs(last)
            logits = self._forward_batch(last, position_ids, mask, "verify")[:, -1]  # [B, V]
            self.verify_windows.append(len(self.route_log.windows) - 1)
            tokens = [next_token(logits[b], self.params, r.generator) for b, r in enumerate(reqs)]
            self._commit([0] * len(reqs), tokens, None)
            return
        window0 = (link.bytes_copied, link.busy_seconds)
        t0 = time.perf_counter()
        drafts, q = self._draft_batch(last, Kb, limits)  # [B, Kb], [B, Kb, V] | None
        self.drafter.end(self.kv)
        t1 = time.perf_counter()
        verify_ids = torch.cat([last, drafts], dim=1)  # [B, Kb+1]
        position_ids, mask = self._step_inputs(verify_ids)
        target_logits = self._forward_batch(verify_ids, position_ids, mask, "verify")  # [B, Kb+1, V]
        self.verify_windows.append(len(self.route_log.windows) - 1)
        self.cache.release_prefetches()  # mispredicted prefetches give their slots back
        self._score_prediction(self.trace)
        accepted, tokens = self._verify(drafts, q, target_logits, limits)
        self._commit(accepted, tokens, drafts.tolist())
        self.drafter.commit(accepted)
        for b, req in enumerate(reqs):
            if limits[b] > 0:
                req.drafted.append(limits[b])
                req.accepted.append(accepted[b])
        self.trace.drafted.append(sum(limits))
        self.trace.accepted.append(sum(accepted))
        moved, busy = link.bytes_copied - window0[0], link.busy_seconds - window0[1]
        self.trace.windows.append({"draft_s": t1 - t0, "verify_s": time.perf_counter() - t1, "h2d_bytes": moved,
                                   "link_busy_s": busy, "batch": len(reqs), "Kb": Kb})
        if moved and busy > 0:
            self.planner.observe_transfer(moved, busy)
        self.iterations += 1

    def _verify(self, drafts, q, target_logits, limits: list[int]) -> tuple[list[int], list[int]]:
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

    # -- draft ------------------------------------------------------------------------------------
    def _draft_batch(self, last: torch.Tensor, Kb: int, limits: list[int]):
        planner = self.planner
        planner.begin_window(Kb)
        self._window_predicted: dict[int, set[int]] = defaultdict(set)
        if self.prefetch == "oracle":
            self._oracle_prefetch_batch(last, Kb)
        tokens, qs = [], []
        tok = self.drafter.first_input(self.active, last)  # [B, T]
        self.timer.start()
        for step in range(1, Kb + 1):
            logits = self.drafter.step(tok, self.kv, self.elb)  # [B, V]
            d, q = self._draft_sample(logits, step, limits)  # [B], [B, V] | None
            tokens.append(d)
            qs.append(q)
            tok = d[:, None]
            self.timer.lap()
            if self.elb is not None and planner.next_boundary == step:
                for seconds in self.timer.harvest():
                    planner.observe_draft_step(seconds)
                self._boundary(step, self.trace)
        for seconds in self.timer.harvest():
            planner.observe_draft_step(seconds)
        if self.elb is not None:
            self.elb.clear()
        self.trace.phases.extend((c.phase, c.start, c.end, c.batch) for c in planner.trace)
        drafts = torch.stack(tokens, dim=1)  # [B, Kb]
        return drafts, (torch.stack(qs, dim=1) if qs[0] is not None else None)

    # -- membership: the drafter keeps its per-row state in step with the target's rows
    def _join(self, fresh: BatchKV, prompts: list[torch.Tensor]) -> None:
        super()._join(fresh, prompts)
        self.drafter.join(fresh, prompts)

    def _keep_rows(self, rows: list[int]) -> None:
        super()._keep_rows(rows)
        self.drafter.keep_rows(rows)

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

    def _oracle_prefetch_batch(self, last: torch.Tensor, Kb: int) -> None:
        """Ablation bound: an untimed greedy dry run of Kb+1 steps from the host store learns the
        target's true experts for every request; the top-M per layer (by steps using them) are prefetched."""
        saved = self.route_log
        self.route_log = RouteLog()
        start = time.perf_counter()
        tok = last
        for _ in range(Kb + 1):
            position_ids, mask = self._step_inputs(tok)
            self.route_log.begin_window()
            tok = self._forward_batch(tok, position_ids, mask, "probe", host_compute=True)[:, -1].argmax(-1)[:, None]
        self.kv.discard_pending()
        windows, self.route_log = self.route_log.windows, saved
        self._prefetch_oracle_plan(oracle_plan(windows, self.plan_capacity))
        spent = time.perf_counter() - start
        for req in self.active:
            req.clock.exclude(spent)

    # -- metrics ----------------------------------------------------------------------------------
    def request_stats(self, req: Request) -> dict[str, Any]:
        """Per-request record columns: K and acceptance."""
        return {"K": self.K, **acceptance_stats(req.drafted, req.accepted)}

    def batch_stats(self) -> dict[str, Any]:
        return speculative_run_stats([self])


def speculative_run_stats(engines: Sequence[BatchedSpeculativeEngine]) -> dict[str, Any]:
    """Batch-level columns of one run decoded by `engines` over one runtime (one engine, or the
    microbatches of `generate_microbatched`, which share one route log): I/O of the shared cache and
    link, the working set over every verification, prefetch scores summed over the microbatches."""
    first = engines[0]
    traces = [e.trace for e in engines]
    predicted, hits = sum(t.predicted for t in traces), sum(t.predicted_hits for t in traces)
    capped = sum(t.actual_capped for t in traces)
    return {
        "K": first.K,
        "iterations": sum(e.iterations for e in engines),
        "kv_compactions": sum(e.kv.compactions for e in engines),
        "distinct_experts_per_layer": working_set(first.route_log, sorted(w for e in engines for w in e.verify_windows),
                                                  first.layers),
        **io_stats(first.cache, first.rt.link.busy_seconds - first._busy0),
        "prefetch_precision": hits / predicted if predicted else None,
        "prefetch_recall": hits / capped if predicted and capped else None,
        "dropped_prefetches": sum(t.dropped_prefetches for t in traces),
        "oracle_h2d_bytes": oracle_bytes(first.rt, first.route_log),
    }


def generate_microbatched(engines: Sequence[BatchedSpeculativeEngine], prompts: list[torch.Tensor],
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
        engine.route_log = used[0].route_log
    reqs: list[Request] = [None] * n  # type: ignore[list-item]
    for engine, part in zip(used, parts):
        for i in part:
            reqs[i] = engine.submit(prompts[i], limits[i], gens[i], rid=i)
    while any(e.queue or e.active for e in used):
        for engine in used:
            if engine.queue or engine.active:
                engine.step()
    return BatchRun(reqs, {**speculative_run_stats(used), "microbatches": len(used)})
