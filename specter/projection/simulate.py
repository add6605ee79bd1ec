"""Replay of per-token routes at a real model's sizes on the virtual clock (target_only, offload_ar).

What is the engine's own: the per-layer LRU policy (`specter.offload.cache.LRUPolicy`: which
expert is evicted, which slot it frees) and the residency order of a layer ("hits first, misses
computed as they land"). What is a replay: the forward itself (each op is charged its cost from
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


def offload_ar(cm: CostModel, routes: list[dict[int, list[int]]], resident: int) -> dict[str, float]:
    """Autoregressive decoding with `resident` LRU slots per MoE layer; misses load on demand.

    `routes[t][layer]` are token t's routed experts in real MoE layer `layer`. Returns TPOT (s),
    misses per token and the copy stream's busy fraction."""
    s = cm.s
    clock = VirtualClock()
    policies = {layer: LRUPolicy(resident) for layer in range(s.moe_layers)}
    for layer, pol in policies.items():  # the engine's initial residents: experts 0..M-1 of each layer
        for e in range(min(resident, s.num_experts)):
            pol.admit(e)
    misses = 0
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
            for e in hits:  # hits first, protected so a miss cannot evict them mid-layer
                pol.touch(e)
                pol.protect(e)
                clock.compute_on((layer, pol.lookup(e)), f"expert {e}", t_expert)
            # the router's result reaches the host before a miss can be submitted
            router_done = clock.enqueue("compute", "route sync", 0.0)
            clock.wait("copy", router_done)
            for e in miss:
                placed = pol.admit(e)
                if placed is None:
                    raise RuntimeError(f"layer {layer}: every slot is protected (M={resident} < top-k?)")
                slot = placed[0]
                pol.protect(e)
                clock.copy_into((layer, slot), f"h2d {e}", t_h2d)
                clock.compute_on((layer, slot), f"expert {e}", t_expert)  # computed as it lands
            misses += len(miss)
            for e in experts:
                pol.unprotect(e)
        clock.enqueue("compute", "lm_head", cm.t(cm.lm_head(1)))
        clock.sync()  # the token reaches the host before the next step
    n = max(1, len(routes))
    copy_busy = sum(end - start for stream, _, start, end in clock.log if stream == "copy")
    return {"tpot": clock.elapsed / n, "misses_per_token": misses / n,
            "copy_busy": copy_busy / clock.elapsed if clock.elapsed else 0.0}
