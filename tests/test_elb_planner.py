"""ELB counters and the three-phase prefetch planner (cold start -> overlap -> final cleanup)."""

from __future__ import annotations

import random

import pytest
import torch

from specter.predict.elb import ExpertLoadBuffer
from specter.predict.planner import POLICIES, Chunk, PlannerConfig, PrefetchPlanner, make_policy


# -- ELB ---------------------------------------------------------------------------------------

def _reference_plan(counts: dict[int, list[int]], capacity: dict[int, int]) -> dict[int, list[int]]:
    """Top-M by count (desc), ties to the lower expert id, counted experts only."""
    plan = {}
    for layer, m in capacity.items():
        ranked = sorted((e for e, c in enumerate(counts[layer]) if c > 0), key=lambda e: (-counts[layer][e], e))
        plan[layer] = ranked[:m]
    return plan


@pytest.mark.parametrize("num_experts,top_k,tokens", [(4, 1, 1), (8, 2, 5), (16, 4, 16), (64, 6, 3)])
def test_elb_counts_and_plan_match_python_reference(num_experts, top_k, tokens):
    rng = random.Random(num_experts * 31 + tokens)
    layers = [1, 2, 5]  # model layer ids need not be contiguous
    elb = ExpertLoadBuffer(layers, num_experts)
    counts = {layer: [0] * num_experts for layer in layers}
    for _ in range(4):  # several draft steps
        for layer in layers:
            routes = [rng.sample(range(num_experts), top_k) for _ in range(tokens)]  # [T, k]
            elb.add(layer, torch.tensor(routes))
            for row in routes:
                for e in row:
                    counts[layer][e] += 1
    assert elb.counts().tolist() == [counts[layer] for layer in layers]
    assert elb.counts().dtype == torch.int32
    for m in (0, 1, 3, num_experts):
        capacity = {layer: m for layer in layers}
        assert elb.snapshot_plan(capacity) == _reference_plan(counts, capacity)
    mixed = {1: 2, 5: num_experts}
    assert elb.snapshot_plan(mixed) == _reference_plan(counts, mixed)


def test_elb_tie_break_and_counted_only():
    elb = ExpertLoadBuffer([0], 8)
    elb.add(0, torch.tensor([[5, 3], [1, 0]]))
    elb.add(0, torch.tensor([[1, 3], [5, 7]]))  # counts: 1,3,5 -> 2; 0,7 -> 1
    assert elb.snapshot_plan({0: 3}) == {0: [1, 3, 5]}
    assert elb.snapshot_plan({0: 4}) == {0: [1, 3, 5, 0]}
    assert elb.snapshot_plan({0: 8}) == {0: [1, 3, 5, 0, 7]}  # never-routed experts are not planned
    elb.add(0, torch.tensor([[7, 7, 7]]))  # repeated ids in one call all count
    assert elb.snapshot_plan({0: 2}) == {0: [7, 1]}


def test_elb_clear_and_errors():
    elb = ExpertLoadBuffer([3, 4], 6)
    elb.add(3, torch.tensor([[0, 1]]))
    elb.add(4, torch.tensor([[2, 1]]))
    elb.clear()
    assert int(elb.counts().sum()) == 0
    assert elb.snapshot_plan({3: 2, 4: 2}) == {3: [], 4: []}
    with pytest.raises(KeyError):
        elb.snapshot_plan({7: 1})
    with pytest.raises(KeyError):
        elb.add(9, torch.tensor([[0]]))
    with pytest.raises(ValueError):
        ExpertLoadBuffer([1, 1], 4)


# -- planner -----------------------------------------------------------------------------------

MB = 1_000_000


@pytest.mark.parametrize("K,b1", [(1, 1), (4, 1), (8, 1), (10, 2), (16, 3), (32, 6)])
def test_first_boundary_is_cold_start_fraction(K, b1):
    planner = PrefetchPlanner(PlannerConfig(), K, MB)
    assert planner.first_boundary == b1 == planner.next_boundary
    assert planner.phase == "cold_start"
    assert planner.trace == [Chunk("cold_start", 0, b1, 0)]


def test_no_batch_before_first_boundary():
    planner = PrefetchPlanner(PlannerConfig(), 16, MB)
    with pytest.raises(ValueError):
        planner.on_boundary(1, {0: [1]}, {0: set()}, {0: set()}, {0: 4})
    assert planner.trace == [Chunk("cold_start", 0, 3, 0)]


def test_boundary_arithmetic_three_step_chunk():
    # bandwidth 1 GB/s, draft step 1 ms, 3 x 1 MB experts -> 3 ms of H2D -> a 3-step chunk.
    cfg = PlannerConfig(bandwidth_init=1e9, draft_step_init=1e-3)
    planner = PrefetchPlanner(cfg, 16, MB)
    d = planner.on_boundary(3, {0: [4, 5, 6]}, {0: set()}, {0: set()}, {0: 8})
    assert d.batch == [(0, 4), (0, 5), (0, 6)]
    assert (d.next_boundary, d.phase) == (6, "overlap")
    # 2.5 ms of transfers round up to 3 steps; an empty batch still advances by one step.
    planner = PrefetchPlanner(cfg, 16, 2_500_000 // 2)
    assert planner.on_boundary(3, {0: [1, 2]}, {0: set()}, {0: set()}, {0: 8}).next_boundary == 6
    planner = PrefetchPlanner(cfg, 16, MB)
    d = planner.on_boundary(3, {0: [1]}, {0: {1}}, {0: set()}, {0: 8})
    assert d.batch == [] and d.next_boundary == 4


def test_phase_sequence_with_elb_counters():
    """Drafting feeds the ELB; each boundary snapshots it; the window ends in final cleanup."""
    K, E, M = 16, 8, 4
    layers = [1, 2]
    cfg = PlannerConfig(bandwidth_init=1e9, draft_step_init=1e-3)
    planner = PrefetchPlanner(cfg, K, MB)
    elb = ExpertLoadBuffer(layers, E)
    capacity = {layer: M for layer in layers}
    resident = {1: {0, 7}, 2: set()}  # left over from an earlier window
    inflight: dict[int, set[int]] = {layer: set() for layer in layers}
    # Draft step s routes expert s // 2 (layer 1) and (s // 3) + 2 (layer 2): new experts appear slowly.
    loaded: list[tuple[int, int]] = []
    for step in range(1, K + 1):
        elb.add(1, torch.tensor([[(step - 1) // 2]]))
        elb.add(2, torch.tensor([[(step - 1) // 3 + 2]]))
        if step == planner.next_boundary:
            d = planner.on_boundary(step, elb.snapshot_plan(capacity), resident, inflight, capacity)
            for layer, e in d.batch:
                inflight[layer].add(e)
            loaded += d.batch
    phases = [c.phase for c in planner.trace]
    assert phases[0] == "cold_start" and phases[-1] == "final_cleanup"
    assert set(phases[1:-1]) == {"overlap"} and len(phases) >= 4
    starts = [c.start for c in planner.trace]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    assert all(c.end == nxt.start for c, nxt in zip(planner.trace, planner.trace[1:]))
    assert planner.trace[-1].end == K and planner.next_boundary is None
    # Experts already resident are never loaded; no layer claims more than its M slots.
    assert (1, 0) not in loaded and len(loaded) == len(set(loaded))
    assert all(len(planner.claimed[layer]) <= M for layer in layers)
    assert sum(c.batch for c in planner.trace) == len(loaded)
    with pytest.raises(ValueError):  # later evidence is discarded: no further boundary
        planner.on_boundary(K, elb.snapshot_plan(capacity), resident, inflight, capacity)


def test_final_cleanup_once_every_layer_slot_is_claimed():
    planner = PrefetchPlanner(PlannerConfig(), 32, MB)  # b_1 = 6
    capacity = {0: 2, 1: 3}
    d = planner.on_boundary(6, {0: [5, 6], 1: [1, 2]}, {0: set(), 1: {2}}, {0: set(), 1: set()}, capacity)
    assert d.phase == "overlap" and d.batch == [(0, 5), (0, 6), (1, 1)]  # layer 1 still has a free slot
    nxt = d.next_boundary
    # The ranking changed: layer 0 is full (5, 6 keep their slots), layer 1 gets one more.
    d = planner.on_boundary(nxt, {0: [7, 5], 1: [3, 1, 2]}, {0: set(), 1: {2}}, {0: {5, 6}, 1: {1}}, capacity)
    assert d.batch == [(1, 3)]
    assert (d.phase, d.next_boundary) == ("final_cleanup", None)
    assert planner.claimed == {0: frozenset({5, 6}), 1: frozenset({1, 2, 3})}


def test_final_cleanup_when_next_boundary_reaches_k():
    cfg = PlannerConfig(bandwidth_init=1e9, draft_step_init=1e-3)
    planner = PrefetchPlanner(cfg, 5, MB)  # b_1 = 1
    d = planner.on_boundary(1, {0: [1, 2, 3]}, {0: set()}, {0: set()}, {0: 8})
    assert (d.next_boundary, d.phase) == (4, "overlap")
    d = planner.on_boundary(4, {0: [1, 2, 3, 4]}, {0: set()}, {0: {1, 2, 3}}, {0: 8})
    assert d.batch == [(0, 4)] and (d.next_boundary, d.phase) == (None, "final_cleanup")


def test_begin_window_resets_claims_and_trace():
    planner = PrefetchPlanner(PlannerConfig(), 16, MB)
    planner.on_boundary(3, {0: [1]}, {0: set()}, {0: set()}, {0: 1})
    assert planner.claimed == {0: frozenset({1})} and planner.next_boundary is None
    assert planner.begin_window(8) == 1
    assert planner.claimed == {} and planner.trace == [Chunk("cold_start", 0, 1, 0)]
    d = planner.on_boundary(1, {0: [2]}, {0: {1}}, {0: set()}, {0: 1})
    assert d.batch == [(0, 2)]


def test_ema_updates_and_their_effect_on_chunks():
    planner = PrefetchPlanner(PlannerConfig(), 16, MB)
    planner.observe_transfer(1_000_000_000, 0.5)  # 2 GB/s sample
    assert planner.bandwidth == pytest.approx(0.75 * 12e9 + 0.25 * 2e9)
    planner.observe_draft_step(3e-3)
    assert planner.draft_step == pytest.approx(0.75 * 1e-3 + 0.25 * 3e-3)
    planner.observe_transfer(0, 1.0)
    planner.observe_draft_step(0.0)  # invalid samples are ignored
    assert planner.bandwidth == pytest.approx(9.5e9) and planner.draft_step == pytest.approx(1.5e-3)
    # 20 experts x 1 MB at 9.5 GB/s = 2.105 ms over 1.5 ms steps -> 2 steps.
    d = planner.on_boundary(3, {0: list(range(20))}, {0: set()}, {0: set()}, {0: 32})
    assert d.next_boundary == 5


@pytest.mark.parametrize(
    "name,K,first,final",
    [("none", 16, None, None), ("early", 16, 1, 1), ("late", 16, 16, 16), ("oracle", 16, 1, 1),
     ("adaptive", 16, 3, None), ("early", 1, 1, 1), ("late", 4, 4, 4)],
)
def test_ablation_policy_boundaries(name, K, first, final):
    planner = make_policy(name, K, MB)
    assert planner.name == name and planner.first_boundary == first
    if first is None:
        assert planner.trace == [Chunk("cold_start", 0, K, 0)]
        with pytest.raises(ValueError):
            planner.on_boundary(1, {0: [1]}, {0: set()}, {0: set()}, {0: 4})
        return
    d = planner.on_boundary(first, {0: [1, 2]}, {0: set()}, {0: set()}, {0: 4})
    assert d.batch == [(0, 1), (0, 2)]
    if final is not None:  # single-plan policies stop after their only boundary
        assert (d.next_boundary, d.phase) == (None, "final_cleanup")
        assert [c.phase for c in planner.trace] == ["cold_start", "final_cleanup"]
        assert planner.trace[-1] == Chunk("final_cleanup", final, K, 2)
    else:
        assert d.phase == "overlap"


def test_make_policy_names():
    assert POLICIES == ("adaptive", "none", "early", "late", "oracle")
    firsts = {n: make_policy(n, 8, MB).begin_window() for n in POLICIES}
    assert firsts == {"adaptive": 1, "none": None, "early": 1, "late": 8, "oracle": 1}
    with pytest.raises(ValueError):
        make_policy("lru", 8, MB)
    with pytest.raises(ValueError):
        PrefetchPlanner(PlannerConfig(), 0, MB)
