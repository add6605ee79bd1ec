"""The engines on checkpoints the tiny models are not: other sizes, switches flipped, any tokenizer.

Each checkpoint is built here with transformers' own config class at tiny widths and saved as a
user's checkpoint would be. transformers' `generate` and llama.cpp over the GGUF export must give
target-only's greedy tokens, or record why they cannot ("not comparable", with the reason):

    DeepSeek-V2, q_lora_rank null at 3 layers (DeepSeek-V2-Lite's attention; llama.cpp guesses "lite"
                 only at 26/27 layers), norm_topk_prob true (which transformers' DeepSeek-V2 ignores, so
                 the export must not ask llama.cpp to renormalise)
    DeepSeek-V2, q_lora_rank null at 4 layers, YaRN rope with mscale (DeepSeek-V2-Lite's rope, other depth)
    DeepSeek-V2, q_lora_rank set, 5 layers, no rope scaling, routed_scaling_factor 2
    Qwen2-MoE,   norm_topk_prob false, other widths, YaRN rope
    Qwen2-MoE,   norm_topk_prob true: llama.cpp's qwen2moe never renormalises, so the run says
                 "not comparable" (and its tokens are the unnormalised model's, which shows why)
    PhiMoE       exported under the name `phi35moe` (llama.cpp special-cases "phi3" names in its
                 vocabulary loader): loads, says "not comparable" (softmax top-2, not sparsemixer)
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from conftest import compose

from specter.assembly.methods import build_method
from specter.speculative.autoregressive import generate_autoregressive
from specter.speculative.sampling import SamplingParams, make_generator

HAS_GGUF = importlib.util.find_spec("gguf") is not None
HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
needs_gguf = pytest.mark.skipif(not HAS_GGUF, reason='needs the gguf package: pip install -e ".[llamacpp]"')
needs_llamacpp = pytest.mark.skipif(not HAS_LLAMA_CPP, reason='needs llama-cpp-python: pip install -e ".[llamacpp]"')
PROMPT = [3, 17, 99, 200, 45, 7, 120, 12]
N_TOKENS = 24
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32.0, "beta_slow": 1.0}
_DSV2 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=2,
             num_key_value_heads=2, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
             head_dim=32, topk_method="greedy", first_k_dense_replace=1, rms_norm_eps=1e-6,
             tie_word_embeddings=False)
_QWEN = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             shared_expert_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, decoder_sparse_step=1,
             rms_norm_eps=1e-6, tie_word_embeddings=False)
CHECKPOINTS = {  # name -> (model_type, config kwargs)
    "dsv2_no_q_lora": ("deepseek_v2", dict(_DSV2, num_hidden_layers=3, q_lora_rank=None, n_routed_experts=12,
                                           num_experts_per_tok=3, n_shared_experts=1, norm_topk_prob=True,
                                           routed_scaling_factor=1.0, max_position_embeddings=512)),
    "dsv2_q_lora": ("deepseek_v2", dict(_DSV2, num_hidden_layers=5, q_lora_rank=48, n_routed_experts=8,
                                        num_experts_per_tok=2, n_shared_experts=2, norm_topk_prob=False,
                                        routed_scaling_factor=2.0, max_position_embeddings=512)),
    "dsv2_yarn": ("deepseek_v2", dict(_DSV2, num_hidden_layers=4, q_lora_rank=None, n_routed_experts=6,
                                      num_experts_per_tok=2, n_shared_experts=1, norm_topk_prob=False,
                                      routed_scaling_factor=1.0, max_position_embeddings=5120,
                                      rope_parameters={**YARN, "factor": 40.0, "mscale": 0.707,
                                                       "mscale_all_dim": 0.707})),
    "qwen_yarn": ("qwen2_moe", dict(_QWEN, num_hidden_layers=3, num_experts=6, num_experts_per_tok=3,
                                    norm_topk_prob=False, max_position_embeddings=512, rope_parameters=YARN)),
    "qwen_norm_topk": ("qwen2_moe", dict(_QWEN, num_hidden_layers=2, num_experts=10, num_experts_per_tok=2,
                                         norm_topk_prob=True, max_position_embeddings=512)),
}


def build_checkpoint(folder: Path, model_type: str, tokenizer_from: Path | None = None, **kwargs) -> Path:
    """A random checkpoint of `model_type` saved with transformers (sharpened so greedy text varies)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # sharper logits than the init's, so greedy output is not one token repeated
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    model.save_pretrained(folder)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_from / name).exists():
                shutil.copy(tokenizer_from / name, folder / name)
    return folder


def reference_tokens(checkpoint: Path, **config_changes) -> list[int]:
    """Greedy target-only tokens of PROMPT (optionally with config switches changed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    for key, value in config_changes.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, config=config, dtype=torch.float32).eval()
    return generate_autoregressive(model, torch.tensor([PROMPT]), N_TOKENS, SamplingParams())


def engine_tokens(method: str, model: str, checkpoint: Path) -> tuple[list[int], dict, dict]:
    cfg = compose([f"method={method}", f"model={model}", "hardware=cpu", "method.reference_check=false",
                   "hardware.threads=1"])
    runner = build_method(cfg, checkpoint)
    try:
        gen = runner.generate(torch.tensor([PROMPT]), N_TOKENS, make_generator(torch.device("cpu"), 0))
        return gen.tokens, gen.stats, runner.environment()
    finally:
        runner.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("user_checkpoints")
    built = {name: build_checkpoint(root / name, mt, **kw) for name, (mt, kw) in CHECKPOINTS.items()}
    return built


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTER_HOME", str(tmp_path / "home"))  # exports go to this test's cache
    return tmp_path / "home"


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_transformers_engine_equals_target_only(name, checkpoints):
    tokens, _, _ = engine_tokens("transformers", "tiny_qwen", checkpoints[name])
    assert tokens == reference_tokens(checkpoints[name])


@needs_gguf
def test_export_writes_q_lora_rank_zero_when_the_checkpoint_has_none(checkpoints, tmp_path):
    import gguf

    from baselines.gguf_export import export_gguf

    reader = gguf.GGUFReader(str(export_gguf(checkpoints["dsv2_no_q_lora"], tmp_path / "m.gguf")))
    field = reader.get_field("deepseek2.attention.q_lora_rank")
    assert field is not None and int(field.contents()) == 0  # llama.cpp requires the key below 26 layers
    names = {t.name for t in reader.tensors}
    assert "blk.0.attn_q.weight" in names and "blk.0.attn_q_a.weight" not in names


@needs_gguf
def test_export_name_comes_from_the_checkpoint_not_the_run_config(checkpoints, home):
    import gguf

    from baselines.gguf_export import cached_gguf

    path = cached_gguf(checkpoints["qwen_yarn"], "f32", label="phi35moe")
    name = gguf.GGUFReader(str(path)).get_field("general.name").contents()
    assert name == "qwen2_moe-6x3-3l" and "phi" not in name


@pytest.mark.llamacpp
@needs_llamacpp
@pytest.mark.parametrize("name", ["dsv2_no_q_lora", "dsv2_q_lora", "dsv2_yarn", "qwen_yarn"])
def test_llamacpp_equals_target_only(name, checkpoints, home):
    tokens, stats, env = engine_tokens("llamacpp", "tiny_qwen", checkpoints[name])
    assert env["tokens_comparable"] and "lossless_check" not in stats
    reference = reference_tokens(checkpoints[name])
    assert len(set(reference)) > 3
    assert tokens == reference


@pytest.mark.llamacpp
@needs_llamacpp
def test_llamacpp_qwen_norm_topk_prob_is_recorded_not_comparable(checkpoints, home):
    ckpt = checkpoints["qwen_norm_topk"]
    tokens, stats, env = engine_tokens("llamacpp", "tiny_qwen", ckpt)
    assert stats["lossless_check"] == "not comparable" and not env["tokens_comparable"]
    assert "norm_topk_prob" in env["tokens_not_comparable_because"]
    # why: llama.cpp computes the unnormalised model
    assert tokens == reference_tokens(ckpt, norm_topk_prob=False)


@pytest.mark.llamacpp
@needs_llamacpp
def test_llamacpp_loads_phimoe_exported_as_phi35moe_with_its_tokenizer(tiny_checkpoint, tmp_path, home):
    """A byte-level BPE without `</s>`/`<unk>`/`<s>` under a "phi3"-like run name: llama.cpp's vocabulary
    loader used to fail ("unordered_map::at") because the export's name came from the run config."""
    from transformers import AutoTokenizer

    tok_dir = tiny_checkpoint("tiny_phi")
    vocab = len(AutoTokenizer.from_pretrained(tok_dir))
    ckpt = build_checkpoint(tmp_path / "phi", "phimoe", tokenizer_from=tok_dir, vocab_size=vocab, hidden_size=64,
                            intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                            num_local_experts=6, num_experts_per_tok=2, max_position_embeddings=512,
                            bos_token_id=0, eos_token_id=0, pad_token_id=1, tie_word_embeddings=False)
    tokens, stats, env = engine_tokens("llamacpp", "phi35moe", ckpt)
    assert len(tokens) == N_TOKENS and stats["lossless_check"] == "not comparable"
    assert "sparsemixer" in env["tokens_not_comparable_because"]


@pytest.mark.llamacpp
@needs_llamacpp
def test_llamacpp_load_failure_is_one_line_quoting_llamacpp(tmp_path):
    import llama_cpp

    from baselines.llamacpp_engine import EngineLoadError, load_llama

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(EngineLoadError) as err:
        load_llama(llama_cpp, bad, n_ctx=32)
    msg = str(err.value)
    assert "\n" not in msg and str(bad.resolve()) in msg and "Failed to load model" not in msg
    assert "gguf" in msg.lower() or "error" in msg.lower(), msg
