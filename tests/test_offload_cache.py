"""LRU policy and per-layer expert slot cache (CPU, immediate and emulated links)."""

import pytest
import torch

from conftest import make_filled_store
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specter.offload import (
    EmulatedLink,
    ExpertCache,
    ExpertLayout,
    ExpertUID,
    HostExpertStore,
    ImmediateLink,
    LRUPolicy,
)

H, I = 8, 4
LAYERS = [1, 2]



def _filled_store(E: int, layers=LAYERS) -> HostExpertStore:
    return make_filled_store(E, layers, H, I)


def _assert_slot_matches(cache: ExpertCache, layer: int) -> None:
    cache.wait_resident(layer)
    for expert in cache.resident(layer):
        slot = cache.slot_of(layer, expert)
        assert torch.equal(cache.slot_buffer(layer, slot), cache.store.buffer(ExpertUID(layer, expert)))


# ----------------------------------------------------------------------------- policy
def test_lru_policy_victims_and_protection():
    p = LRUPolicy(3)
    assert [p.admit(e) for e in (5, 6, 7)] == [(0, None), (1, None), (2, None)]
    assert p.choose_victim() == 5
    p.touch(5)
    assert p.lru_order() == [6, 7, 5] and p.choose_victim() == 6
    p.protect(6)
    p.protect(6)
    assert p.choose_victim() == 7 and p.protected_count() == 1
    assert p.admit(8) == (2, 7)  # 7's slot reused
    assert p.lookup(7) is None and p.lookup(8) == 2
    p.protect(5)
    p.protect(8)
    assert p.choose_victim() is None and p.admit(9) is None  # all protected
    p.unprotect(6)
    assert p.choose_victim() is None  # still one protection left on 6
    p.unprotect(6)
    assert p.admit(9) == (1, 6)
    assert len(p) == 3
    with pytest.raises(RuntimeError):
        p.unprotect(9)
    with pytest.raises(ValueError):
        LRUPolicy(0)


# ----------------------------------------------------------------------------- cache
def test_construction_errors_name_the_layer():
    store = _filled_store(4)
    with pytest.raises(ValueError, match="layer 2"):
        ExpertCache(store, ImmediateLink(), {1: 2, 2: 0}, "cpu", torch.float32)
    with pytest.raises(ValueError, match="layer 1"):
        ExpertCache(store, ImmediateLink(), {1: 5}, "cpu", torch.float32)
    with pytest.raises(ValueError, match="layer 0"):
        ExpertCache(store, ImmediateLink(), {0: 1}, "cpu", torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        ExpertCache(store, ImmediateLink(), {1: 1}, "cpu", torch.float16)


def test_initial_residents_hits_misses_and_reset():
    store = _filled_store(6)
    cache = ExpertCache(store, ImmediateLink(), {1: 2, 2: 3}, "cpu", torch.float32)
    assert cache.resident(1) == {0, 1} and cache.resident(2) == {0, 1, 2}
    assert cache.device_bytes() == 5 * store.nbytes_per_expert
    _assert_slot_matches(cache, 1)

    h0 = cache.acquire(ExpertUID(1, 0))
    assert h0.hit and cache.protected_count(1) == 1
    h4 = cache.acquire(ExpertUID(1, 4))  # evicts 1 (0 is protected)
    assert not h4.hit and cache.resident(1) == {0, 4}
    assert cache.acquire(ExpertUID(1, 5)) is None  # both slots protected
    gate_up, down = cache.views(h4)
    assert torch.all(gate_up == 1004.0) and torch.all(down == 1004.5)
    cache.release(h0)
    with pytest.raises(RuntimeError, match="twice"):
        cache.release(h0)
    h5 = cache.acquire(ExpertUID(1, 5))
    assert h5.slot == h0.slot and cache.resident(1) == {4, 5}
    cache.release(h4)
    cache.release(h5)
    c = cache.snapshot_counters()
    assert c["demand_hits"] == 1 and c["demand_misses"] == 2
    assert c["loads"] == 2 and c["h2d_bytes"] == 2 * store.nbytes_per_expert

    cache.reset()
    assert cache.resident(1) == {0, 1} and cache.protected_count(1) == 0
    assert all(v == 0 for v in cache.snapshot_counters().values())
    _assert_slot_matches(cache, 1)
    _assert_slot_matches(cache, 2)


def test_prefetch_is_protected_until_consumed():
    store = _filled_store(6)
    cache = ExpertCache(store, ImmediateLink(), {1: 2}, "cpu", torch.float32)
    p = cache.prefetch(ExpertUID(1, 3))
    assert p.prefetch and not p.hit and cache.pending_prefetches(1) == {3}
    assert cache.prefetch(ExpertUID(1, 3)).hit  # a second prefetch adds nothing
    assert cache.protected_count(1) == 1
    with pytest.raises(ValueError, match="prefetch"):
        cache.release(p)
    # demand traffic cannot evict the prefetched expert
    for e in (4, 5, 0):
        h = cache.acquire(ExpertUID(1, e))
        cache.release(h)
        assert 3 in cache.resident(1)
    h = cache.acquire(ExpertUID(1, 3))
    assert h.hit and cache.pending_prefetches(1) == set()
    assert cache.protected_count(1) == 1  # the prefetch's protection moved to the handle
    cache.release(h)
    assert cache.protected_count(1) == 0
    c = cache.counters
    assert c.prefetch_loads == 1 and c.prefetch_used == 1
    assert c.loads == 4 and c.demand_misses == 3 and c.demand_hits == 1
    # an unconsumed prefetch is dropped on request
    cache.prefetch(ExpertUID(1, 1))
    assert cache.release_prefetches(1) == 1 and cache.protected_count(1) == 0


def test_prefetch_of_resident_expert_counts_no_load():
    store = _filled_store(4)
    cache = ExpertCache(store, ImmediateLink(), {1: 2}, "cpu", torch.float32, initial_residents={1: [2, 3]})
    assert cache.resident(1) == {2, 3}
    h = cache.prefetch(ExpertUID(1, 2))
    assert h.hit and cache.counters.prefetch_loads == 0 and cache.counters.loads == 0
    a = cache.acquire(ExpertUID(1, 2))
    cache.release(a)
    assert cache.counters.prefetch_used == 0 and cache.counters.demand_hits == 1


OPS = st.lists(
    st.tuples(
        st.sampled_from(["acquire", "prefetch", "release", "drop", "wait"]), st.integers(0, 5), st.integers(0, 1)
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, cap1=st.integers(1, 4), cap2=st.integers(1, 3), emulated=st.booleans())
def test_cache_invariants_under_random_traffic(ops, cap1, cap2, emulated):
    E = 6
    store = _filled_store(E)
    link = EmulatedLink(2e9, 0.0005) if emulated else ImmediateLink()
    caps = {1: cap1, 2: cap2}
    cache = ExpertCache(store, link, caps, "cpu", torch.float32)
    held = []  # outstanding acquire handles
    prefetched = {1: set(), 2: set()}
    demand_acquires = 0
    try:
        for op, e, li in ops:
            layer = LAYERS[li]
            uid = ExpertUID(layer, e)
            before = cache.resident(layer)
            if op == "acquire":
                demand_acquires += 1
                h = cache.acquire(uid)
                if h is None:
                    demand_acquires -= 1
                    # refusal only when every slot is protected
                    assert cache.protected_count(layer) == caps[layer]
                else:
                    assert h.hit == (e in before)
                    prefetched[layer].discard(e)
                    held.append(h)
            elif op == "prefetch":
                h = cache.prefetch(uid)
                if h is None:
                    assert cache.protected_count(layer) == caps[layer]
                else:
                    prefetched[layer].add(e)
            elif op == "release" and held:
                cache.release(held.pop(e % len(held)))
            elif op == "drop":
                assert cache.release_prefetches(layer) == len(prefetched[layer])
                prefetched[layer].clear()
            elif op == "wait" and held:
                h = held[e % len(held)]
                cache.wait(h)
                gate_up, down = cache.views(h)
                assert torch.all(gate_up == h.uid.layer * 1000 + h.uid.expert)
            # invariants after every step
            for lay in LAYERS:
                res = cache.resident(lay)
                assert len(res) <= caps[lay]
                protected = {h.uid.expert for h in held if h.uid.layer == lay} | prefetched[lay]
                assert protected <= res  # a protected expert is never evicted
                assert cache.protected_count(lay) == len(protected)
                assert cache.pending_prefetches(lay) == prefetched[lay]
            for h in held:  # every live handle still owns its slot
                assert cache.slot_of(h.uid.layer, h.uid.expert) == h.slot
        c = cache.counters
        assert c.demand_hits + c.demand_misses == demand_acquires
        assert c.loads == c.demand_misses + c.prefetch_loads
        assert c.h2d_bytes == c.loads * store.nbytes_per_expert
        link.synchronize()
        assert link.copies == c.loads and link.bytes_copied == c.h2d_bytes
        for lay in LAYERS:  # slot bytes equal their expert's host bytes once landed
            _assert_slot_matches(cache, lay)
        cache.reset()
        for lay in LAYERS:
            assert cache.resident(lay) == set(range(caps[lay])) and cache.protected_count(lay) == 0
            _assert_slot_matches(cache, lay)
        assert cache.counters.loads == 0
    finally:
        link.close()


def test_copy_into_slot_is_ordered_after_last_use_with_emulated_link():
    """A miss submitted while copies are in flight still lands the right bytes in every slot."""
    store = _filled_store(8, layers=[1])
    link = EmulatedLink(50e6, 0.001)  # slow enough that several copies queue up
    cache = ExpertCache(store, link, {1: 2}, "cpu", torch.float32)
    for e in [2, 3, 4, 5, 6, 7, 0, 1]:
        h = cache.acquire(ExpertUID(1, e))
        assert not h.ready.done() or h.hit
        cache.wait(h)
        assert torch.all(cache.views(h)[0] == 1000 + e)
        cache.release(h)
    assert cache.counters.copy_wait_s > 0.0
    link.close()
