"""The offloaded model equals the plain transformers model; offload_ar equals target_only."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY_MODELS, compose
from specter.offload.budget import BudgetError
from specter.assembly.methods import build_method
from specter.models.loading import load_full_model
from specter.models.loading import WeightError, load_offloaded
from specter.moe import MoERuntime, TargetExecutor
from specter.offload.cache import ExpertCache
from specter.offload.link import EmulatedLink
from specter.speculative.sampling import SamplingParams
from specter.speculative.autoregressive import generate_autoregressive

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", TINY_MODELS)
def test_offloaded_logits_equal_hf(name, tiny_checkpoint):
    """Expert-wise: exact (same per-expert matmuls, ascending-id accumulation as HF's eager loop).
    Token-wise: within 1e-5 (single-row matmuls round differently)."""
    ck = tiny_checkpoint(name)
    full = load_full_model(ck, torch.float32, CPU)
    om = load_offloaded(ck, CPU, torch.float32)
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(0))  # [1, T]
    with torch.no_grad():
        ref = full(ids).logits
    E, k = om.num_experts, om.top_k
    for M in sorted({1, max(1, k - 1), k, E // 4, E // 16 or 1}):  # includes M < top-k: rolling
        link = EmulatedLink(bandwidth_bytes_per_s=2e9, latency_s=2e-5)
        cache = ExpertCache(om.store, link, {layer: M for layer in om.moe_layers}, CPU, torch.float32)
        for schedule in ("expert", "token"):
            MoERuntime(TargetExecutor(cache, schedule)).attach(om.experts.values())
            with torch.no_grad():
                out = om.model(ids).logits
            if schedule == "expert":  # same matmul shapes as HF: bit-identical
                torch.testing.assert_close(out, ref, rtol=0, atol=0)
            else:  # one-row matmuls round differently: fp32 noise only
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        c = cache.snapshot_counters()
        assert c["h2d_bytes"] == c["loads"] * om.store.nbytes_per_expert
        link.close()


def test_shared_tensors_stay_on_device_and_experts_in_store(tiny_checkpoint):
    om = load_offloaded(tiny_checkpoint("tiny_dsv2"), CPU, torch.float32)
    names = [n for n, _ in om.model.named_parameters()]
    assert not any(".experts." in n for n in names)  # routed experts are not model parameters
    assert any("shared_experts" in n for n in names) and any("mlp.gate.weight" in n for n in names)
    assert om.model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert om.store.total_bytes == 3 * 64 * om.store.nbytes_per_expert


def test_moe_runtime_switches_only_through_mode_and_restores(tiny_checkpoint):
    """Executors are immutable; `mode` picks the executor and its observers for the block, nested
    modes restore the outer one, and the observers see only their own executor's routes."""
    import dataclasses

    from specter.moe import DraftExecutor, RouteLog

    om = load_offloaded(tiny_checkpoint("tiny_qwen"), CPU, torch.float32)
    link = EmulatedLink(bandwidth_bytes_per_s=2e9, latency_s=2e-5)
    cache = ExpertCache(om.store, link, {layer: 2 for layer in om.moe_layers}, CPU, torch.float32)
    drafted = []
    draft = DraftExecutor({layer: None for layer in om.moe_layers},
                          lambda x, idx, w, experts, act: drafted.append(idx.shape) or torch.zeros_like(x))
    moe = MoERuntime(TargetExecutor(cache), draft).attach(om.experts.values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        moe.target.schedule = "token"  # type: ignore[misc]
    with pytest.raises(ValueError, match="schedule"):
        TargetExecutor(cache, "row")
    with pytest.raises(RuntimeError, match="DraftExecutor"):
        with MoERuntime(TargetExecutor(cache)).mode("draft"):
            pass
    ids = torch.randint(0, 1000, (1, 5), generator=torch.Generator().manual_seed(1))
    log, captured = RouteLog(), []
    with torch.no_grad(), moe.mode("target", route_log=log, capture=lambda layer, x, idx: captured.append(layer)):
        om.model(ids)
        with moe.mode("draft"):
            assert moe.current == "draft"
            om.model(ids)
        assert moe.current == "target"
        om.model(ids)
    assert moe.current == "target"
    assert len(drafted) == len(om.moe_layers)  # the draft ran once, and its routes reached no target observer
    assert captured == list(om.moe_layers) * 2 and set(log.windows[0]) == set(om.moe_layers)
    link.close()


def _broken_copy(src, dst, mutate):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    mutate(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_expert_is_an_error(tiny_checkpoint, tmp_path):
    ck = _broken_copy(tiny_checkpoint("tiny_qwen"), tmp_path / "m",
                      lambda t: t.pop("model.layers.2.mlp.experts.7.up_proj.weight"))
    with pytest.raises(WeightError, match=r"layer 2 expert 7 \(up\)"):
        load_offloaded(ck, CPU, torch.float32)


def test_missing_and_misshaped_non_expert_are_errors(tiny_checkpoint, tmp_path):
    ck = _broken_copy(tiny_checkpoint("tiny_phi"), tmp_path / "a", lambda t: t.pop("model.norm.weight"))
    with pytest.raises(WeightError, match="lacks"):
        load_offloaded(ck, CPU, torch.float32)
    def bad_shape(t):
        t["model.norm.weight"] = torch.ones(7)
    ck = _broken_copy(tiny_checkpoint("tiny_phi"), tmp_path / "b", bad_shape)
    with pytest.raises(WeightError, match="shape"):
        load_offloaded(ck, CPU, torch.float32)


@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("memory", ["high", "low"])
def test_offload_ar_equals_target_only(name, memory, tiny_checkpoint):
    ck = tiny_checkpoint(name)
    prompt = torch.tensor([[11, 200, 37, 5, 801, 64, 9]])
    params = SamplingParams()
    ref = generate_autoregressive(load_full_model(ck, torch.float32, CPU), prompt, 12, params)
    cfg = compose([f"model={name}", f"memory={memory}", "method=offload_ar", "hardware=emulated",
                   "hardware.bandwidth_gbps=1", "hardware.latency_us=10"])
    method = build_method(cfg, ck)
    try:
        gen = method.generate(prompt, 12, torch.Generator().manual_seed(0))
        assert gen.tokens == ref
        assert gen.stats["demand_hits"] + gen.stats["demand_misses"] > 0
        assert 0 < gen.stats["oracle_h2d_bytes"] <= gen.stats["h2d_bytes"]  # LRU never beats perfect knowledge
        method.reset()
        assert method.rt.cache.snapshot_counters()["loads"] == 0
        again = method.generate(prompt, 12, torch.Generator().manual_seed(0))
        assert again.tokens == ref and again.stats == {**again.stats, "h2d_bytes": gen.stats["h2d_bytes"]}
    finally:
        method.close()


def test_budget_too_small_is_refused(tiny_checkpoint):
    cfg = compose(["model=tiny_qwen", "method=offload_ar", "memory.budget_mb=1"])
    with pytest.raises(BudgetError, match="budget"):
        build_method(cfg, tiny_checkpoint("tiny_qwen"))


def test_unknown_link_kind():
    from specter.offload.link import make_link

    with pytest.raises(ValueError, match="unknown"):
        make_link("pcie9")
