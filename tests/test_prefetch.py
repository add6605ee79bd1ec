"""Predictive I/O in the engine: every prefetch policy keeps greedy output exact; I/O never beats
the oracle; prefetched experts are protected until verification consumes them."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_MODELS, compose
from specter.speculative.autoregressive import generate_autoregressive
from specter.assembly.methods import build_method
from specter.models.loading import load_full_model
from specter.speculative.sampling import SamplingParams

POLICIES = ("adaptive", "none", "early", "late", "oracle")


@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("memory", ["high", "low"])
def test_every_policy_keeps_greedy_output(name, memory, tiny_checkpoint):
    ck = tiny_checkpoint(name)
    prompt = torch.tensor([[40, 7, 912, 3, 55, 18]])
    ref = generate_autoregressive(load_full_model(ck, torch.float32, torch.device("cpu")), prompt, 20, SamplingParams())
    for policy in POLICIES:
        cfg = compose([f"model={name}", f"memory={memory}", "method=specter", "method.quant=rtn", f"method.prefetch={policy}", "K=6",
                       "hardware=emulated", "hardware.bandwidth_gbps=0.2", "hardware.latency_us=20"])
        method = build_method(cfg, ck)
        try:
            gen = method.generate(prompt, 20, torch.Generator().manual_seed(0))
            s = gen.stats
            assert gen.tokens == ref, policy
            assert s["oracle_h2d_bytes"] <= s["h2d_bytes"], policy  # no real policy beats perfect knowledge
            if policy == "none":
                assert s["prefetch_recall"] is None and method.rt.cache.snapshot_counters()["prefetch_loads"] == 0
            else:
                assert 0 <= s["prefetch_recall"] <= 1 and 0 <= s["prefetch_precision"] <= 1
            # after the run no slot stays protected by a stale prefetch
            assert all(method.rt.cache.protected_count(layer) == 0 for layer in method.rt.om.moe_layers)
        finally:
            method.close()


def test_adaptive_planner_walks_its_phases(tiny_checkpoint):
    cfg = compose(["model=tiny_dsv2", "memory=low", "method=specter", "method.quant=rtn", "K=16", "hardware=emulated",
                   "hardware.bandwidth_gbps=0.05", "hardware.latency_us=50"])
    method = build_method(cfg, tiny_checkpoint("tiny_dsv2"))
    try:
        engine = method.engine
        method.generate(torch.tensor([[3, 99, 410, 77]]), 40, torch.Generator().manual_seed(0))
        phases: list[list[str]] = []  # per drafted window, the planner's chunks: each window opens with its cold start
        for phase, *_ in engine.trace.phases:
            if phase == "cold_start":
                phases.append([])
            phases[-1].append(phase)
        assert len(phases) == len(engine.trace.drafted)  # one group per drafted window
        full = [p for p in phases if len(p) > 1]
        assert full, "no window reached a planner boundary"
        for p in full:
            assert p[0] == "cold_start" and p[-1] == "final_cleanup"
            assert set(p[1:-1]) <= {"overlap"}
        assert method.rt.cache.snapshot_counters()["prefetch_loads"] > 0
    finally:
        method.close()


def test_prefetched_expert_survives_until_consumed(tiny_checkpoint):
    """Prefetch every slot of a layer, then demand other experts: the prefetched ones are never
    overwritten before verification has used them (misses wait or roll instead). No staging
    buffers here: with them a miss borrows one instead of waiting (tests/test_baselines.py)."""
    from specter.offload.store import ExpertUID

    cfg = compose(["model=tiny_qwen", "memory=low", "method=offload_ar", "hardware=cpu", "method.staging_buffers=0"])
    method = build_method(cfg, tiny_checkpoint("tiny_qwen"))
    try:
        cache, layer = method.rt.cache, method.rt.om.moe_layers[0]
        M = cache.capacity(layer)
        wanted = list(range(20, 20 + M))
        for e in wanted:
            assert cache.prefetch(ExpertUID(layer, e)) is not None
        assert cache.acquire(ExpertUID(layer, 59)) is None  # every slot protected by a prefetch
        assert cache.resident(layer) == set(wanted)
        for e in wanted:  # verification consumes them, bytes intact
            h = cache.acquire(ExpertUID(layer, e))
            cache.wait(h)
            gate_up, _ = cache.views(h)
            torch.testing.assert_close(gate_up, method.rt.om.store.views(ExpertUID(layer, e))[0], rtol=0, atol=0)
            cache.release(h)
        assert cache.acquire(ExpertUID(layer, 59)) is not None
    finally:
        method.close()
