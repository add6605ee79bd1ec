"""Window-aware residency (specter.offload.policy.WindowPolicy) on hand-made traces, no model.

- while drafting, a prefetch never evicts a resident the draft has routed to (LRU does);
- in verification, a miss replaces only a resident with no use left in the pass (Belady over the pass);
- what a pass leaves behind is ranked for the next window by the tokens it routed;
- a slow reference of the rule (timestamps, next-use distances) makes the same decisions on random traces.
"""

import random

import torch
import torch.nn.functional as F
from conftest import make_filled_store

from specter.offload import ExpertCache, ExpertUID, ImmediateLink
from specter.offload.policy import LRUPolicy, WindowPolicy, make_residency_policy
from specter.offload.residency import expert_wise_moe

H, I, E, LAYER = 8, 4, 8, 1


def _cache(residency: str, m: int = 4, staging: int = 0) -> ExpertCache:
    store = make_filled_store(E, (LAYER,), H, I)
    return ExpertCache(store, ImmediateLink(), {LAYER: m}, "cpu", torch.float32, staging=staging, residency=residency)


def _verify(cache: ExpertCache, routes: list[list[int]]) -> torch.Tensor:
    """One verification pass of LAYER for tokens routed to ``routes`` (one row of top-k experts per token)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(len(routes), H, generator=gen)
    idx = torch.tensor(routes)
    w = torch.rand(idx.shape, generator=gen)
    return expert_wise_moe(x, idx, w, LAYER, cache, F.silu)


def _window(cache: ExpertCache, draft_routed: list[int], prefetch: list[int], routes: list[list[int]]) -> torch.Tensor:
    """A window as the engine runs it: the boundary's hints, its prefetches, verification, release."""
    if cache.wants_hints:
        cache.predict(LAYER, draft_routed)
    for e in prefetch:
        cache.prefetch(ExpertUID(LAYER, e))
    out = _verify(cache, routes)
    cache.release_prefetches()
    cache.end_window()
    return out


def test_prefetch_keeps_a_resident_the_window_needs():
    # residents 0..3 (0 least recently used). The draft routes to 0 and 5; the plan prefetches 5.
    # LRU makes room for 5 by evicting 0, which verification needs a moment later: a reload.
    # The window policy evicts 1 (no predicted use) and verification hits 0.
    routes = [[0, 5], [5, 0]]
    lru, win = _cache("lru"), _cache("window")
    out_lru = _window(lru, [0, 5], [5], routes)
    out_win = _window(win, [0, 5], [5], routes)
    assert lru.counters.loads == 2 and lru.counters.demand_misses == 1  # 5 prefetched, 0 loaded again
    assert win.counters.loads == 1 and win.counters.demand_misses == 0
    assert win.resident(LAYER) == {0, 2, 3, 5}
    assert torch.equal(out_lru, out_win)  # residency never changes the result


def test_prefetch_is_staged_or_skipped_when_every_unprotected_resident_is_predicted():
    cache = _cache("window", staging=1)
    cache.predict(LAYER, [0, 1, 2, 3])
    assert cache.prefetch(ExpertUID(LAYER, 6)) is not None  # nothing may be replaced: a staging buffer takes it
    assert cache.counters.staged_loads == 1 and cache.free_staging() == 0 and cache.resident(LAYER) == {0, 1, 2, 3, 6}
    assert cache.prefetch(ExpertUID(LAYER, 7)) is None  # and with no buffer left, the prefetch is skipped
    assert cache.counters.loads == 1 and cache.counters.refused_by_policy == 1
    cache.release_prefetches()
    cache.end_window()
    assert cache.free_staging() == 1 and len(cache.resident(LAYER)) == 4  # the buffer is back before the next window
    assert cache.prefetch(ExpertUID(LAYER, 7)) is not None  # outside a window's evidence: LRU again


def test_a_draft_prefetch_spares_what_the_last_pass_used():
    # Window 1 verifies tokens routed to 0 and 1 (residents 0..3; LRU order after it: 2, 3, 0, 1). Window 2's
    # draft routes to 5, 6 and 7 at its first boundary, and its verification routes to 0 and 1 again.
    # LRU makes room for the third prefetch by evicting 0, which verification then loads again. The window
    # policy replaces only the cold residents 2 and 3 (neither routed nor used by the last pass), refuses
    # the third prefetch, and loads 7 on demand instead: one load fewer.
    def run(residency: str) -> ExpertCache:
        cache = _cache(residency)
        _window(cache, [0, 1], [], [[0, 1], [1, 0]])
        cache.reset_counters()
        out = _window(cache, [5, 6, 7], [5, 6, 7], [[0, 5], [1, 6], [7, 0]])
        return cache, out

    (lru, out_lru), (win, out_win) = run("lru"), run("window")
    assert lru.counters.loads == 4 and win.counters.loads == 3
    assert win.counters.refused_by_policy == 1 and win.counters.prefetch_loads == 2
    assert torch.equal(out_lru, out_win)  # residency never changes the result


def test_verification_miss_evicts_only_experts_the_pass_no_longer_needs():
    # Policy level, residents unprotected (a caller that does not pin its hits up front): the pass computes
    # 1, then 3 (a miss), then 0. LRU would replace 0 (least recently used) although the pass still needs it.
    for cls in (LRUPolicy, WindowPolicy):
        p = cls(3)
        for e in (0, 1, 2):
            p.admit(e)
        p.begin_pass([1, 3, 0], {1: 2, 3: 1, 0: 1})
        got = p.admit(3)
        if cls is LRUPolicy:
            assert got == (0, 0)  # slot 0, evicting expert 0: still needed by the pass
        else:
            assert got == (2, 2)  # expert 2: no use in this pass
    # once 1 is served it has no use left; with 0 and 3 still needed, 1 is the only candidate
    p.served(1)
    assert p.admit(4) == (1, 1)
    p.protect(4)  # in use
    assert p.choose_victim() is None  # 0 and 3 still needed by the pass, 4 protected: the miss waits
    p.served(3)
    assert p.choose_victim() == 3


def test_pass_ranks_what_stays_for_the_next_window():
    # After a pass routing 5 tokens to expert 2 and 1 token to expert 0, the next window's first eviction
    # (no predictions yet) takes the resident the pass did not use, then the one it used least.
    cache = _cache("window", m=3)
    _window(cache, [], [], [[2, 0], [2, 1], [2, 1], [2, 1], [2, 1]])  # tokens: 2 -> 5, 1 -> 4, 0 -> 1
    assert cache.resident(LAYER) == {0, 1, 2}
    cache.prefetch(ExpertUID(LAYER, 6))
    assert cache.resident(LAYER) == {1, 2, 6}  # 0 (one token) left first, whatever its load order


# ----------------------------------------------------------------------------- slow reference of the rule
class ReferencePolicy:
    """The window rule written plainly: timestamps for recency, next-use distances for the pass."""

    def __init__(self, capacity: int):
        self.capacity, self.clock = capacity, 0
        self.slot: dict[int, int] = {}
        self.stamp: dict[int, int] = {}
        self.pins: dict[int, int] = {}
        self.predicted: dict[int, int] = {}
        self.remaining: list[int] | None = None  # the pass's not-yet-computed groups, in order
        self.tokens: dict[int, int] = {}
        self.recent: dict[int, int] = {}  # the last finished pass's tokens per expert

    def _tick(self, e):
        self.clock += 1
        self.stamp[e] = self.clock

    def touch(self, e):
        self._tick(e)

    def predict(self, experts, counts=None):
        for e in experts:
            self.predicted[e] = max(self.predicted.get(e, 0), (counts or {}).get(e, 1))

    def begin_pass(self, order, tokens):
        self.remaining, self.tokens = list(order), dict(tokens)

    def served(self, e):
        if self.remaining is not None and e in self.remaining:
            self.remaining.remove(e)

    def end_pass(self):
        self.remaining = None
        self.recent = dict(self.tokens)
        for e in sorted(self.slot, key=lambda e: (self.tokens.get(e, 0), self.predicted.get(e, 0), self.stamp[e])):
            self._tick(e)
        self.tokens = {}

    def end_window(self):
        self.predicted, self.remaining, self.tokens = {}, None, {}

    def protect(self, e):
        self.pins[e] = self.pins.get(e, 0) + 1

    def unprotect(self, e):
        self.pins[e] -= 1

    def victim(self):
        cands = [e for e in self.slot if not self.pins.get(e)]
        if not cands:
            return None
        if self.remaining is not None:
            inf = len(self.remaining) + 1
            dist = {e: self.remaining.index(e) if e in self.remaining else inf for e in cands}
            far = max(dist.values())
            if far < inf:
                return None  # every candidate still needed by the pass
            return min((e for e in cands if dist[e] == far),
                       key=lambda e: (self.tokens.get(e, 0), self.predicted.get(e, 0), self.stamp[e]))
        if self.predicted:
            free = [e for e in cands if e not in self.predicted and e not in self.recent]
            return min(free, key=lambda e: self.stamp[e]) if free else None
        return min(cands, key=lambda e: self.stamp[e])

    def admit(self, e):
        if len(self.slot) < self.capacity:
            slot = min(set(range(self.capacity)) - set(self.slot.values()))
            evicted = None
        else:
            evicted = self.victim()
            if evicted is None:
                return None
            slot = self.slot.pop(evicted)
        self.slot[e] = slot
        self._tick(e)
        return slot, evicted

    def lookup(self, e):
        return self.slot.get(e)


def _drive(policy, rng: random.Random, windows: int, experts: int) -> list:
    """Run random windows (draft prefetches, then a verification pass, as the cache and expert_wise_moe
    do) on ``policy``; returns every decision it made."""
    log, prefetched = [], []

    def place(e):
        if policy.lookup(e) is not None:
            policy.touch(e)
            return True
        got = policy.admit(e)
        log.append(("admit", e, got))
        return got is not None

    for _ in range(windows):
        for _ in range(rng.randint(0, 2)):  # planner boundaries
            routed = rng.sample(range(experts), rng.randint(1, experts // 2))
            policy.predict(routed, {e: rng.randint(1, 4) for e in routed})
            for e in rng.sample(routed, rng.randint(0, len(routed))):
                if e not in prefetched and place(e):
                    policy.protect(e)
                    prefetched.append(e)
        groups = sorted(rng.sample(range(experts), rng.randint(1, experts - 1)))
        hits = [e for e in groups if policy.lookup(e) is not None]
        misses = [e for e in groups if policy.lookup(e) is None]
        policy.begin_pass(hits + misses, {e: rng.randint(1, 5) for e in groups})
        pinned = []
        for e in hits:
            policy.touch(e)
            if e in prefetched:
                prefetched.remove(e)  # the prefetch's protection passes to the handle
            else:
                policy.protect(e)
            pinned.append(e)
        for e in misses:
            while not place(e):
                if pinned:  # compute the oldest handle, which frees a slot (rolling)
                    done = pinned.pop(0)
                    policy.unprotect(done)
                    policy.served(done)
                elif prefetched:  # mispredicted prefetches give their slots back
                    for p in prefetched:
                        policy.unprotect(p)
                    prefetched.clear()
                else:
                    raise AssertionError("no slot can ever be freed")
            policy.protect(e)
            pinned.append(e)
        for done in pinned:
            policy.unprotect(done)
            policy.served(done)
        policy.end_pass()
        for p in prefetched:
            policy.unprotect(p)
        prefetched.clear()
        policy.end_window()
        log.append(("residents", sorted(policy.slot) if isinstance(policy, ReferencePolicy) else sorted(policy.residents())))
    return log


def test_window_policy_matches_a_slow_reference_of_the_rule():
    for capacity in (1, 2, 3, 5):
        for experts in (4, 8):
            for seed in range(25):
                got = _drive(make_residency_policy("window", capacity), random.Random(seed), 6, experts)
                want = _drive(ReferencePolicy(capacity), random.Random(seed), 6, experts)
                assert got == want, (capacity, experts, seed)


def test_the_load_efficiency_benchmark_measures_the_trained_proxies_on_the_calibrated_link():
    """scripts/bench_load_efficiency.py composes each cell on the trained proxy (an untrained model's draft is
    noise) with the emulated link at the model's default, cost-model ratio and the real model's slots."""
    import argparse
    import importlib.util
    from pathlib import Path

    from specter.assembly.config import load_ratio_of

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_load_efficiency.py"
    spec = importlib.util.spec_from_file_location("bench_load_efficiency", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(dataset="gsm8k", num_prompts=1, max_new_tokens=8, warmup_tokens=0, overrides=[])
    cfg = bench.cell_config("tiny_qwen", "high", args)
    assert cfg.model.trained is True and cfg.hardware.link == "emulated"
    assert load_ratio_of(cfg)[1].startswith("cost model")
    assert str(cfg.memory.get("slots") or "real_plan") == "real_plan"
