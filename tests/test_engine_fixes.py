"""Regression tests for engine mechanisms that were subtly wrong (each reproduces its defect)."""

from __future__ import annotations

import pytest
import torch

from conftest import compose
from specter.offload import ExpertCache, ExpertUID, ImmediateLink
from specter.predict.planner import PlannerConfig, make_policy
from specter.speculative.engine import acceptance_stats, prefetch_at_boundary
from specter.speculative.sampling import SamplingParams, draft_next, make_generator, next_token

MB = 1 << 20


def test_boundary_makes_the_top_M_plan_resident(filled_store):
    """M=4, residents {0,1,2,3} each routed once by the draft, expert 7 routed five times: the plan is
    [7,0,1,2]; expert 7 must be loaded (over 3, which the plan drops), nothing dropped."""
    store = filled_store(16, layers=[1])
    cache = ExpertCache(store, ImmediateLink(), {1: 4}, "cpu", torch.float32)
    planner = make_policy("adaptive", 8, store.nbytes_per_expert, PlannerConfig(cold_start_frac=0.25))
    first = planner.begin_window(8)
    dropped = prefetch_at_boundary(cache, planner, first, {1: [7, 0, 1, 2]}, {1: 4})
    assert dropped == 0
    assert cache.resident(1) == {7, 0, 1, 2}
    assert cache.pending_prefetches(1) == {7, 0, 1, 2}  # all protected until verification consumes them
    cache.release_prefetches()


def test_a_prefetch_that_finds_no_slot_is_counted(filled_store):
    """When earlier pins fill every slot, a later plan's load is dropped and reported, not silent."""
    store = filled_store(16, layers=[1])
    cache = ExpertCache(store, ImmediateLink(), {1: 2}, "cpu", torch.float32)
    for e in (0, 1):  # something else (an earlier window's use) holds both slots
        cache.prefetch(ExpertUID(1, e))
    planner = make_policy("early", 4, store.nbytes_per_expert)
    planner.begin_window(4)
    assert prefetch_at_boundary(cache, planner, 1, {1: [5, 6]}, {1: 2}) == 2
    assert cache.resident(1) == {0, 1}


def test_acceptance_alpha_is_per_token():
    """Windows of K=4 accepting 4, 1 and 0 drafts: 5 of 12 drafted tokens kept, but only two
    rejections happened, so the per-token acceptance is α = 5 / (5 + 2)."""
    s = acceptance_stats([4, 4, 4], [4, 1, 0])
    assert s["accepted_tokens"] == 5 and s["drafted_tokens"] == 12
    assert s["accepted_fraction"] == pytest.approx(5 / 12)
    assert s["acceptance_alpha"] == pytest.approx(5 / 7)
    assert s["mean_accepted_len"] == pytest.approx((5 + 3) / 3)
    assert acceptance_stats([], [])["acceptance_alpha"] is None


def test_generators_live_on_the_sampling_device():
    g = make_generator("cpu", 3)
    assert g.device.type == "cpu"
    p = SamplingParams(temperature=1.0)
    logits = torch.randn(5, 11)
    a = draft_next(logits, p, make_generator("cpu", 3))[0]
    b = draft_next(logits, p, make_generator("cpu", 3))[0]
    assert torch.equal(a, b)
    assert next_token(logits[0], p, make_generator("cpu", 1)) == next_token(logits[0], p, make_generator("cpu", 1))


def _specter(tiny_checkpoint, *extra):
    from specter.assembly.methods import build_method

    cfg = compose(["model=tiny_qwen", "method=specter", "method.quant=rtn", "memory=low", "K=4",
                   "max_new_tokens=12", "warmup_tokens=0", *extra])
    return build_method(cfg, tiny_checkpoint("tiny_qwen"))


@pytest.mark.parametrize("state", ["warm", "cold", "carry"])
def test_planner_state_between_records(tiny_checkpoint, state):
    method = _specter(tiny_checkpoint, f"method.planner_state={state}")
    try:
        planner = method.engine.planner
        cold = (planner.bandwidth, planner.draft_step)
        planner.bandwidth, planner.draft_step = 1e9, 5e-3
        method.warmed()  # snapshot after warm-up
        planner.bandwidth, planner.draft_step = 2e9, 7e-3  # what a record learned
        method.reset()
        expected = {"warm": (1e9, 5e-3), "cold": cold, "carry": (2e9, 7e-3)}[state]
        assert (planner.bandwidth, planner.draft_step) == expected
    finally:
        method.close()


def test_prefetch_precision_counts_only_the_planners_predictions(tiny_checkpoint):
    """Every window the plan names exactly one expert per layer (expert 0, a resident the draft may
    route to among others): `predicted` counts exactly those, never the other residents."""
    method = _specter(tiny_checkpoint, "method.prefetch=early")
    try:
        engine = method.engine
        engine.elb.snapshot_plan = lambda capacity: {layer: [0] for layer in capacity}
        engine.generate(torch.tensor([[5, 6, 7, 8]]), 12, None)
        windows = len(engine.trace.drafted)
        assert windows > 0
        assert engine.trace.predicted == windows * len(engine.layers)
        assert engine.trace.predicted_hits <= engine.trace.predicted
    finally:
        method.close()


def test_lossless_check_reports_ties_and_violations(tiny_checkpoint, monkeypatch):
    """A flipped token is a violation unless the target's logit margin is within the tie tolerance."""
    from specter.assembly.methods import LosslessViolation

    for tolerance, expect_tie in ((0.0, False), (1e9, True)):
        method = _specter(tiny_checkpoint, "verify_lossless=true", f"lossless_tie_tolerance={tolerance}")
        try:
            real = method.engine.generate

            def flipped(*args, **kwargs):
                tokens, stats = real(*args, **kwargs)
                tokens = list(tokens)
                tokens[3] = (tokens[3] + 1) % 1024  # a different token at position 3
                return tokens, stats

            monkeypatch.setattr(method.engine, "generate", flipped)
            prompt = torch.tensor([[5, 6, 7, 8]])
            if expect_tie:
                gen = method.generate(prompt, 12, None)
                assert gen.stats["lossless_check"].startswith("tie@3")
            else:
                with pytest.raises(LosslessViolation, match="at token 3"):
                    method.generate(prompt, 12, None)
        finally:
            method.close()


def test_exact_greedy_records_say_so(tiny_checkpoint):
    method = _specter(tiny_checkpoint, "verify_lossless=true")
    try:
        assert method.generate(torch.tensor([[5, 6, 7, 8]]), 12, None).stats["lossless_check"] == "exact"
    finally:
        method.close()


def test_plan_capacity_shares_staging_buffers_earliest_layers_first():
    from specter.speculative.engine import plan_capacity

    assert plan_capacity({1: 4, 2: 4, 3: 4}, 0) == {1: 4, 2: 4, 3: 4}
    assert plan_capacity({1: 4, 2: 4, 3: 4}, 5) == {1: 6, 2: 6, 3: 5}


def test_boundary_plans_beyond_M_into_staging_buffers(filled_store):
    """With S staging buffers a plan longer than M is loaded whole: the extra experts borrow buffers."""
    store = filled_store(16, layers=[1])
    cache = ExpertCache(store, ImmediateLink(), {1: 2}, "cpu", torch.float32, staging=2)
    planner = make_policy("early", 4, store.nbytes_per_expert)
    planner.begin_window(4)
    assert prefetch_at_boundary(cache, planner, 1, {1: [9, 8, 7, 6]}, {1: 4}) == 0
    assert {9, 8, 7, 6} <= cache.resident(1)
    assert cache.counters.staged_loads == 2
    cache.release_prefetches()
