"""The static one-token step (specter.models.compact.static) against the compact decoder's own step.

`StaticStep` is the form torch.compile traces: the position as a tensor, attention over the
whole buffer under a mask, experts as indexed reductions. Eager, it is the slow reference of the
compiled step; the compact decoder's dynamic-shape step is the reference of both. Checked over
a grid of positions on the three tiny architectures and on configs of other sizes (GQA, no
q-LoRA, group-limited routing, YaRN, longrope, a sliding window shorter than the sequence),
then the compiled step on each architecture, its graph called directly against the same graph
called through dynamo, then through the harness (`decode_path=compiled`).
"""

from __future__ import annotations

import pytest
import torch
from conftest import compose
from test_compact_vs_hf import _random_model, other_size_configs

from specter.assembly.config import ConfigError
from specter.assembly.methods import build_method
from specter.models.compact import build_compact
from specter.models.compact.direct import DirectCall
from specter.models.compact.ops import FusedExperts, GatheredExperts
from specter.models.compact.static import (CAPACITY_QUANTUM, StaticStep, static_capacity, static_problem,
                                           use_static_step)

ATOL = 2e-5  # fp32


def _config(name: str):
    from specter.models.tiny import make_config

    return make_config(name) if name.startswith("tiny") else other_size_configs()[name]


def _steps_agree(config, compile: bool, steps: int = 12, prefix: int = 5) -> None:
    """Prefill `prefix`, then `steps` one-token steps on both paths; logits and KV must agree."""
    model = _random_model(config)
    ref, static = build_compact(model, max_length=8), build_compact(model, max_length=8)
    use_static_step(static, compile=compile)
    ids = torch.randint(0, config.vocab_size, (1, prefix + steps), generator=torch.Generator().manual_seed(4))
    ref_cache, static_cache = ref.new_cache(4), static.new_cache(4)  # the reference grows; the static one is rounded
    assert static_cache.capacity == CAPACITY_QUANTUM
    with torch.inference_mode():
        torch.testing.assert_close(static.forward(ids[:, :prefix], static_cache),
                                   ref.forward(ids[:, :prefix], ref_cache), atol=ATOL, rtol=1e-4)
        for i in range(prefix, prefix + steps):
            got = static.forward(ids[:, i:i + 1], static_cache)  # through the static step
            want = ref.forward(ids[:, i:i + 1], ref_cache)
            torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4, msg=lambda m: f"position {i}: {m}")
        static_cache.rollback(prefix + 2)  # a rollback by length, then overwrite a position
        ref_cache.rollback(prefix + 2)
        torch.testing.assert_close(static.forward(ids[:, 3:4], static_cache), ref.forward(ids[:, 3:4], ref_cache),
                                   atol=ATOL, rtol=1e-4)
    n = ref_cache.length
    for a, b in zip(static_cache.keys + static_cache.values, ref_cache.keys + ref_cache.values):
        torch.testing.assert_close(a[:, :, :n], b[:, :, :n], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("name", ["tiny_qwen", "tiny_dsv2", "tiny_phi", *other_size_configs()])
def test_eager_static_step_matches_the_compact_step(name):
    _steps_agree(_config(name), compile=False)


@pytest.mark.parametrize("name", ["tiny_qwen", "tiny_dsv2", "phi_window_longrope_bias"])
def test_compiled_static_step_matches_the_compact_step(name):
    _steps_agree(_config(name), compile=True, steps=6)


@pytest.mark.parametrize("n,k,E", [(1, 1, 3), (1, 6, 64), (3, 2, 5), (4, 4, 60)])
def test_gathered_experts_match_fused_experts(n, k, E):
    g = torch.Generator().manual_seed(n * 100 + k)
    H, inter = 24, 16
    gate_up, down = torch.randn(E, 2 * inter, H, generator=g), torch.randn(E, H, inter, generator=g)

    class Module:  # the fused experts layout transformers uses
        gate_up_proj, down_proj, act_fn = gate_up, down, torch.nn.SiLU()

    fused = FusedExperts(Module())
    x = torch.randn(n, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])  # [N, k]
    w = torch.rand(n, k, generator=g)
    idx[0, 0] = E  # a dropped route contributes nothing on both
    torch.testing.assert_close(GatheredExperts.of(fused)(x, idx, w), fused(x, idx, w), atol=1e-5, rtol=1e-4)


def test_static_caches_are_owned_by_the_step_and_rounded():
    model = _random_model(_config("tiny_qwen"))
    compact = use_static_step(build_compact(model), compile=False)
    a = compact.new_cache(10)
    a.length = 5
    b = compact.new_cache(CAPACITY_QUANTUM)
    assert b is a and b.length == 0 and b.capacity == CAPACITY_QUANTUM  # the same buffers, reset
    assert compact.new_cache(CAPACITY_QUANTUM + 1).capacity == 2 * CAPACITY_QUANTUM
    assert static_capacity(1) == CAPACITY_QUANTUM
    with pytest.raises(ValueError, match="batch 1"):
        compact.new_cache(8, batch=2)


def test_a_full_static_cache_grows_and_keeps_its_positions():
    """Decoding past the rounded capacity doubles the buffers (one retrace when compiled)."""
    config = _config("tiny_phi")
    model = _random_model(config)
    ref, static = build_compact(model), use_static_step(build_compact(model), compile=False)
    static.static.caches.clear()
    ids = torch.randint(0, config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(5))
    ref_cache, cache = ref.new_cache(CAPACITY_QUANTUM + 8), static.new_cache(4)
    with torch.inference_mode():
        static.forward(ids, cache)
        ref.forward(ids, ref_cache)
        cache.length = ref_cache.length = CAPACITY_QUANTUM  # stale positions are equal zeros on both
        for i in range(3):
            torch.testing.assert_close(static.forward(ids[:, i:i + 1], cache), ref.forward(ids[:, i:i + 1], ref_cache),
                                       atol=ATOL, rtol=1e-4)
    assert cache.capacity == 2 * CAPACITY_QUANTUM


def test_offloading_experts_have_no_static_step():
    from specter.moe import SpecterExperts

    model = _random_model(_config("tiny_qwen"))
    compact = build_compact(model)
    compact.layers[0].mlp.experts = SpecterExperts(0, torch.nn.SiLU())
    assert "SpecterExperts" in static_problem(compact)
    with pytest.raises(ValueError, match="target_only"):
        StaticStep(compact)


def test_target_only_compiled_decodes_target_only_tokens(tiny_checkpoint):
    prompt = torch.tensor([[17, 300, 45, 8, 512, 9, 77]])
    tokens = {}
    for path in ("hf", "compiled"):
        cfg = compose(["model=tiny_dsv2", "method=target_only", "max_new_tokens=12", f"method.decode_path={path}"])
        m = build_method(cfg, tiny_checkpoint("tiny_dsv2"))
        tokens[path] = m.generate(prompt, 12, torch.Generator().manual_seed(0)).tokens
        assert m.static_fields()["decode_path"] == path
    assert tokens["compiled"] == tokens["hf"]


def test_offloading_methods_refuse_the_compiled_path(tiny_checkpoint):
    cfg = compose(["model=tiny_qwen", "method=offload_ar", "hardware=emulated", "hardware.bandwidth_gbps=2",
                   "hardware.latency_us=5", "method.decode_path=compiled"])
    with pytest.raises(ConfigError, match="decode_path=compact"):
        build_method(cfg, tiny_checkpoint("tiny_qwen"))


def test_two_compiled_steps_of_the_same_shapes_keep_their_own_constants():
    """Every StaticStep shares `step`'s code object and dynamo's guards on the instance are dropped;
    the per-instance tag must still keep one model's trace (its routing constants baked in) from
    serving another model of the same shapes."""
    import copy

    first = _config("tiny_qwen")
    second = copy.deepcopy(first)
    second.norm_topk_prob = not first.norm_topk_prob  # same tensors' shapes, another routing constant
    second.num_experts_per_tok = first.num_experts_per_tok - 1
    _steps_agree(first, compile=True, steps=3)
    _steps_agree(second, compile=True, steps=3)


def _decode(step: StaticStep, ids: torch.Tensor, capacity: int) -> list[torch.Tensor]:
    cache = step.cache(capacity)
    return [step(ids[:, i:i + 1], cache).clone() for i in range(ids.shape[1])]


@pytest.mark.parametrize("name", ["tiny_qwen", "tiny_dsv2", "phi_window_longrope_bias"])
def test_direct_graph_calls_match_dynamo_calls(name):
    """On a CPU the compiled step calls its graphs directly once dynamo has run them (direct.py):
    the logits are dynamo's, bit for bit, on both traces (position 0, and the dynamic span)."""
    config = _config(name)
    step = use_static_step(build_compact(_random_model(config)), compile=True).static
    ids = torch.randint(0, config.vocab_size, (1, 14), generator=torch.Generator().manual_seed(3))
    direct = _decode(step, ids, 8)
    assert {type(c) for c in step.calls.values()} == {DirectCall}  # both traces are called directly
    assert set(step.calls) == {(CAPACITY_QUANTUM, True), (CAPACITY_QUANTUM, False)}
    step.direct_calls = False  # the same graphs, every call through dynamo
    for i, (a, b) in enumerate(zip(direct, _decode(step, ids, 8))):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"position {i}")


def test_direct_calls_follow_a_grown_cache():
    """Past the rounded capacity the buffers double: a new trace, learned again, at the same
    positions' logits as dynamo's."""
    config = _config("tiny_qwen")
    step = use_static_step(build_compact(_random_model(config)), compile=True).static
    n = CAPACITY_QUANTUM + 3
    ids = torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(4))
    direct = _decode(step, ids, 4)
    assert isinstance(step.calls[(2 * CAPACITY_QUANTUM, False)], DirectCall)
    step.direct_calls = False
    dynamo = _decode(step, ids, 4)
    for i in (0, 1, CAPACITY_QUANTUM - 1, CAPACITY_QUANTUM, n - 1):
        torch.testing.assert_close(direct[i], dynamo[i], rtol=0, atol=0, msg=f"position {i}")


def test_direct_call_maps_arguments_by_identity_and_refuses_what_it_cannot_place():
    token, pos, span = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.arange(3)
    keys, values, weight = [torch.zeros(2)], [torch.ones(2)], torch.full((2,), 5.0)
    args = (token, pos, span, keys, values)
    seen_inputs = []

    def graph(*inputs):
        seen_inputs[:] = inputs
        return (inputs[0] + inputs[1],)

    every = (token, pos, span, keys[0])  # the arguments but values[0], which each case places first

    def learn(*inputs, dynamic_length=True):
        return DirectCall.learn([graph, (values[0], *inputs, *every)], args, dynamic_length=dynamic_length)

    call = learn(weight, 3)
    new_span, new_values = torch.arange(7), [torch.full((2,), 2.0)]
    torch.testing.assert_close(call(token, pos, new_span, keys, new_values), torch.full((2,), 7.0))
    assert seen_inputs[0] is new_values[0] and seen_inputs[1] is weight and seen_inputs[5] is new_span
    assert seen_inputs[2] == 7  # the span's length, now
    assert learn(weight, 4) is None  # an int that is not the span's length
    assert learn(weight, 3, 3) is None  # two sizes
    assert learn(weight, "x", dynamic_length=False) is None
    assert learn(weight) is None  # no length input: specialised to this length
    assert learn(weight, dynamic_length=False) is not None
    assert DirectCall.learn([], args, dynamic_length=False) is None  # nothing ran
    stale = (torch.zeros(2), weight, 3, *every)  # another call's graph: values[0] never reached it
    assert DirectCall.learn([graph, stale], args, dynamic_length=True) is None
