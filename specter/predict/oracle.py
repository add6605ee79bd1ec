"""I/O oracle: the fewest expert loads any M-slot cache can do on a known routing trace.

Model (one MoE layer). Verification windows arrive in order; window t needs the expert set
W_t. A layer has M device slots, initially holding ``initial_residents``. During a window,
every expert of W_t must be resident at some instant (its tokens are computed then); experts
are served one at a time in any order, a miss loads the expert into a free slot or over any
resident, and a load costs ``expert_bytes``. Prefetching earlier cannot reduce the count, so
the model covers predictive and on-demand policies alike.

``min_load_bytes`` is the exact minimum of that count over all policies with perfect knowledge
of the future (MIN for unordered windows). It is therefore a lower bound on the H2D expert
bytes of any execution that computes every target-routed expert on the device with at most M
expert slots per layer: Specter's planner + residency manager, LRU caches, any prefetcher.
Staging buffers do not loosen it: a layer borrows one only while its own slots are all
protected and gives it back before the next window, so at every window boundary it holds M
experts, and within a window the model already lets any number of experts pass through M
slots one at a time (tests/test_oracle.py drives the real cache with staging against it). So
each method's bound is this one at its own M (MO-SM's M', SpecMoEOff's M) over its own windows
(`oracle_bytes`). It is not a bound for executions that keep more than M experts across a
window boundary, skip experts (expert budgeting), or compute experts on the CPU. Timing is
ignored: it bounds bytes, not stall time.

Construction: plain Belady (evict the furthest next use) is not enough when windows are
sets: the order inside a future window decides which expert survives it, so ties at the
window level matter. The serving order is therefore fixed backwards: inside each window,
experts are served furthest-next-request first (never-again first), so the most urgent
miss is loaded last and stays resident. Going forwards, each window serves its hits first,
then its misses in that order, each load evicting the resident whose next request (in that
serving order) is furthest away. Exactness rests on checks, not on a written proof: the
tests compare it with exhaustive search over every serving order and every eviction choice
on random small traces.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import AbstractSet, Mapping, Sequence


def min_loads(windows: Sequence[AbstractSet[int]], capacity: int, initial_residents: AbstractSet[int] = frozenset()) -> int:
    """Fewest expert loads for one layer (see the module docstring for the model)."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if len(initial_residents) > capacity:
        raise ValueError(f"{len(initial_residents)} initial residents exceed capacity {capacity}")
    T = len(windows)
    # Backward pass. A request's rank counts from the end of the trace (larger = sooner);
    # `next_rank[e]` is the rank of e's next request after the window being ordered.
    next_rank: dict[int, int] = {}
    serve_order: list[list[int]] = [[] for _ in range(T)]
    next_after: list[dict[int, int]] = [{} for _ in range(T)]
    rank = 0
    for t in range(T - 1, -1, -1):
        next_after[t] = dict(next_rank)
        # Furthest next request first; never requested again (-1) before everything else.
        order = sorted(windows[t], key=lambda e: (next_rank.get(e, -1), e))
        serve_order[t] = order
        for e in reversed(order):  # the last served gets the smallest rank of this window
            rank += 1
            next_rank[e] = rank
    # Forward pass: hits are served first (free); then each miss, in serving order, evicts the
    # resident whose next request is furthest (all residents are served by then).
    cache = set(initial_residents)
    loads = 0
    for t in range(T):
        nxt = next_after[t]
        misses = [e for e in serve_order[t] if e not in cache]
        for e in misses:
            loads += 1
            if len(cache) >= capacity:
                cache.remove(min(cache, key=lambda r: (nxt.get(r, -1), r)))
            cache.add(e)
    return loads


def min_load_bytes(
    windows: Sequence[AbstractSet[int]],
    capacity: int,
    initial_residents: AbstractSet[int],
    expert_bytes: int,
) -> int:
    """Oracle H2D bytes of one layer: ``min_loads(...) * expert_bytes``."""
    return min_loads(windows, capacity, initial_residents) * expert_bytes


def oracle_h2d_bytes(
    per_layer_windows: Mapping[int, Sequence[AbstractSet[int]]],
    capacity: Mapping[int, int] | int,
    initial: Mapping[int, AbstractSet[int]] | None,
    expert_bytes: int,
) -> int:
    """Oracle H2D bytes summed over layers (``capacity`` per layer or one M for all)."""
    return sum(layer_min_loads(per_layer_windows, capacity, initial).values()) * expert_bytes


def layer_min_loads(
    per_layer_windows: Mapping[int, Sequence[AbstractSet[int]]],
    capacity: Mapping[int, int] | int,
    initial: Mapping[int, AbstractSet[int]] | None,
) -> dict[int, int]:
    """Per layer, the fewest expert loads (`min_loads`) over its windows from its initial residents
    (``capacity`` per layer or one M for all)."""
    out = {}
    for layer, windows in per_layer_windows.items():
        m = capacity if isinstance(capacity, int) else capacity[layer]
        out[layer] = min_loads(windows, m, (initial or {}).get(layer, frozenset()))
    return out



def oracle_bytes(rt, log) -> int:
    """Fewest H2D bytes any policy with this runtime's own M slots per layer (staging buffers
    included, see the module docstring) could have moved for the target's actual per-window experts."""
    layers = rt.om.moe_layers
    per_layer = {layer: [w.get(layer, set()) for w in log.windows] for layer in layers}
    capacity = {layer: rt.cache.capacity(layer) for layer in layers}
    return oracle_h2d_bytes(per_layer, capacity, rt.cache.initial_residents(), rt.om.store.nbytes_per_expert)


def load_columns(rt, log, h2d_bytes: int, oracle: int, new_tokens: int) -> dict[str, float | None]:
    """Record columns of a run's load efficiency, from its H2D bytes and its Belady bound (`oracle_bytes`):

    - loads_per_window_layer: expert loads per route-log window (the prefill, each verification pass or
      autoregressive step) and MoE layer, the windows the bound is computed over;
    - loads_over_belady: H2D bytes over the bound at the method's own slots (1 = as few as a perfect future);
    - belady_loads_per_token: the bound in expert loads per generated token."""
    eb = rt.om.store.nbytes_per_expert
    cells = len(log.windows) * len(rt.om.moe_layers)
    return {
        "loads_per_window_layer": h2d_bytes / eb / cells if cells else None,
        "loads_over_belady": h2d_bytes / oracle if oracle else None,
        "belady_loads_per_token": oracle / eb / new_tokens if new_tokens else None,
    }


def oracle_plan(windows: list[dict[int, set[int]]], capacity: Mapping[int, int]) -> dict[int, list[int]]:
    """The oracle prefetch policy's plan: per layer, the experts a probe's positions used most.

    ``windows``: one route-log window per probed position (layer -> experts it used), so an
    expert's count is the number of positions using it; each layer keeps its top ``capacity``
    (ties go to the lower id). Shared by the single-request and the batched loops."""
    counts: dict[int, Counter] = defaultdict(Counter)
    for window in windows:
        for layer, experts in window.items():
            counts[layer].update(experts)
    return {layer: sorted(counts[layer], key=lambda e: (-counts[layer][e], e))[:capacity[layer]]
            for layer in capacity}
