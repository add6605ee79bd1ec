"""Verification-time residency: expert-wise execution of one MoE layer's routed experts.

For the T tokens of a verification pass (K+1 per request) the target router has
already chosen ``topk_idx [T,k]``. Instead of running tokens one by one, tokens are
grouped by expert and each expert runs once as a GEMM over its tokens::

    route ──► group tokens by expert (ascending id)
          ──► acquire hits (protect)  ──► submit misses (as many as free-able slots)
          ──► compute hits, each waiting only on its own slot's ticket
          ──► compute misses as they land; a released slot takes the next miss (rolling)
          ──► index_add_ the per-expert outputs in ascending expert id

The final accumulation order is fixed, so the result never depends on cache state or
copy timing, and matches the HF eager loop (``specter.kernels.reference.moe_reference``) bit for bit on the
same device and dtype.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import torch

from specter.kernels.reference import expert_ffn, group_by_expert

from .cache import ExpertCache, SlotHandle
from .store import ExpertUID

ActFn = Callable[[torch.Tensor], torch.Tensor]
OnExpert = Callable[[ExpertUID, bool], None]  # (expert, was it a hit) at compute time


def _acquire_or_free(cache: ExpertCache, uid: ExpertUID) -> SlotHandle | None:
    """Acquire; when every slot is protected, unconsumed prefetches of this layer are
    mispredictions by now (routing is authoritative), so drop them and retry once."""
    handle = cache.acquire(uid)
    if handle is None and cache.release_prefetches(uid.layer):
        handle = cache.acquire(uid)
    return handle


def expert_wise_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, layer: int, cache: ExpertCache,
                    act_fn: ActFn, on_expert: OnExpert | None = None, tracer=None, meter=None) -> torch.Tensor:
    """Routed-expert output ``[T,H]`` of ``x [T,H]`` for ``topk_idx/topk_w [T,k]`` through the cache.

    ``tracer`` (a `specter.speculative.trace.WindowTracer`) receives each expert's wait and compute spans;
    ``meter`` (a `specter.moe.OpMeter`) is told each expert compute, after its wait and before its release.
    """
    groups = group_by_expert(topk_idx, cache.store.num_experts)
    by_expert = {e: (tok, pos) for e, tok, pos in groups}
    needed = [ExpertUID(layer, e) for e, _, _ in groups]

    # Hits first: protecting them before any miss is submitted keeps misses off their slots.
    hits = [uid for uid in needed if cache.is_resident(uid)]
    waiting = deque(uid for uid in needed if not cache.is_resident(uid))
    ready: deque[SlotHandle] = deque()
    if cache.wants_hints:  # the pass's known routes: the policy replaces only what the pass no longer needs
        cache.begin_pass(layer, [u.expert for u in hits] + [u.expert for u in waiting],
                         {e: len(tok) for e, (tok, _) in by_expert.items()})
    for uid in hits:
        handle = cache.acquire(uid)
        assert handle is not None, "a resident expert can always be acquired"
        ready.append(handle)
    in_flight: list[SlotHandle] = []  # submission order

    def submit_waiting() -> None:
        while waiting:
            handle = _acquire_or_free(cache, waiting[0])
            if handle is None:
                return
            waiting.popleft()
            in_flight.append(handle)

    submit_waiting()
    outputs: dict[int, torch.Tensor] = {}  # expert -> [n, H], weighted
    while ready or in_flight:
        handle = _next_to_compute(ready, in_flight)
        tok, pos = by_expert[handle.uid.expert]
        outputs[handle.uid.expert] = _compute(x, topk_w, tok, pos, handle, cache, act_fn, tracer, meter)
        if on_expert is not None:
            on_expert(handle.uid, handle.hit)
        cache.release(handle)
        submit_waiting()  # rolling: the slot just released takes the next miss
        if waiting and not ready and not in_flight:
            raise _no_free_slot(cache, layer, waiting[0])
    if waiting:
        raise _no_free_slot(cache, layer, waiting[0])
    if cache.wants_hints:
        cache.end_pass(layer)

    final = torch.zeros_like(x)  # [T, H]
    for e in sorted(outputs):
        final.index_add_(0, by_expert[e][0], outputs[e].to(final.dtype))
    return final


def _next_to_compute(ready: deque[SlotHandle], in_flight: list[SlotHandle]) -> SlotHandle:
    """Hits whose slot is ready go first; a hit still in flight (a late prefetch) does not hold
    back a miss that has already landed. Otherwise wait on the oldest copy (FIFO link)."""
    i = next((i for i, h in enumerate(ready) if h.ready.done()), None)
    if i is not None:
        handle = ready[i]
        del ready[i]
        return handle
    if (j := next((j for j, h in enumerate(in_flight) if h.ready.done()), None)) is not None:
        return in_flight.pop(j)
    return ready.popleft() if ready else in_flight.pop(0)


def _compute(x: torch.Tensor, topk_w: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor, handle: SlotHandle,
             cache: ExpertCache, act_fn: ActFn, tracer, meter) -> torch.Tensor:
    """One expert's output ``[n, H]`` over its ``n`` tokens ``x[tok]``, weighted by their routing
    weights ``topk_w[tok, pos]``, once its slot's copy has landed."""
    t_wait = time.perf_counter() if tracer is not None else 0.0
    cache.wait(handle)
    t_compute = time.perf_counter() if tracer is not None else 0.0
    gate_up, down = cache.views(handle)
    y = expert_ffn(x[tok], gate_up, down, act_fn)  # [n, H]
    out = y * topk_w[tok, pos, None]
    if meter is not None:
        meter.expert(handle.uid, len(tok), cache.slot_buffer(handle.uid.layer, handle.slot))
    if tracer is not None:
        uid = handle.uid
        tracer.span("wait", t_wait, t_compute, layer=uid.layer, expert=uid.expert, phase="hit" if handle.hit else "miss")
        tracer.span("compute", t_compute, time.perf_counter(), layer=uid.layer, expert=uid.expert)
    return out


def _no_free_slot(cache: ExpertCache, layer: int, uid: ExpertUID) -> RuntimeError:
    return RuntimeError(f"layer {layer}: all {cache.capacity(layer)} expert slots are protected elsewhere; "
                        f"cannot load expert {uid.expert}")


def token_wise_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, layer: int, cache: ExpertCache,
                   act_fn: ActFn, on_expert: OnExpert | None = None, meter=None) -> torch.Tensor:
    """Token-at-a-time execution (what autoregressive offloading does): each token loads
    and runs its own experts. Same result as ``expert_wise_moe`` up to GEMM rounding;
    each token's experts are summed in ascending id like the reference."""
    final = torch.zeros_like(x)  # [T, H]
    idx_rows = topk_idx.tolist()
    for t, row in enumerate(idx_rows):
        for pos in sorted(range(len(row)), key=lambda p: row[p]):
            e = row[pos]
            if e == cache.store.num_experts:  # "no expert" sentinel
                continue
            uid = ExpertUID(layer, e)
            handle = _acquire_or_free(cache, uid)
            if handle is None:
                raise RuntimeError(f"layer {layer}: all expert slots are protected elsewhere; cannot load expert {e}")
            cache.wait(handle)
            gate_up, down = cache.views(handle)
            y = expert_ffn(x[t : t + 1], gate_up, down, act_fn) * topk_w[t, pos]  # [1, H]
            if meter is not None:
                meter.expert(uid, 1, cache.slot_buffer(layer, handle.slot))
            if on_expert is not None:
                on_expert(uid, handle.hit)
            cache.release(handle)
            final[t : t + 1] += y.to(final.dtype)
    return final
