"""Tiny checkpoints: real architectures, deterministic bytes, GPTQ/llama.cpp-friendly dimensions."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from specter.models import tiny
from specter.models.arch import arch_for, moe_blocks


@pytest.mark.parametrize("name", tiny.TINY_SPECS)
def test_build_is_deterministic_and_matches_pinned_checksum(name, tmp_path, tiny_checkpoint):
    model = tiny.build_random_model(name)
    digest = tiny.weights_digest(model.state_dict())
    assert digest == tiny.TINY_WEIGHT_SHA256[name], "tiny weights changed: update tiny_checksums.json knowingly"
    built = tiny_checkpoint(name)
    assert json.loads((built / "specter_tiny.json").read_text())["weights_sha256"] == digest
    from safetensors.torch import load_file

    on_disk = load_file(built / "model.safetensors")
    assert len(on_disk) > 0
    # the same seed gives the same bytes twice in one process too
    assert tiny.weights_digest(tiny.build_random_model(name).state_dict()) == digest


def test_tokenizer_is_deterministic(tiny_checkpoint):
    tok_a = tiny.train_tokenizer()
    saved = (tiny_checkpoint("tiny_qwen") / "tokenizer.json").read_bytes()
    assert hashlib.sha256(tok_a.backend_tokenizer.to_str().encode()).hexdigest() == hashlib.sha256(
        __import__("tokenizers").Tokenizer.from_str(saved.decode()).to_str().encode()
    ).hexdigest()
    assert len(tok_a) == tiny.TOKENIZER_VOCAB
    ids = tok_a("def add(a, b):\n    return a + b\n").input_ids
    assert tok_a.decode(ids) == "def add(a, b):\n    return a + b\n"


EXPECTED = {  # (routed experts, top-k) kept from the real models
    "tiny_dsv2": (64, 6),
    "tiny_qwen": (60, 4),
    "tiny_phi": (16, 2),
}


@pytest.mark.parametrize("name", tiny.TINY_SPECS)
def test_real_architecture_features(name):
    model = tiny.build_random_model(name)
    cfg = model.config
    blocks = moe_blocks(model)
    E, k = EXPECTED[name]
    for block in blocks.values():
        assert block.experts.gate_up_proj.shape[0] == E
    assert cfg.num_experts_per_tok == k
    if name == "tiny_dsv2":
        assert 0 not in blocks and set(blocks) == {1, 2, 3}  # first layer dense
        assert cfg.n_shared_experts == 2 and cfg.kv_lora_rank > 0  # MLA
    if name == "tiny_qwen":
        assert all(hasattr(b, "shared_expert_gate") for b in blocks.values())
    if name == "tiny_phi":
        assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    arch_for(cfg.model_type)


@pytest.mark.parametrize("name", tiny.TINY_SPECS)
def test_expert_dims_suit_gptq_cpu_kernel(name):
    """Every routed-expert linear: out_features % 16 == 0 and in_features % 128 == 0 (group size 128)."""
    model = tiny.build_random_model(name)
    for block in moe_blocks(model).values():
        E, two_i, H = block.experts.gate_up_proj.shape
        _, H2, I = block.experts.down_proj.shape
        for out_f, in_f in ((two_i // 2, H), (H2, I)):
            assert out_f % 16 == 0 and in_f % 128 == 0


def test_unknown_tiny_name():
    with pytest.raises(ValueError, match="unknown tiny model"):
        tiny.build_random_model("tiny_nope")


@pytest.mark.parametrize("name", tiny.TINY_SPECS)
def test_checkpoint_generates(name, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(name)).eval()
    with torch.no_grad():
        out = model(torch.tensor([[5, 6, 7]])).logits
    assert out.shape == (1, 3, tiny.TOKENIZER_VOCAB) and torch.isfinite(out).all()
