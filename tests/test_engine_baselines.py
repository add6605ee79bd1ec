"""The engine baselines (transformers, llama.cpp, vLLM) against target-only decoding, and the GGUF export.

Runs without the optional engines: the llama.cpp tests are marked `llamacpp` and the vLLM tests
`vllm`, and each skips where its engine is not installed (`pip install -e ".[llamacpp]"`,
`bash scripts/setup_vllm.sh`).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import FIXTURES, compose, run_cli

from baselines.common import agreement
from baselines.llamacpp_engine import gpu_layers_for_budget, kv_bytes_per_token_layer
from specter.assembly.methods import build_method
from specter.models.loading import load_full_model
from specter.speculative.autoregressive import generate_autoregressive
from specter.speculative.sampling import SamplingParams, make_generator

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
HAS_GGUF = importlib.util.find_spec("gguf") is not None
ASSETS = f"assets_dir={FIXTURES / 'datasets'}"
TEXTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
         "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n"]
requires_gguf = pytest.mark.skipif(not HAS_GGUF, reason='needs the gguf package: pip install -e ".[llamacpp]"')
needs_llamacpp = pytest.mark.skipif(not HAS_LLAMA_CPP, reason='needs llama-cpp-python: pip install -e ".[llamacpp]"')


def vllm_env() -> Path | None:
    from specter.paths import specter_home

    path = Path(os.environ.get("SPECTER_VLLM_PYTHON") or specter_home() / "venvs" / "vllm" / "bin" / "python")
    return path if path.exists() else None


needs_vllm = pytest.mark.skipif(vllm_env() is None, reason="needs the vLLM env: bash scripts/setup_vllm.sh")


def prompts(checkpoint: Path, n: int = 16) -> list[torch.Tensor]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    return [torch.tensor([tok(t, add_special_tokens=False).input_ids[:n]]) for t in TEXTS]  # [1, P] each


def engine(method: str, model: str, checkpoint: Path, *overrides: str):
    cfg = compose([f"method={method}", f"model={model}", "hardware=cpu", "method.reference_check=false", *overrides])
    return build_method(cfg, checkpoint)


def target_only_tokens(checkpoint: Path, prompt: torch.Tensor, n: int) -> list[int]:
    model = load_full_model(checkpoint, torch.float32, torch.device("cpu"))
    return generate_autoregressive(model, prompt, n, SamplingParams())


def check_clock(gen, n: int) -> None:
    lat = gen.clock.latency()
    assert gen.clock.num_tokens == n and len(gen.tokens) == n
    assert lat["tpot_ms"] > 0 and lat["ttft_ms"] > 0 and lat["e2e_ms"] >= lat["ttft_ms"]
    assert all(b >= a for a, b in zip(gen.clock.stamps, gen.clock.stamps[1:]))  # one stamp per token, in order


def test_agreement_reports_the_first_divergence():
    assert agreement([1, 2, 3], [1, 2, 3]) == {"first_divergence": 3, "token_match_fraction": 1.0, "lossless_check": "exact"}
    got = agreement([1, 5, 3, 4], [1, 2, 3, 4])
    assert got["first_divergence"] == 1 and got["token_match_fraction"] == 0.75 and got["lossless_check"] == "diverged@1"


# ------------------------------------------------------------------------------------ transformers
@pytest.mark.parametrize("model", ["tiny_qwen", "tiny_dsv2", "tiny_phi"])
def test_transformers_greedy_equals_target_only(model, tiny_checkpoint):
    ckpt = tiny_checkpoint(model)
    method = engine("transformers", model, ckpt)
    try:
        for prompt in prompts(ckpt):
            gen = method.generate(prompt, 48, make_generator("cpu", 0))
            check_clock(gen, 48)
            assert gen.tokens == target_only_tokens(ckpt, prompt, 48)
            assert gen.stats["peak_memory_bytes"] > 0
    finally:
        method.close()


def test_transformers_batch_decodes_each_prompt_as_alone(tiny_checkpoint):
    ckpt = tiny_checkpoint("tiny_dsv2")
    method = engine("transformers", "tiny_dsv2", ckpt)
    batch = [p[0] for p in prompts(ckpt)] + [prompts(ckpt)[0][0, :9]]  # unequal lengths: left padding
    run = method.generate_batch(batch, 24, [make_generator("cpu", i) for i in range(len(batch))])
    for prompt, req in zip(batch, run.requests):
        assert req.tokens == target_only_tokens(ckpt, prompt[None], 24)
        assert req.clock.num_tokens == 24 and req.clock.latency()["tpot_ms"] > 0
    assert run.wall_seconds() > 0


def test_transformers_sampling_follows_the_record_seed(tiny_checkpoint):
    ckpt = tiny_checkpoint("tiny_qwen")
    method = engine("transformers", "tiny_qwen", ckpt, "temperature=1.0")
    prompt = prompts(ckpt)[0]
    a, b, c = (method.generate(prompt, 24, make_generator("cpu", s)).tokens for s in (7, 7, 8))
    assert a == b and a != c


def test_transformers_run_writes_records_with_token_agreement(tmp_path, tiny_checkpoint):
    tiny_checkpoint("tiny_qwen")
    out = tmp_path / "run"
    res = run_cli(["method=transformers", "model=tiny_qwen", "hardware=cpu", "dataset=humaneval", "num_prompts=2",
                   "max_new_tokens=12", "warmup_tokens=2", "progress=false", ASSETS, f"output_dir={out}"])
    assert res.returncode == 0, res.stderr[-2000:]
    rec = pd.read_csv(out / "records.csv")
    assert len(rec) == 2 and (rec.new_tokens == 12).all() and rec.tpot_ms.gt(0).all()
    assert (rec.lossless_check == "exact").all() and (rec.first_divergence == 12).all()
    assert rec.peak_memory_bytes.gt(0).all() and rec.acceptance_alpha.isna().all()
    env = json.loads((out / "env.json").read_text())
    assert "transformers" in json.dumps(env)


@pytest.mark.parametrize("method", ["transformers", "llamacpp", "vllm"])
def test_engines_refuse_the_emulated_link(method, tiny_checkpoint):
    from specter.assembly.config import ConfigError

    cfg = compose([f"method={method}", "model=tiny_qwen", "hardware=emulated"])
    with pytest.raises(ConfigError, match="hardware=cpu"):
        build_method(cfg, tiny_checkpoint("tiny_qwen"))


# ----------------------------------------------------------------------------------------- GGUF
def test_gpu_layers_for_budget_counts_from_the_last_layer():
    layers, head, kv = [10, 40, 40, 40], 30, 5  # llama.cpp offloads the last n layers, then the output layer
    assert gpu_layers_for_budget(layers, head, kv, budget=0) == 0
    assert gpu_layers_for_budget(layers, head, kv, budget=44) == 0
    assert gpu_layers_for_budget(layers, head, kv, budget=45) == 1
    assert gpu_layers_for_budget(layers, head, kv, budget=134) == 2
    assert gpu_layers_for_budget(layers, head, kv, budget=150) == 4  # 15 + 135: every layer, not the output
    assert gpu_layers_for_budget(layers, head, kv, budget=180) == 5  # and the output layer
    qwen = {"model_type": "qwen2_moe", "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2}
    dsv2 = {"model_type": "deepseek_v2", "kv_lora_rank": 64, "qk_rope_head_dim": 32}
    assert kv_bytes_per_token_layer(qwen, 4) == 2 * 2 * 64 * 4 and kv_bytes_per_token_layer(dsv2, 2) == 96 * 2


@requires_gguf
@pytest.mark.parametrize("model", ["tiny_qwen", "tiny_dsv2", "tiny_phi"])
def test_gguf_export_holds_the_checkpoint_tensors(model, tiny_checkpoint, tmp_path):
    import gguf
    from safetensors.torch import load_file

    from baselines.gguf_export import export_gguf

    ckpt = tiny_checkpoint(model)
    cfg = json.loads((ckpt / "config.json").read_text())
    hf = load_file(str(ckpt / "model.safetensors"))
    reader = gguf.GGUFReader(str(export_gguf(ckpt, tmp_path / "m.gguf", "f16")))
    arch = {"qwen2_moe": "qwen2moe", "deepseek_v2": "deepseek2", "phimoe": "phimoe"}[cfg["model_type"]]
    field = reader.fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == arch
    tensors = {t.name: t for t in reader.tensors}

    def data(name: str) -> np.ndarray:
        t = tensors[name]
        return np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)])  # GGUF dims are reversed

    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32  # routers stay F32
    assert tensors["output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    np.testing.assert_array_equal(data("token_embd.weight"), hf["model.embed_tokens.weight"].half().numpy())
    experts = "block_sparse_moe.experts.{e}.w2" if model == "tiny_phi" else "mlp.experts.{e}.down_proj"
    n_experts = int(cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts"))
    stacked = data("blk.1.ffn_down_exps.weight")  # [E, H, I]
    assert stacked.shape[0] == n_experts
    for e in (0, n_experts - 1):
        np.testing.assert_array_equal(stacked[e], hf[f"model.layers.1.{experts.format(e=e)}.weight"].half().numpy())
    if model == "tiny_dsv2":  # MLA: k_b and v_b rebuild kv_b_proj
        heads, nope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
        k_b, v_b = data("blk.0.attn_k_b.weight"), data("blk.0.attn_v_b.weight")  # [h, kv_lora, nope], [h, v, kv_lora]
        kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])
        np.testing.assert_array_equal(kv_b, hf["model.layers.0.self_attn.kv_b_proj.weight"].half().numpy())
        assert heads * nope == k_b.shape[0] * k_b.shape[2]
    if model == "tiny_phi":  # llama.cpp requires the biases the checkpoint lacks: zeros
        assert not data("output.bias").any() and not data("blk.0.attn_output.bias").any()


@requires_gguf
def test_cached_gguf_is_keyed_by_the_weights(tiny_checkpoint, tmp_path, monkeypatch):
    import shutil

    from baselines.gguf_export import cached_gguf

    monkeypatch.setenv("SPECTER_HOME", str(tmp_path / "home"))
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("tiny_qwen"), ckpt)
    first = cached_gguf(ckpt, "f32", "tiny_qwen")
    stamp = first.stat().st_mtime_ns
    assert cached_gguf(ckpt, "f32", "tiny_qwen") == first and first.stat().st_mtime_ns == stamp  # reused
    from safetensors.torch import load_file, save_file

    weights = load_file(str(ckpt / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    second = cached_gguf(ckpt, "f32", "tiny_qwen")
    assert second != first and second.exists()  # other weights, another export
    assert not list(second.parent.glob(".*.tmp"))


# ------------------------------------------------------------------------------------- llama.cpp
@pytest.mark.llamacpp
@needs_llamacpp
@pytest.mark.parametrize("model", ["tiny_qwen", "tiny_dsv2"])
def test_llamacpp_greedy_equals_target_only(model, tiny_checkpoint):
    ckpt = tiny_checkpoint(model)
    method = engine("llamacpp", model, ckpt)
    try:
        env = method.environment()
        assert env["n_gpu_layers"] == 0 and env["gguf_type"] == "f32" and env["tokens_comparable"]
        for prompt in prompts(ckpt):
            method.reset()
            gen = method.generate(prompt, 128, make_generator("cpu", 0))  # the paper's 128 tokens
            check_clock(gen, 128)
            assert gen.tokens == target_only_tokens(ckpt, prompt, 128)
            assert gen.stats["peak_memory_bytes"] > 0
    finally:
        method.close()


@pytest.mark.llamacpp
@needs_llamacpp
def test_llamacpp_deepseek_v2_lite_layout_matches_transformers(tmp_path):
    """DeepSeek-V2-Lite's own layout (27 layers: llama.cpp's "lite", no q_lora; YaRN rope with mscale)."""
    import llama_cpp
    from transformers import AutoConfig, AutoModelForCausalLM

    from baselines.gguf_export import export_gguf

    config = AutoConfig.for_model(
        "deepseek_v2", vocab_size=512, hidden_size=128, num_hidden_layers=27, first_k_dense_replace=1,
        intermediate_size=256, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
        topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0, num_attention_heads=2,
        num_key_value_heads=2, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=32, qk_nope_head_dim=32,
        v_head_dim=64, head_dim=64, max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 0.707})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # sharper logits than the init's, so greedy output is not one token repeated
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    model.save_pretrained(tmp_path / "lite")
    prompt = torch.tensor([[3, 17, 99, 200, 45, 7, 300, 12]])  # [1, P]
    reference = generate_autoregressive(model, prompt, 32, SamplingParams())
    assert len(set(reference)) > 4
    llm = llama_cpp.Llama(model_path=str(export_gguf(tmp_path / "lite", tmp_path / "lite.gguf", "f32")), n_ctx=64,
                          n_threads=1, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, verbose=False)
    try:
        tokens = []
        for token in llm.generate(prompt[0].tolist(), temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            tokens.append(token)
            if len(tokens) == 32:
                break
        assert tokens == reference
    finally:
        llm.close()


@pytest.mark.llamacpp
@needs_llamacpp
def test_llamacpp_phimoe_runs_and_says_tokens_are_not_comparable(tiny_checkpoint):
    ckpt = tiny_checkpoint("tiny_phi")
    method = engine("llamacpp", "tiny_phi", ckpt, "method.reference_check=true")
    try:
        gen = method.generate(prompts(ckpt)[0], 32, make_generator("cpu", 0))
        check_clock(gen, 32)
        assert gen.stats["lossless_check"] == "not comparable" and "first_divergence" not in gen.stats
        env = method.environment()
        assert env["tokens_comparable"] is False and "sparsemixer" in env["tokens_not_comparable_because"]
    finally:
        method.close()


@pytest.mark.llamacpp
@needs_llamacpp
def test_llamacpp_sampling_follows_the_record_seed(tiny_checkpoint):
    ckpt = tiny_checkpoint("tiny_qwen")
    method = engine("llamacpp", "tiny_qwen", ckpt, "temperature=1.0")
    try:
        prompt = prompts(ckpt)[0]
        a, b, c = (method.generate(prompt, 24, make_generator("cpu", s)).tokens for s in (7, 7, 8))
        assert a == b and a != c
    finally:
        method.close()


@pytest.mark.llamacpp
@needs_llamacpp
def test_llamacpp_run_writes_records(tmp_path, tiny_checkpoint):
    tiny_checkpoint("tiny_dsv2")
    out = tmp_path / "run"
    res = run_cli(["method=llamacpp", "model=tiny_dsv2", "hardware=cpu", "dataset=gsm8k", "num_prompts=2",
                   "max_new_tokens=16", "warmup_tokens=2", "progress=false", ASSETS, f"output_dir={out}"])
    assert res.returncode == 0, res.stderr[-2000:]
    rec = pd.read_csv(out / "records.csv")
    assert len(rec) == 2 and (rec.new_tokens == 16).all() and rec.tpot_ms.gt(0).all()
    assert (rec.lossless_check == "exact").all() and rec.peak_memory_bytes.gt(0).all()


def test_llamacpp_missing_engine_names_the_install_command(tiny_checkpoint, monkeypatch):
    import sys

    from baselines.common import EngineUnavailable

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed
    with pytest.raises(EngineUnavailable, match=r"pip install .*llamacpp"):
        engine("llamacpp", "tiny_qwen", tiny_checkpoint("tiny_qwen"))


# ------------------------------------------------------------------------------------------ vLLM
def test_vllm_offloads_the_weights_over_the_tier_budget(tiny_checkpoint):
    from baselines.common import checkpoint_bytes
    from baselines.vllm_engine import GIB, cpu_offload_gib
    from specter.assembly.sizing import budget_bytes

    assert cpu_offload_gib(10 * GIB, 4 * GIB) == 6 and cpu_offload_gib(3 * GIB, 4 * GIB) == 0
    full = checkpoint_bytes(tiny_checkpoint("tiny_qwen"), torch.float16)
    low = budget_bytes(compose(["model=tiny_qwen", "memory=low"]), full)
    assert low == int(0.56 * full)  # tiny_qwen's low tier: 56 % of the FP16 footprint stays on the GPU
    assert cpu_offload_gib(full, low) * GIB == pytest.approx(full - low)


def test_vllm_without_its_environment_is_one_clear_line(tmp_path):
    res = run_cli(["method=vllm", "model=tiny_qwen", "hardware=cpu", f"method.python={tmp_path / 'no' / 'python'}",
                   "num_prompts=1", "progress=false", ASSETS, f"output_dir={tmp_path / 'o'}"], cwd=tmp_path)
    assert res.returncode != 0
    assert "bash scripts/setup_vllm.sh" in res.stderr and "Traceback" not in res.stderr
    assert len([line for line in res.stderr.splitlines() if "setup_vllm" in line]) == 1


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("model", ["tiny_qwen", "tiny_phi"])
def test_vllm_greedy_matches_target_only_or_reports_the_divergence(model, tiny_checkpoint):
    ckpt = tiny_checkpoint(model)
    method = engine("vllm", model, ckpt, "method.reference_check=true")
    try:
        assert method.environment()["vllm_device"] == "cpu"
        for prompt in prompts(ckpt):
            gen = method.generate(prompt, 32, make_generator("cpu", 0))
            check_clock(gen, 32)
            reference = target_only_tokens(ckpt, prompt, 32)
            same = [a == b for a, b in zip(gen.tokens, reference)]
            first = same.index(False) if False in same else 32
            assert gen.stats["first_divergence"] == first  # reported, whatever it is
            assert gen.stats["lossless_check"] == ("exact" if first == 32 else f"diverged@{first}")
            assert first > 0  # the prefill's argmax agrees: the same model ran
            assert gen.stats["peak_memory_bytes"] > 0
    finally:
        method.close()


@pytest.mark.vllm
@needs_vllm
def test_vllm_refuses_an_mla_head_size_its_kernels_lack(tmp_path, tiny_checkpoint):
    tiny_checkpoint("tiny_dsv2")  # kv_lora_rank + qk_rope_head_dim = 96; vLLM's MLA takes 320, 512 or 576
    res = run_cli(["method=vllm", "model=tiny_dsv2", "hardware=cpu", "num_prompts=1", "progress=false", ASSETS,
                   f"output_dir={tmp_path / 'o'}"], cwd=tmp_path)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "cannot run tiny_dsv2" in res.stderr and "576" in res.stderr
