"""Replay of per-token routes at a real model's sizes on the virtual clock (target_only, offload_ar).

What is the engine's own: the per-layer LRU policy (`specter.offload.cache.LRUPolicy`: which
expert is evicted, which slot it frees) and the residency order of a layer (`expert_wise_moe`: after
the router every miss is submitted, the hits compute while they copy, the misses compute as they
land). What is a replay: the forward itself (each op is charged its cost from
`cost_model.CostModel` on `clock.VirtualClock`, nothing runs), and the routes are given per
token (real layer -> routed expert ids, e.g. through `mapping.RouteMap`).
"""

from __future__ import annotations

from specter.offload.cache import LRUPolicy
from specter.projection.clock import VirtualClock
from specter.projection.cost_model import CostModel


def target_only(cm: CostModel, tokens: int) -> float:
    """Seconds per token with every expert on the device (no copies)."""
    return cm.target_step_resident()


def offload_ar(cm: CostModel, routes: list[dict[int, list[int]]], resident: int, staging: int = 0) -> dict[str, float]:
    """Autoregressive decoding with `resident` LRU slots per MoE layer; misses load on demand.

    `routes[t][layer]` are token t's routed experts in real MoE layer `layer`. `staging` buffers are
    shared by all layers as in the engine's cache (`specter/offload/cache.py`): a layer whose own
    slots are all protected borrows one for its next miss (the policy grows a slot) and gives it back
    once its experts are released (evicting its LRU expert and moving the top slot's expert into the
    victim's buffer). A buffer's copy and last-use events travel with it, so a borrowed buffer's next
    copy still waits for its last compute in the layer that used it. Returns TPOT (s), misses per
    token, staged loads per token, the copy stream's busy fraction and each token's commit time (`step_ends`)."""
    s = cm.s
    clock = VirtualClock()
    policies = {layer: LRUPolicy(resident) for layer in range(s.moe_layers)}
    buffers = {layer: [(layer, slot) for slot in range(resident)] for layer in range(s.moe_layers)}  # slot -> buffer
    pool = [("staging", k) for k in range(staging)]  # free staging buffers
    staged = 0
    for layer, pol in policies.items():  # the engine's initial residents: experts 0..M-1 of each layer
        for e in range(min(resident, s.num_experts)):
            pol.admit(e)
    misses = 0
    ends = []  # each token's commit (the clock after its step)
    t_expert, t_h2d = cm.t(cm.expert(1)), cm.h2d()
    for step in routes:
        for _ in range(s.num_layers - s.moe_layers):  # dense layers: attention + dense MLP
            clock.enqueue("compute", "dense layer", cm.dense_only_layer(1))
        for layer in range(s.moe_layers):
            clock.enqueue("compute", "attn+router+shared", cm.dense_layer(1))
            pol = policies[layer]
            experts = step.get(layer, [])
            hits = [e for e in experts if pol.lookup(e) is not None]
            miss = [e for e in experts if pol.lookup(e) is None]
            for e in hits:  # hits are protected first, so a miss cannot evict them mid-layer
                pol.touch(e)
                pol.protect(e)
            # the router's result reaches the host, which submits every miss before any expert computes
            router_done = clock.enqueue("compute", "route sync", 0.0)
            clock.wait("copy", router_done)
            landing = []
            for e in miss:
                placed = pol.admit(e)
                if placed is None and pool:  # every own slot protected: borrow a staging buffer
                    pol.grow()
                    buffers[layer].append(pool.pop())
                    placed = pol.admit(e)
                    staged += 1
                if placed is None:
                    raise RuntimeError(f"layer {layer}: every slot is protected (M={resident} < top-k, "
                                       f"{staging} staging buffers)")
                buf = buffers[layer][placed[0]]
                pol.protect(e)
                clock.copy_into(buf, f"h2d {e}", t_h2d)
                landing.append((e, buf))
            for e in hits:  # the hits compute while the misses copy
                clock.compute_on(buffers[layer][pol.lookup(e)], f"expert {e}", t_expert)
            for e, buf in landing:
                clock.compute_on(buf, f"expert {e}", t_expert)  # computed as it lands
            misses += len(miss)
            for e in experts:
                pol.unprotect(e)
            _return_staging(pol, buffers[layer], resident, pool)
        clock.enqueue("compute", "lm_head", cm.t(cm.lm_head(1)))
        ends.append(clock.sync())  # the token reaches the host before the next step
    n = max(1, len(routes))
    copy_busy = sum(end - start for stream, _, start, end in clock.log if stream == "copy")
    return {"tpot": clock.elapsed / n, "misses_per_token": misses / n, "staged_per_token": staged / n,
            "copy_busy": copy_busy / clock.elapsed if clock.elapsed else 0.0, "step_ends": ends}


def _return_staging(pol: LRUPolicy, buffers: list, own: int, pool: list) -> None:
    """The engine's `_return_staging`: drop borrowed top slots, moving an unprotected top expert into
    the LRU victim's slot by swapping the two buffers; stops while something is still protected."""
    while pol.capacity > own:
        top = pol.capacity - 1
        holder = pol.holder(top)
        if holder is not None:
            victim = pol.choose_victim()
            if victim is None or (holder != victim and pol.is_protected(holder)):
                return
            freed = pol.evict(victim)
            if holder != victim:
                pol.relocate(holder, freed)
                buffers[freed], buffers[top] = buffers[top], buffers[freed]
        pol.drop_top_slot()
        pool.append(buffers.pop())
