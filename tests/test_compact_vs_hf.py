"""The compact decode path against transformers (the reference) on every supported architecture.

A grid of positions per model: a prefill, one-token decode steps, a rollback by length, a
(K+1)-token verification window, a second rollback and decode; logits must match transformers'
no-cache forward at every position, for the tiny models and for configs of other sizes built
with transformers' own config classes (GQA, qkv bias, dense layers, group-limited routing,
YaRN / longrope, sliding window, biased heads). Greedy tokens must equal transformers' decoding.
"""

from __future__ import annotations

import pytest
import torch

from specter.models.compact import StaticKVCache, build_compact, generate_compact, verify_window
from specter.models.compact.moe import experts_of
from specter.models.compact.ops import FusedExperts, GatheredExperts

ATOL = 2e-5  # fp32; observed differences are ~5e-7


def _random_model(config):
    from transformers import AutoModelForCausalLM

    from specter.models.compat import accept_cache_argument

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, experts_implementation="eager").eval()
    with torch.no_grad():  # routers and norms away from their init values, so routing is not degenerate
        for name, p in model.named_parameters():
            if "norm" in name or "gate" in name or "router" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return accept_cache_argument(model)  # the reference decodes with cache= on every transformers version


def other_size_configs():
    from transformers import DeepseekV2Config, PhimoeConfig, Qwen2MoeConfig

    return {
        "qwen_gqa_bias_dense": Qwen2MoeConfig(
            vocab_size=97, hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
            head_dim=16, intermediate_size=80, moe_intermediate_size=48, shared_expert_intermediate_size=64,
            num_experts=7, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1], qkv_bias=True,
            max_position_embeddings=64),
        "dsv2_nolora_grouped_yarn": DeepseekV2Config(
            vocab_size=101, hidden_size=80, num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=96,
            moe_intermediate_size=40, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
            topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.5,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=12, v_head_dim=20, head_dim=8, max_position_embeddings=64,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 0.7,
                             "beta_fast": 32.0, "beta_slow": 1.0}),
        "dsv2_qlora": DeepseekV2Config(
            vocab_size=64, hidden_size=48, num_hidden_layers=2, first_k_dense_replace=0, intermediate_size=64,
            moe_intermediate_size=32, n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=2,
            num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4,
            qk_nope_head_dim=8, v_head_dim=8, head_dim=4, max_position_embeddings=64),
        "phi_window_longrope_bias": PhimoeConfig(
            vocab_size=89, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=48, num_local_experts=5, num_experts_per_tok=2, sliding_window=6, attention_bias=True,
            lm_head_bias=True, router_jitter_noise=0.05, max_position_embeddings=64,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                             "long_factor": [1.5 + 0.1 * i for i in range(8)], "original_max_position_embeddings": 32,
                             "short_mscale": 1.1, "long_mscale": 1.3}),
    }


def check_grid(model, compact, batch: int = 1, length: int = 14) -> None:
    """Prefill 5, decode to 10, roll back to 7, verify a 4-token window, roll back to 9, decode 2."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=g)  # [B, L]
    with torch.inference_mode():
        ref = model(input_ids=ids).logits  # [B, L, V], no cache
    cache = compact.new_cache(capacity=4, batch=batch)  # small: exercises growth
    got = {}
    got.update(zip(range(5), compact.forward(ids[:, :5], cache).unbind(1)))
    for i in range(5, 10):
        got[i] = compact.forward(ids[:, i:i + 1], cache)[:, 0]
    cache.rollback(7)
    got.update(zip(range(7, 11), verify_window(compact, cache, ids[:, 7:11]).unbind(1)))
    cache.crop(-2)  # DynamicCache-style: drop the last two positions
    assert cache.get_seq_length() == 9
    for i in range(9, 11):
        got[i] = compact.forward(ids[:, i:i + 1], cache)[:, 0]
    for pos, logits in sorted(got.items()):
        torch.testing.assert_close(logits, ref[:, pos], atol=ATOL, rtol=1e-4, msg=lambda m: f"position {pos}: {m}")


@pytest.mark.parametrize("name", ["tiny_qwen", "tiny_dsv2", "tiny_phi"])
def test_tiny_configs_match_hf_over_a_grid_of_positions(name):
    from specter.models.tiny import make_config

    model = _random_model(make_config(name))
    check_grid(model, build_compact(model, max_length=8))  # also grows the rope table


@pytest.mark.parametrize("name", list(other_size_configs()))
def test_other_sizes_match_hf(name):
    model = _random_model(other_size_configs()[name])
    check_grid(model, build_compact(model))


@pytest.mark.parametrize("name", ["tiny_qwen", "dsv2_nolora_grouped_yarn", "phi_window_longrope_bias"])
def test_batched_rows_match_hf(name):
    from specter.models.tiny import make_config

    config = make_config(name) if name.startswith("tiny") else other_size_configs()[name]
    model = _random_model(config)
    check_grid(model, build_compact(model), batch=2, length=12)


def test_longrope_switch_matches_one_token_decoding():
    """Past `original_max_position_embeddings` longrope switches to its long factors; transformers
    decides per call, so the reference is its own one-token-at-a-time decoding."""
    from transformers import DynamicCache

    config = other_size_configs()["phi_window_longrope_bias"]
    config.rope_parameters["original_max_position_embeddings"] = 8
    model = _random_model(config)
    ids = torch.randint(0, config.vocab_size, (1, 14), generator=torch.Generator().manual_seed(2))
    compact = build_compact(model)
    cache, hf_cache = compact.new_cache(16), DynamicCache(config=config)
    with torch.inference_mode():
        for i in range(14):
            ref = model(input_ids=ids[:, i:i + 1], cache=hf_cache, use_cache=True).logits[:, 0]
            torch.testing.assert_close(compact.forward(ids[:, i:i + 1], cache)[:, 0], ref, atol=ATOL, rtol=1e-4)


def test_transformers_model_unchanged_by_fusion():
    from specter.models.tiny import make_config

    model = _random_model(make_config("tiny_qwen"))
    ids = torch.arange(9)[None] * 7 % model.config.vocab_size
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        state = {k: v.clone() for k, v in model.state_dict().items()}
        build_compact(model)
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    attn = model.model.layers[0].self_attn  # q/k/v now views of one fused buffer
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.v_proj.weight.untyped_storage().data_ptr()


@pytest.mark.parametrize("name", ["tiny_qwen", "tiny_dsv2", "tiny_phi"])
def test_greedy_tokens_equal_transformers_on_tiny_checkpoints(name, tiny_checkpoint):
    from specter.models.loading import load_full_model
    from specter.speculative.autoregressive import generate_autoregressive
    from specter.speculative.sampling import SamplingParams

    model = load_full_model(tiny_checkpoint(name), torch.float32, torch.device("cpu"))
    prompt = torch.arange(1, 13)[None] * 31 % model.config.vocab_size  # [1, 12]
    ref = generate_autoregressive(model, prompt, 24, SamplingParams())
    compact = build_compact(model, max_length=64)
    assert generate_compact(compact, prompt, 24, lambda logits: int(logits.argmax())) == ref


# ------------------------------------------------------------------------------------ experts
@pytest.mark.parametrize("n", [1, 5])
def test_fused_experts_match_transformers_experts(n):
    from specter.models.tiny import make_config

    model = _random_model(make_config("tiny_dsv2"))
    module = model.model.layers[1].mlp.experts
    E, k = module.gate_up_proj.shape[0], 6
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, module.gate_up_proj.shape[-1], generator=g)  # [N, H]
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])  # [N, k]
    w = torch.rand(n, k, generator=g)
    with torch.inference_mode():
        ref = module(x, idx, w)
        torch.testing.assert_close(FusedExperts(module)(x, idx, w), ref, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(GatheredExperts(module.gate_up_proj, module.down_proj, module.act_fn)(x, idx, w),
                                   ref, atol=1e-5, rtol=1e-4)
        dropped = idx.clone()
        dropped[:, 0] = E  # "no expert" (an expert filter's dropped route) contributes nothing
        keep = torch.ones_like(w)
        keep[:, 0] = 0
        torch.testing.assert_close(FusedExperts(module)(x, dropped, w), module(x, idx, w * keep), atol=1e-5, rtol=1e-4)


def test_specter_experts_module_is_called_unchanged():
    """The offloading / draft experts module is the block's callable as-is (the MoE hook)."""
    from specter.moe import SpecterExperts

    module = SpecterExperts(1, torch.nn.SiLU())
    assert experts_of(module) is module


def test_compact_moe_block_calls_the_blocks_experts_module():
    from specter.models.tiny import make_config

    model = _random_model(make_config("tiny_qwen"))
    calls = []

    class Spy(torch.nn.Module):  # any module with the experts signature, e.g. SpecterExperts
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, idx, w):
            calls.append((tuple(x.shape), tuple(idx.shape)))
            return self.inner(x, idx, w)

    for layer in model.model.layers:
        layer.mlp.experts = Spy(layer.mlp.experts)
    ids = torch.arange(6)[None]
    compact = build_compact(model)
    with torch.inference_mode():
        ref = model(input_ids=ids).logits
    calls.clear()
    out = compact.forward(ids, compact.new_cache(8))
    assert len(calls) == model.config.num_hidden_layers and calls[0] == ((6, 128), (6, 4))
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-4)


# -------------------------------------------------------------------------------------- cache
def test_static_cache_rolls_back_by_length_and_grows():
    cache = StaticKVCache(num_layers=2, batch=1, kv_heads=1, key_dim=2, value_dim=2, capacity=2,
                          device=torch.device("cpu"), dtype=torch.float32)
    k = torch.arange(6.0).view(1, 1, 3, 2)  # [B, H, T, D]
    cache.reserve(3)
    assert cache.capacity >= 3
    for layer in range(2):
        keys, values = cache.write(layer, k, -k)
        assert torch.equal(keys, k) and torch.equal(values, -k)
    cache.advance(3)
    cache.crop(-1)
    assert cache.get_seq_length() == 2
    with pytest.raises(ValueError):
        cache.rollback(5)
    fixed = StaticKVCache(1, 1, 1, 2, 2, capacity=2, device=torch.device("cpu"), dtype=torch.float32, grow=False)
    with pytest.raises(RuntimeError, match="holds 2 positions"):
        fixed.reserve(3)


def test_unsupported_architecture_is_refused():
    from transformers import MixtralConfig

    model = _random_model(MixtralConfig(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, intermediate_size=32, num_local_experts=2))
    with pytest.raises(ValueError, match="no compact decode path"):
        build_compact(model)


def test_sparsemixer_matches_its_reference_and_transformers():
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    from specter.models.compact.moe import PhiMoE
    from specter.models.tiny import make_config

    config = make_config("tiny_phi")
    model = _random_model(config)
    moe = PhiMoE(model.model.layers[0].mlp, config)
    scores = torch.randn(64, config.num_local_experts, generator=torch.Generator().manual_seed(4))
    scores[:8] *= 0.001  # many logits inside the jitter band
    with torch.inference_mode():
        idx, w = moe.route(scores)
        ref_idx, ref_w = moe.route_reference(scores)
        hf_w, hf_idx = sparsemixer(scores, jitter_eps=config.router_jitter_noise, training=False)
    assert torch.equal(idx, ref_idx) and torch.equal(idx, hf_idx)
    torch.testing.assert_close(w, ref_w)
    torch.testing.assert_close(w, hf_w)


# ------------------------------------------------------------------------------------ harness
@pytest.mark.parametrize("model", ["tiny_qwen", "tiny_dsv2", "tiny_phi"])
def test_target_only_compact_path_gives_the_same_tokens(model, tmp_path, tiny_checkpoint):
    import json

    import pandas as pd
    from conftest import FIXTURES, compose

    from specter.experiments.run import run

    tiny_checkpoint(model)
    digests = {}
    for path in ("hf", "compact"):
        out = run(compose([f"model={model}", "method=target_only", f"method.decode_path={path}", "dataset=humaneval",
                           "num_prompts=2", "repeats=1", "max_new_tokens=12", "warmup_tokens=2", "progress=false",
                           f"assets_dir={FIXTURES / 'datasets'}", f"output_dir={tmp_path / path}"]))
        digests[path] = pd.read_csv(out / "records.csv").output_digest.tolist()
        assert path in (out / "env.json").read_text() and json.loads((out / "env.json").read_text())
    assert digests["hf"] == digests["compact"]


def test_unknown_decode_path_is_one_clear_error(tiny_checkpoint):
    from conftest import compose

    from specter.assembly.config import ConfigError
    from specter.assembly.methods import compact_decoder

    cfg = compose(["model=tiny_qwen", "method=target_only", "method.decode_path=fast"])
    with pytest.raises(ConfigError, match="decode_path='fast'"):
        compact_decoder(cfg, None)
