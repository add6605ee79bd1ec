"""The request loop every decoder steps: B requests share every forward pass and every expert load.

    submit ──► admit: prefill (target; padded tokens routed to no expert) ──► merge into the rows
    step   ──► one iteration for every active request: a speculative window
               (`engine.SpeculativeEngine`) or one autoregressive step over B tokens
               (`BatchedAutoregressive`: each expert loaded once per step)
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

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from specter.metrics import CommitClock, io_stats
from specter.moe import ExpertFilter, MoERuntime, RouteLog
from specter.speculative.batch_state import BatchKV, Request
from specter.speculative.sampling import SamplingParams, next_token


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

    A subclass provides ``_prefill`` and ``_iterate`` (and may choose its rows: ``new_rows``).
    Requests may be submitted at any time; they join at the next step, after a prefill of their own.
    """

    model: torch.nn.Module
    params: SamplingParams
    device: torch.device

    max_holes: int = 0  # rejected KV columns kept masked before a compaction (see BatchKV)
    # Makes each request's commit clock; a modelled device stamps commits on its own clock
    # (specter/projection/virtual.py), the host's perf_counter otherwise.
    commit_clock: Callable[[], CommitClock] = CommitClock

    def submit(self, prompt_ids: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None = None,
               rid: int | None = None, clock: CommitClock | None = None) -> Request:
        """Queue a request (``prompt_ids [P]`` or ``[1, P]``); it is prefilled at the next step."""
        prompt = prompt_ids.reshape(-1)
        if prompt.numel() == 0:
            raise ValueError("a prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        req = Request(self._next_rid if rid is None else rid, int(prompt.numel()), max_new_tokens, generator,
                      prompt=prompt.tolist(), clock=clock or self.commit_clock())
        self._next_rid += 1
        self.queue.append((req, prompt))
        self.submitted.append(req)
        return req

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Admit queued requests, run one iteration for every active request, retire finished ones."""
        finished = []
        if self.queue:
            self._admit()
            finished = self._retire()  # a one-token request is done by its prefill: no window for it
        if self.active:
            self._iterate()
        return finished + self._retire()

    def cancel(self, req: Request) -> bool:
        """Drop ``req`` between steps (its caller is gone): a queued request never runs, an active
        one's rows leave the batch now. False when it is neither queued nor active (finished)."""
        for i, (queued, _) in enumerate(self.queue):
            if queued is req:
                del self.queue[i]
                return True
        rows = [b for b, r in enumerate(self.active) if r is not req]  # identity: Requests compare by value
        if len(rows) == len(self.active):
            return False
        self._keep_rows(rows)
        self.active = [self.active[b] for b in rows]
        return True

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
        self.kv = self.new_rows([])
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

    def new_rows(self, entering: list[Request]):
        """Empty KV rows for the ``entering`` requests (``[]``: the running batch's)."""
        return BatchKV(self.model, self.device, self.max_holes)

    def _prefill(self, rows, ids: torch.Tensor, token_valid: torch.Tensor | None) -> torch.Tensor:
        """Target logits ``[B, P, V]`` of the padded prompts ``ids [B, P]`` on fresh ``rows``
        (``token_valid [B, P]``: False at padding; None: no padding)."""
        raise NotImplementedError

    def _iterate(self) -> None:
        raise NotImplementedError

    # -- membership ---------------------------------------------------------------------------
    def _admit(self) -> None:
        """Prefill the queued requests as one padded batch, sample their first tokens, join the batch."""
        entering, self.queue = self.queue, []
        for req, _ in entering:
            req.clock.start()
        fresh = self.new_rows([req for req, _ in entering])
        pad = getattr(self.model.config, "pad_token_id", None) or 0
        ids, token_valid = fresh.prefill_inputs([p for _, p in entering], pad)  # [B_new, P] each
        logits = self._prefill(fresh, ids, token_valid)[:, -1]  # [B_new, V]
        for b, (req, _) in enumerate(entering):
            req.tokens = [next_token(logits[b], self.params, req.generator)]
            req.clock.commit(1)
        self._join(fresh, [p for _, p in entering])
        self.active.extend(req for req, _ in entering)

    def _join(self, fresh, prompts: list[torch.Tensor]) -> None:
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
        self.busy0 = self.moe.target.cache.link.busy_seconds if self.moe is not None else 0.0

    def _target(self, rows, ids: torch.Tensor, token_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Target logits ``[B, T, V]``; with a runtime, one route-log window, padded tokens routed to no expert."""
        if self.moe is None:
            return rows.run(ids)
        self.route_log.begin_window()
        flt = padding_filter(token_valid, self.num_experts) if token_valid is not None else None
        with self.moe.mode("target", route_log=self.route_log, expert_filter=flt):
            return rows.run(ids)

    def _prefill(self, rows, ids, token_valid):
        return self._target(rows, ids, token_valid)

    def _iterate(self) -> None:
        logits = self._target(self.kv, self._last_tokens())[:, -1]  # [B, V]
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
        cache = self.moe.target.cache
        stats["distinct_experts_per_layer"] = working_set(self.route_log, self.step_windows, cache.layers)
        stats.update(io_stats(cache, cache.link.busy_seconds - self.busy0))
        return stats
