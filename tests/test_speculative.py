"""Specter's speculative engine: greedy output equals target-only decoding; KV state; shared instance."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_MODELS, compose
from specter.speculative.autoregressive import generate_autoregressive
from specter.assembly.methods import LosslessViolation, build_method
from specter.models.loading import load_full_model
from specter.speculative.engine import SpeculativeEngine
from specter.speculative.sampling import SamplingParams
from specter.speculative.state import SequenceKV

CPU = torch.device("cpu")
GREEDY = SamplingParams()
KS = (1, 2, 4, 8, 16, 32)


def _method(name, memory, *extra):
    return compose([f"model={name}", f"memory={memory}", "method=specter", "method.quant=rtn", "hardware=emulated",
                    "hardware.bandwidth_gbps=2", "hardware.latency_us=5", *extra])


@pytest.fixture(scope="module")
def references():
    """Greedy target-only continuations from the plain transformers model, per (model, prompt)."""
    cache = {}

    def get(name, ck, prompt, n):
        key = (name, tuple(prompt[0].tolist()), n)
        if key not in cache:
            cache[key] = generate_autoregressive(load_full_model(ck, torch.float32, CPU), prompt, n, GREEDY)
        return cache[key]

    return get


@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("memory", ["high", "low"])
def test_greedy_specter_equals_target_only(name, memory, tiny_checkpoint, references):
    ck = tiny_checkpoint(name)
    method = build_method(_method(name, memory), ck)
    g = torch.Generator().manual_seed(len(name))
    try:
        for i, K in enumerate(KS):
            prompt_len = [1, 16, 5, 9, 3, 12][i]  # prompts of length 1..16
            prompt = torch.randint(2, 1000, (1, prompt_len), generator=g)
            ref = references(name, ck, prompt, 24)
            method.engine = SpeculativeEngine(method.rt, K, GREEDY, prefetch="adaptive")
            method.reset()
            gen = method.generate(prompt, 24, torch.Generator().manual_seed(0))
            assert gen.tokens == ref, f"K={K} prompt_len={prompt_len}"
            assert gen.stats["drafted_tokens"] > 0 and 0 <= gen.stats["accepted_fraction"] <= 1
            assert gen.clock.num_tokens == 24
    finally:
        method.close()


def test_lossless_check_can_fail(tiny_checkpoint, monkeypatch):
    """A broken verification (accept every draft token) is caught by verify_lossless."""
    import specter.speculative.engine as engine

    method = build_method(_method("tiny_phi", "high", "verify_lossless=true", "K=4"), tiny_checkpoint("tiny_phi"))
    try:
        prompt = torch.tensor([[17, 300, 45, 8]])
        method.generate(prompt, 16, torch.Generator().manual_seed(0))  # correct engine passes
        monkeypatch.setattr(engine, "greedy_verify_batch",  # accept every draft, bonus = the last draft
                            lambda d, p, limits: (limits.tolist(), d[:, -1].tolist()))
        method.reset()
        with pytest.raises(LosslessViolation, match="differs"):
            method.generate(prompt, 16, torch.Generator().manual_seed(0))
    finally:
        method.close()


@pytest.mark.parametrize("name", TINY_MODELS)
def test_committed_kv_equals_target_alone(name, tiny_checkpoint):
    """After any accept pattern (with draft scratch discarded), the committed cache equals the cache
    of the target run alone on the committed sequence."""
    model = load_full_model(tiny_checkpoint(name), torch.float32, CPU)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, 1000, (1, 6), generator=g)
    rows = SequenceKV(model)
    with torch.inference_mode():
        ids, _ = rows.prefill_inputs([prompt], pad_id=0)
        rows.run(ids)
        tokens = [int(torch.randint(2, 1000, (1,), generator=g))]  # committed; the last one is uncached
        for K, a in [(4, 0), (4, 4), (3, 1), (8, 5), (1, 0), (2, 2)]:
            last = torch.tensor([[tokens[-1]]])
            scratch = torch.randint(2, 1000, (1, K - 1), generator=g)
            rows.run(torch.cat([last, scratch], 1))  # draft scratch extension
            rows.discard_pending()
            drafts = torch.randint(2, 1000, (K,), generator=g)
            rows.run(torch.cat([last[0], drafts])[None])  # verification: K+1
            rows.commit([1 + a])
            tokens += drafts[:a].tolist() + [int(torch.randint(2, 1000, (1,), generator=g))]
            committed = torch.cat([prompt[0], torch.tensor(tokens[:-1])])[None]  # all but the uncached
            fresh = SequenceKV(model)
            ids, _ = fresh.prefill_inputs([committed], pad_id=0)
            fresh.run(ids)
            assert rows.cache.get_seq_length() == committed.shape[1] == rows.committed and rows.pending == 0
            for mine, ref in zip(rows.cache.layers, fresh.cache.layers):
                torch.testing.assert_close(mine.keys, ref.keys, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(mine.values, ref.values, rtol=1e-4, atol=1e-5)


def test_shared_instance_and_draft_memory(tiny_checkpoint):
    """Draft and target run through the same tensor objects; only routed experts differ. The INT4
    draft's resident bytes equal what the packing predicts."""
    method = build_method(_method("tiny_dsv2", "high", "K=4"), tiny_checkpoint("tiny_dsv2"))
    try:
        model = method.rt.model
        seen: dict[str, list[int]] = {"draft": [], "target": []}

        def hook(module, args, out):
            seen[method.rt.moe.current].append(id(module))

        shared = [model.model.embed_tokens, model.model.layers[1].self_attn, model.model.layers[1].mlp.gate,
                  model.model.layers[1].mlp.shared_experts, model.model.norm, model.lm_head]
        handles = [m.register_forward_hook(hook) for m in shared]
        method.generate(torch.tensor([[5, 6, 7]]), 8, torch.Generator().manual_seed(0))
        for h in handles:
            h.remove()
        assert sorted(set(seen["draft"])) == sorted(set(seen["target"])) == sorted(id(m) for m in shared)
        # no FP copy of any routed expert among the model's tensors
        assert not any(".experts." in n for n, _ in model.named_parameters())
        cfg = model.config
        E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        for layer, d in method.draft.items():
            measured = sum(t.numel() * t.element_size() for t in
                           (d.prepared.gate_up, d.prepared.down, d.prepared.gate_up_sz, d.prepared.down_sz))
            nibbles = E * (2 * I * H + H * I) // 2  # 4 bits per weight
            scales = E * (2 * I * (H // 128) + H * (I // 128)) * 2 * 4  # (scale, zero) fp32 per group
            assert measured == d.nbytes == nibbles + scales
        assert method.rt.footprint.draft_experts == sum(d.nbytes for d in method.draft.values())
    finally:
        method.close()


def test_k_below_one_is_rejected(tiny_checkpoint):
    method = build_method(_method("tiny_qwen", "high", "K=2"), tiny_checkpoint("tiny_qwen"))
    try:
        with pytest.raises(ValueError, match="K must be"):
            SpeculativeEngine(method.rt, 0, GREEDY)
    finally:
        method.close()


def test_the_engine_keeps_few_attributes_of_its_own(tiny_checkpoint):
    """At most 14 instance attributes, the batch loop's included: settings travel as one frozen value,
    what the runtime already knows is read from it."""
    import dataclasses

    method = build_method(_method("tiny_qwen", "low", "K=3"), tiny_checkpoint("tiny_qwen"))
    try:
        engine = method.engine
        assert len(vars(engine)) <= 14, sorted(vars(engine))
        assert (engine.K, engine.params, engine.max_holes) == (3, method.params, 0)
        assert engine.device == next(method.rt.model.parameters()).device and engine.planner is engine.memory.planner
        with pytest.raises(dataclasses.FrozenInstanceError):
            engine.settings.K = 4
        served = method.make_engine(SamplingParams(temperature=0.7))
        assert served.params.temperature == 0.7 and served.K == 3  # a served request's sampling, the spec's rest
    finally:
        method.close()


def test_stochastic_specter_runs_and_is_seeded(tiny_checkpoint):
    """temperature > 0: speculative sampling path (min(1, p/q) acceptance, residual resampling)."""
    method = build_method(_method("tiny_phi", "low", "K=4", "temperature=0.9", "top_p=0.95"), tiny_checkpoint("tiny_phi"))
    try:
        prompt = torch.tensor([[9, 8, 7, 6]])
        a = method.generate(prompt, 20, torch.Generator().manual_seed(3))
        method.reset()
        b = method.generate(prompt, 20, torch.Generator().manual_seed(3))
        assert len(a.tokens) == 20 and a.tokens == b.tokens  # per-record seeds reproduce the record
        assert 0 <= a.stats["accepted_fraction"] <= 1
    finally:
        method.close()
