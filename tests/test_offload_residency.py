"""Expert-wise MoE execution through the slot cache vs the HF eager loop (CPU)."""

import itertools

import pytest
import torch

from specter.kernels.reference import moe_reference
import torch.nn.functional as F

from specter.offload import (
    EmulatedLink,
    ExpertCache,
    ExpertLayout,
    ExpertUID,
    HostExpertStore,
    ImmediateLink,
    expert_wise_moe,
    group_by_expert,
    token_wise_moe,
)

H, I = 16, 8
LAYER = 3



def _weights(E: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)  # [E, 2I, H]
    down = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)  # [E, H, I]
    return gate_up, down


def _store(gate_up_all, down_all) -> HostExpertStore:
    E = gate_up_all.shape[0]
    store = HostExpertStore(ExpertLayout(H, I, gate_up_all.dtype), [LAYER], E, pin_memory=False)
    for e in range(E):
        # checkpoint-style per-part writes
        store.write_part(ExpertUID(LAYER, e), "gate", gate_up_all[e, :I])
        store.write_part(ExpertUID(LAYER, e), "up", gate_up_all[e, I:])
        store.write_part(ExpertUID(LAYER, e), "down", down_all[e])
    store.assert_complete()
    return store


def _routing(T: int, E: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)  # [T, H]
    topk_idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # [T, k]
    topk_w = torch.softmax(torch.randn(T, k, generator=g), dim=-1).to(dtype)  # [T, k]
    return x, topk_idx, topk_w


def _capacities(E: int, k: int) -> list[int]:
    return sorted({c for c in (1, k - 1, k, E) if 1 <= c <= E})


def _random_residents(E: int, M: int, seed: int) -> list[int]:
    return torch.randperm(E, generator=torch.Generator().manual_seed(seed))[:M].tolist()


def test_group_by_expert_matches_hf_where_order():
    topk_idx = torch.tensor([[3, 1], [1, 0], [0, 3], [1, 3]])  # [T=4, k=2]
    E = 4
    mask = F.one_hot(topk_idx, num_classes=E + 1).permute(2, 1, 0)  # [E+1, k, T]
    groups = group_by_expert(topk_idx, E)
    assert [e for e, _, _ in groups] == [0, 1, 3]
    for e, tok, pos in groups:
        ref_pos, ref_tok = torch.where(mask[e])
        assert torch.equal(tok, ref_tok) and torch.equal(pos, ref_pos)
    # the "no expert" sentinel (index E) is skipped, out-of-range ids are refused
    assert [e for e, _, _ in group_by_expert(torch.tensor([[4, 2]]), E)] == [2]
    with pytest.raises(ValueError, match="out of range"):
        group_by_expert(torch.tensor([[5, 2]]), E)


EK = [(E, k) for E in (4, 16, 60) for k in (1, 2, 4, 6) if k <= E]


@pytest.mark.parametrize("E,k", EK)
def test_expert_wise_equals_reference_over_grid(E, k):
    gate_up_all, down_all = _weights(E, torch.float32, seed=E * 10 + k)
    store = _store(gate_up_all, down_all)
    link = ImmediateLink()
    for T, M in itertools.product((1, 2, 5, 17), _capacities(E, k)):
        seed = 1000 * T + 10 * M + k
        x, topk_idx, topk_w = _routing(T, E, k, torch.float32, seed)
        ref = moe_reference(x, topk_idx, topk_w, gate_up_all, down_all, F.silu)
        residents = _random_residents(E, M, seed)
        cache = ExpertCache(store, link, {LAYER: M}, "cpu", torch.float32, initial_residents={LAYER: residents})

        events = []
        out = expert_wise_moe(x, topk_idx, topk_w, LAYER, cache, F.silu, on_expert=lambda *ev: events.append(ev))
        assert torch.equal(out, ref), f"T={T} M={M}: max err {(out - ref).abs().max()}"

        needed = sorted(set(topk_idx.flatten().tolist()))
        hits = [e for e in needed if e in residents]
        misses = [e for e in needed if e not in residents]
        # hits first (ascending), then misses as they land (FIFO link: ascending too)
        assert [u.expert for u, _ in events] == hits + misses
        assert [h for _, h in events] == [True] * len(hits) + [False] * len(misses)
        # each needed expert loaded at most once, even when rolling (M < #needed)
        c = cache.counters
        assert (c.demand_hits, c.demand_misses) == (len(hits), len(misses))
        assert c.h2d_bytes == len(misses) * store.nbytes_per_expert
        assert cache.protected_count(LAYER) == 0 and len(cache.resident(LAYER)) == M

        # token-wise execution gives the same result (GEMV vs GEMM rounding allowed)
        tw = token_wise_moe(x, topk_idx, topk_w, LAYER, cache, F.silu)
        torch.testing.assert_close(tw, ref, rtol=1e-5, atol=1e-6)
        # output does not depend on the cache state left by the previous calls
        again = expert_wise_moe(x, topk_idx, topk_w, LAYER, cache, F.silu)
        assert torch.equal(again, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_expert_wise_low_precision_matches_reference(dtype):
    E, k = 16, 4
    gate_up_all, down_all = _weights(E, dtype)
    store = _store(gate_up_all, down_all)
    for T, M in [(1, 1), (5, 3), (17, 4), (17, 16)]:
        x, topk_idx, topk_w = _routing(T, E, k, dtype, seed=T + M)
        init = {LAYER: _random_residents(E, M, T)}
        cache = ExpertCache(store, ImmediateLink(), {LAYER: M}, "cpu", dtype, initial_residents=init)
        ref = moe_reference(x, topk_idx, topk_w, gate_up_all, down_all, F.silu)
        out = expert_wise_moe(x, topk_idx, topk_w, LAYER, cache, F.silu)
        torch.testing.assert_close(out, ref)  # dtype-default tolerance
        assert torch.equal(out, ref)  # same ops on the same shapes: bitwise equal on CPU
        ref32 = moe_reference(x.float(), topk_idx, topk_w.float(), gate_up_all.float(), down_all.float(), F.silu)
        torch.testing.assert_close(out.float(), ref32, rtol=5e-2, atol=5e-2)


def test_expert_wise_with_emulated_link_rolls_and_overlaps():
    E, k, T = 16, 6, 17
    gate_up_all, down_all = _weights(E, torch.float32, seed=7)
    store = _store(gate_up_all, down_all)
    x, topk_idx, topk_w = _routing(T, E, k, torch.float32, seed=7)
    ref = moe_reference(x, topk_idx, topk_w, gate_up_all, down_all, F.silu)
    link = EmulatedLink(20e6, 0.001)  # ~1.3 ms per expert: copies are still in flight while computing
    try:
        for M in (1, 5, 6, 16):
            init = {LAYER: _random_residents(E, M, M)}
            cache = ExpertCache(store, link, {LAYER: M}, "cpu", torch.float32, initial_residents=init)
            out = expert_wise_moe(x, topk_idx, topk_w, LAYER, cache, F.silu)
            assert torch.equal(out, ref)
            assert cache.counters.demand_hits + cache.counters.demand_misses == len(set(topk_idx.flatten().tolist()))
            if M < E:
                assert cache.counters.copy_wait_s > 0.0
    finally:
        link.close()


def test_output_independent_of_cache_state():
    E, k, T = 60, 4, 17
    gate_up_all, down_all = _weights(E, torch.float32, seed=3)
    store = _store(gate_up_all, down_all)
    x, topk_idx, topk_w = _routing(T, E, k, torch.float32, seed=3)
    outs = []
    for M, seed in [(1, 0), (3, 1), (4, 2), (30, 3), (60, 4)]:
        init = {LAYER: _random_residents(E, M, seed)}
        cache = ExpertCache(store, ImmediateLink(), {LAYER: M}, "cpu", torch.float32, initial_residents=init)
        outs.append(expert_wise_moe(x, topk_idx, topk_w, LAYER, cache, F.silu))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_unconsumed_prefetches_are_dropped_when_they_block_the_layer():
    E, k, T = 8, 2, 3
    gate_up_all, down_all = _weights(E, torch.float32, seed=5)
    store = _store(gate_up_all, down_all)
    x = torch.randn(T, H)
    topk_idx = torch.tensor([[0, 1], [1, 2], [2, 0]])  # [T, k]
    topk_w = torch.full((T, k), 0.5)
    cache = ExpertCache(store, ImmediateLink(), {LAYER: 2}, "cpu", torch.float32, initial_residents={LAYER: [6, 7]})
    cache.prefetch(ExpertUID(LAYER, 5))
    cache.prefetch(ExpertUID(LAYER, 6))  # mispredictions fill every slot
    assert cache.protected_count(LAYER) == 2
    out = expert_wise_moe(x, topk_idx, topk_w, LAYER, cache, F.silu)
    assert torch.equal(out, moe_reference(x, topk_idx, topk_w, gate_up_all, down_all, F.silu))
    assert cache.pending_prefetches(LAYER) == set() and cache.protected_count(LAYER) == 0


def test_layer_blocked_by_outstanding_handles_raises():
    E = 4
    gate_up_all, down_all = _weights(E, torch.float32)
    store = _store(gate_up_all, down_all)
    cache = ExpertCache(store, ImmediateLink(), {LAYER: 1}, "cpu", torch.float32)
    held = cache.acquire(ExpertUID(LAYER, 0))
    with pytest.raises(RuntimeError, match=f"layer {LAYER}: all 1 expert slots are protected"):
        expert_wise_moe(torch.randn(1, H), torch.tensor([[2]]), torch.ones(1, 1), LAYER, cache, F.silu)
    cache.release(held)


def test_token_wise_loads_more_than_expert_wise():
    E, k, T, M = 16, 4, 17, 4
    gate_up_all, down_all = _weights(E, torch.float32, seed=9)
    store = _store(gate_up_all, down_all)
    x, topk_idx, topk_w = _routing(T, E, k, torch.float32, seed=9)
    caches = [ExpertCache(store, ImmediateLink(), {LAYER: M}, "cpu", torch.float32) for _ in range(2)]
    expert_wise_moe(x, topk_idx, topk_w, LAYER, caches[0], F.silu)
    token_wise_moe(x, topk_idx, topk_w, LAYER, caches[1], F.silu)
    needed = set(topk_idx.flatten().tolist())
    assert caches[0].counters.demand_misses == len(needed - set(range(M)))  # one load per non-resident expert
    assert caches[1].counters.demand_misses > caches[0].counters.demand_misses
