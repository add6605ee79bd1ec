"""Export a transformers MoE checkpoint to GGUF for llama.cpp, with the `gguf` package.

    python -m baselines.gguf_export <checkpoint folder> [--type f32|f16] [--out FILE]

Covers the three architectures Specter runs (llama.cpp names in brackets): Qwen2-MoE [qwen2moe],
DeepSeek-V2 [deepseek2], PhiMoE [phimoe]. The tensors are the checkpoint's own, renamed with the
gguf package's name map; what llama.cpp stores differently is rearranged, nothing is recomputed:

    routed experts      E per-expert [I, H] / [H, I] matrices -> one stacked [E, I, H] / [E, H, I] tensor
    DeepSeek-V2 MLA     kv_b_proj [heads * (nope + v), kv_lora] -> k_b [heads, kv_lora, nope] (transposed)
                        and v_b [heads, v, kv_lora]; the KV is stored as one MQA head (head_count_kv = 1)
    PhiMoE              llama.cpp requires biases the checkpoint may lack (attention output, lm_head):
                        written as zeros, which is what a missing bias means

Matrices are written in the requested type (F32, or F16 for half-precision devices); 1-D tensors and
routers stay F32, as llama.cpp's own converter keeps them. A byte-level BPE tokenizer is written as
llama.cpp's `gpt2` vocabulary (tokens, types, merges, special ids); any other tokenizer as `no_vocab`
(the harness always hands llama.cpp token ids, never text).

`cached_gguf` keeps one file per (weights, config, tokenizer, export version; type) under
$SPECTER_HOME/gguf, written atomically, so a retrained or reconfigured checkpoint never reuses a
stale export. `general.name` is built from the checkpoint's facts: llama.cpp's vocabulary loader
special-cases some names (a "phi3" name makes it look up Phi-3's special tokens by text).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specter.assembly.config import ConfigError

GGUF_TYPES = ("f32", "f16")
_MODEL_TYPES = {"qwen2_moe": "QWEN2MOE", "deepseek_v2": "DEEPSEEK2", "phimoe": "PHIMOE"}


class ExportError(ConfigError):
    """The checkpoint cannot be written as GGUF (unsupported architecture, unexpected tensors)."""


@dataclass
class PlannedTensor:
    """One GGUF tensor: its name, numpy shape (PyTorch order) and how to produce its data."""

    name: str
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]
    keep_f32: bool  # 1-D tensors and routers stay F32 whatever the file type


def _gguf():
    try:
        import gguf
    except ImportError:
        from baselines.common import EngineUnavailable

        raise EngineUnavailable("GGUF export needs the gguf package: pip install -c constraints.txt -e \".[llamacpp]\"") from None
    return gguf


class _Weights:
    """Lazy access to a checkpoint's safetensors tensors by name."""

    def __init__(self, checkpoint: Path):
        from safetensors import safe_open

        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        files = sorted(Path(checkpoint).glob("*.safetensors"))
        if not files:
            raise ExportError(f"no *.safetensors files in {checkpoint}")
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    self.where[key] = file
                    self.shapes[key] = tuple(f.get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.where[key]), framework="pt") as f:
            return f.get_tensor(key)

    def __contains__(self, key: str) -> bool:
        return key in self.where


def _hparams(checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's config as transformers builds the model from it (defaults filled in)."""
    from specter.models.facts import CheckpointFactsError, read_config

    try:
        return read_config(checkpoint).to_dict()
    except CheckpointFactsError as err:
        raise ExportError(str(err)) from None


def _rope(h: dict[str, Any]) -> dict[str, Any]:
    from specter.models.facts import rope_settings

    return rope_settings(h)


# Substrings of `general.name` for which llama.cpp's vocabulary loader changes token attributes by
# looking tokens up by text ("phi-3"/"phi3": `</s>`, `<unk>`, `<s>`, `<|endoftext|>` must exist, or
# loading fails with "unordered_map::at"). The exported name never carries them: it is built from
# the checkpoint's facts, not from the run config's model name.
_NAME_TRIGGERS = ("phi-3", "phi3", "modern-bert")


def gguf_name(h: dict[str, Any]) -> str:
    """`general.name` of the export: the architecture and its sizes (e.g. "deepseek_v2-64x6-27l")."""
    from specter.models.facts import facts_from_config

    f = facts_from_config(h)
    name = f"{f.model_type}-{f.num_experts}x{f.top_k}-{f.num_layers}l"
    assert not any(t in name.lower() for t in _NAME_TRIGGERS), name
    return name


def not_comparable_reason(checkpoint: Path) -> str | None:
    """Why llama.cpp computes another function than transformers on this checkpoint (None: the same).

    PhiMoE: llama.cpp routes with softmax top-2, not sparsemixer. Qwen2-MoE with norm_topk_prob:
    llama.cpp's qwen2moe graph never renormalises the top-k weights (it ignores expert_weights_norm)."""
    from specter.models.facts import facts_from_config

    f = facts_from_config(_hparams(checkpoint))
    if f.model_type == "phimoe":
        return "llama.cpp's PhiMoE routes with softmax top-2, not sparsemixer: tokens not comparable (speed only)"
    if f.model_type == "qwen2_moe" and f.norm_topk_prob:
        return ("the checkpoint renormalises its top-k routing weights (norm_topk_prob: true) and llama.cpp's "
                "qwen2moe never does: tokens not comparable (speed only)")
    return None


def gguf_arch(checkpoint: Path) -> str:
    """llama.cpp's architecture name for a checkpoint (an ExportError if unsupported)."""
    model_type = _hparams(checkpoint).get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ExportError(f"GGUF export supports {sorted(_MODEL_TYPES)}, not model_type={model_type!r}")
    gguf = _gguf()
    return gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, _MODEL_TYPES[model_type])]


# ------------------------------------------------------------------------------------------ tensors
def plan_tensors(checkpoint: Path) -> list[PlannedTensor]:
    """Every GGUF tensor of the checkpoint, in file order; raises on a tensor with no GGUF place."""
    gguf = _gguf()
    h = _hparams(checkpoint)
    model_type = h["model_type"]
    arch = getattr(gguf.MODEL_ARCH, _MODEL_TYPES[model_type])
    n_layers = int(h["num_hidden_layers"])
    names = gguf.get_tensor_name_map(arch, n_layers)
    w = _Weights(checkpoint)
    f32_kinds = {gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP, gguf.MODEL_TENSOR.FFN_EXP_PROBS_B}
    f32_names = {gguf.TENSOR_NAMES[k].split(".")[-1] for k in f32_kinds}  # e.g. "ffn_gate_inp"
    plan: list[PlannedTensor] = []
    expert_parts = _expert_parts(model_type)
    grouped: dict[tuple[int, str], dict[int, str]] = {}

    def add(name: str, shape: tuple[int, ...], load: Callable[[], torch.Tensor]) -> None:
        base = name.rsplit(".", 1)[0].split(".")[-1]
        plan.append(PlannedTensor(name, tuple(shape), load, len(shape) == 1 or base in f32_names))

    for key in sorted(w.where, key=_natural):
        expert = _parse_expert(key, expert_parts)
        if expert is not None:
            layer, e, part = expert
            grouped.setdefault((layer, part), {})[e] = key
            continue
        if model_type == "deepseek_v2" and key.endswith("self_attn.kv_b_proj.weight"):
            plan.extend(_mla_kv_b(key, w, h, names))
            continue
        if key.startswith("model.layers.") and int(key.split(".")[2]) >= n_layers:
            continue  # multi-token-prediction layers beyond the decoder (DeepSeek checkpoints)
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ExportError(f"{key}: no GGUF tensor for it in llama.cpp's {gguf.MODEL_ARCH_NAMES[arch]} layout")
        add(name, w.shapes[key], (lambda k=key: w.get(k)))

    n_experts = int(h.get("num_experts") or h.get("n_routed_experts") or h.get("num_local_experts"))
    for (layer, part), by_expert in sorted(grouped.items()):
        if sorted(by_expert) != list(range(n_experts)):
            raise ExportError(f"layer {layer} {part}: experts {sorted(by_expert)[:5]}... != 0..{n_experts - 1}")
        keys = [by_expert[e] for e in range(n_experts)]
        kind = {"gate": gguf.MODEL_TENSOR.FFN_GATE_EXP, "up": gguf.MODEL_TENSOR.FFN_UP_EXP,
                "down": gguf.MODEL_TENSOR.FFN_DOWN_EXP}[part]
        name = gguf.TENSOR_NAMES[kind].format(bid=layer) + ".weight"
        add(name, (n_experts, *w.shapes[keys[0]]), (lambda ks=keys: torch.stack([w.get(k) for k in ks])))  # [E, out, in]

    if model_type == "phimoe":
        plan.extend(_phimoe_required_biases(plan, h, n_layers))
        plan.extend(_phimoe_rope_factors(h))
    have = {p.name for p in plan}
    if "output.weight" not in have and not h.get("tie_word_embeddings", False):
        raise ExportError("the checkpoint has no lm_head.weight and does not tie it to the embeddings")
    return plan


def _natural(key: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in key.split("."))


def _expert_parts(model_type: str) -> dict[str, str]:
    if model_type == "phimoe":
        return {"w1": "gate", "w3": "up", "w2": "down"}
    return {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def _parse_expert(key: str, parts: dict[str, str]) -> tuple[int, int, str] | None:
    """(layer, expert, gate|up|down) of a per-expert checkpoint key, else None."""
    t = key.split(".")
    if len(t) >= 7 and t[0] == "model" and t[1] == "layers" and "experts" in t and t[-1] == "weight":
        i = t.index("experts")
        if i + 2 < len(t) and t[i + 1].isdigit() and t[i + 2] in parts:
            return int(t[2]), int(t[i + 1]), parts[t[i + 2]]
    return None


def _mla_kv_b(key: str, w: _Weights, h: dict[str, Any], names) -> list[PlannedTensor]:
    """DeepSeek-V2's kv_b_proj split for llama.cpp's absorbed MLA: k_b (transposed) and v_b."""
    heads, nope, v = int(h["num_attention_heads"]), int(h["qk_nope_head_dim"]), int(h["v_head_dim"])
    rows, kv_lora = w.shapes[key]
    if rows != heads * (nope + v):
        raise ExportError(f"{key}: {rows} rows != heads * (qk_nope + v) = {heads * (nope + v)}")
    layer = key.split(".")[2]

    def split() -> tuple[torch.Tensor, torch.Tensor]:
        kv_b = w.get(key).view(heads, nope + v, kv_lora)  # [heads, nope + v, kv_lora]
        k_b, v_b = torch.split(kv_b, [nope, v], dim=1)  # [heads, nope, kv_lora], [heads, v, kv_lora]
        return k_b.transpose(1, 2).contiguous(), v_b.contiguous()  # [heads, kv_lora, nope], [heads, v, kv_lora]

    return [PlannedTensor(f"blk.{layer}.attn_k_b.weight", (heads, kv_lora, nope), lambda: split()[0], False),
            PlannedTensor(f"blk.{layer}.attn_v_b.weight", (heads, v, kv_lora), lambda: split()[1], False)]


def _phimoe_required_biases(plan: list[PlannedTensor], h: dict[str, Any], n_layers: int) -> list[PlannedTensor]:
    have = {p.name for p in plan}
    H, V = int(h["hidden_size"]), int(h["vocab_size"])
    wanted = [("output.bias", V)] + [(f"blk.{i}.attn_output.bias", H) for i in range(n_layers)]
    return [PlannedTensor(name, (n,), (lambda n=n: torch.zeros(n)), True) for name, n in wanted if name not in have]


def _phimoe_rope_factors(h: dict[str, Any]) -> list[PlannedTensor]:
    rope = _rope(h)
    if rope["rope_type"] not in ("longrope", "su") or not rope.get("long_factor"):
        return []
    long, short = rope["long_factor"], rope["short_factor"]
    return [PlannedTensor("rope_factors_long.weight", (len(long),), lambda: torch.tensor(long), True),
            PlannedTensor("rope_factors_short.weight", (len(short),), lambda: torch.tensor(short), True)]


# ----------------------------------------------------------------------------------------- metadata
def _write_metadata(writer, h: dict[str, Any], file_type: str, name: str) -> None:
    gguf = _gguf()
    mt = h["model_type"]
    rope = _rope(h)
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if file_type == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(int(h["vocab_size"]))
    writer.add_block_count(int(h["num_hidden_layers"]))
    writer.add_context_length(int(h["max_position_embeddings"]))
    writer.add_embedding_length(int(h["hidden_size"]))
    writer.add_feed_forward_length(int(h["intermediate_size"]))
    writer.add_head_count(int(h["num_attention_heads"]))
    writer.add_layer_norm_rms_eps(float(h.get("rms_norm_eps", 1e-6)))
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_expert_used_count(int(h["num_experts_per_tok"]))
    if mt == "qwen2_moe":
        writer.add_head_count_kv(int(h["num_key_value_heads"]))
        writer.add_expert_count(int(h["num_experts"]))
        writer.add_expert_feed_forward_length(int(h["moe_intermediate_size"]))
        writer.add_expert_shared_feed_forward_length(int(h["shared_expert_intermediate_size"]))
        # norm_topk_prob is not written: llama.cpp's qwen2moe ignores it (not_comparable_reason says so)
        _write_rope_scaling(writer, rope, mt)
    elif mt == "deepseek_v2":
        kv_lora, rope_dim = int(h["kv_lora_rank"]), int(h["qk_rope_head_dim"])
        writer.add_head_count_kv(1)  # MLA runs as MQA over the compressed KV
        writer.add_leading_dense_block_count(int(h.get("first_k_dense_replace") or 0))
        # Always written: llama.cpp requires the key unless the model has 26/27 layers (its "lite" guess);
        # 0 = no low-rank query (DeepSeek-V2-Lite's q_lora_rank: null), and llama.cpp then loads attn_q.
        writer.add_q_lora_rank(int(h.get("q_lora_rank") or 0))
        writer.add_kv_lora_rank(kv_lora)
        writer.add_key_length(kv_lora + rope_dim)
        writer.add_value_length(kv_lora)
        writer.add_key_length_mla(int(h["qk_nope_head_dim"]) + rope_dim)
        writer.add_value_length_mla(int(h["v_head_dim"]))
        writer.add_expert_count(int(h["n_routed_experts"]))
        writer.add_expert_feed_forward_length(int(h["moe_intermediate_size"]))
        writer.add_expert_shared_count(int(h.get("n_shared_experts") or 0))
        writer.add_expert_weights_scale(float(h.get("routed_scaling_factor", 1.0)))
        # expert_weights_norm is never written: transformers' DeepseekV2 gate ignores norm_topk_prob (top-k
        # softmax weights times routed_scaling_factor, never renormalised), and llama.cpp would renormalise.
        scoring = h.get("scoring_func", "softmax")
        writer.add_expert_gating_func({"softmax": gguf.ExpertGatingFuncType.SOFTMAX,
                                       "sigmoid": gguf.ExpertGatingFuncType.SIGMOID}[scoring])
        if h.get("topk_method") == "group_limited_greedy" and h.get("n_group"):
            writer.add_expert_group_count(int(h["n_group"]))
            writer.add_expert_group_used_count(int(h["topk_group"]))
        writer.add_rope_dimension_count(rope_dim)
        if rope["rope_type"] not in ("default", "yarn"):
            raise ExportError(f"DeepSeek-V2 rope_type={rope['rope_type']!r}: the export writes default or yarn rope")
        if rope["rope_type"] == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(float(rope["factor"]))
            writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
            if rope.get("mscale_all_dim") is not None:  # llama.cpp divides this 0.1 back out
                writer.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))
            if rope.get("beta_fast") is not None:
                writer.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
            if rope.get("beta_slow") is not None:
                writer.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))
    elif mt == "phimoe":
        H, heads = int(h["hidden_size"]), int(h["num_attention_heads"])
        writer.add_head_count_kv(int(h["num_key_value_heads"]))
        writer.add_expert_count(int(h["num_local_experts"]))
        writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * H) // heads)
        writer.add_sliding_window(int(h.get("sliding_window") or 0))
        orig = int(rope.get("original_max_position_embeddings") or h["max_position_embeddings"])
        writer.add_rope_scaling_orig_ctx_len(orig)
        if rope["rope_type"] in ("longrope", "su") and rope.get("long_factor"):
            import math

            scale = int(h["max_position_embeddings"]) / orig
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)


def _write_rope_scaling(writer, rope: dict[str, Any], model_type: str) -> None:
    """Linear or YaRN rope scaling as llama.cpp's generic rope keys (Qwen2-MoE); "dynamic" NTK changes
    nothing within the original context, which is where the harness runs."""
    gguf = _gguf()
    kind = rope["rope_type"]
    if kind in ("default", "dynamic"):
        return
    if kind not in ("linear", "yarn"):
        raise ExportError(f"{model_type} rope_type={kind!r}: the export writes default, dynamic, linear or yarn rope")
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if kind == "linear" else gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(rope["factor"]))
    if kind == "yarn":
        if rope.get("original_max_position_embeddings"):
            writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        # transformers scales attention by `attention_factor` (default: mscale(factor), or
        # mscale(factor, mscale) / mscale(factor, mscale_all_dim)); llama.cpp applies mscale(factor)
        # itself and multiplies by rope.scaling.attn_factor: write the ratio.
        import math

        factor = float(rope["factor"])

        def mscale(m: float = 1.0) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        wanted = rope.get("attention_factor")
        if wanted is None:
            m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
            wanted = mscale(float(m)) / mscale(float(m_all)) if m and m_all else mscale()
        if abs(float(wanted) / mscale() - 1.0) > 1e-7:
            writer.add_rope_scaling_attn_factors(float(wanted) / mscale())
        if rope.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
        if rope.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))


def _write_vocab(writer, checkpoint: Path, h: dict[str, Any]) -> str:
    """The tokenizer as llama.cpp's `gpt2` BPE vocabulary where it is byte-level BPE; returns the kind written."""
    gguf = _gguf()
    vocab_size = int(h["vocab_size"])
    path = Path(checkpoint) / "tokenizer.json"
    spec = json.loads(path.read_text()) if path.exists() else {}
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        writer.add_tokenizer_model("no_vocab")
        return "no_vocab"
    by_id = {i: t for t, i in model["vocab"].items()}
    special = set()
    for tok in spec.get("added_tokens", []):
        by_id[tok["id"]] = tok["content"]
        if tok.get("special"):
            special.add(tok["id"])
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(spec, h["model_type"]))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_token_merges(merges)
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):
        value = h.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            add(int(value))
    writer.add_add_bos_token(False)
    return "gpt2"


def _pre_tokenizer(spec: dict[str, Any], model_type: str) -> str:
    """llama.cpp's name for the text split before BPE: GPT-2's own regex, else the model family's."""
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    return {"qwen2_moe": "qwen2", "deepseek_v2": "deepseek-llm"}.get(model_type, "default")


# --------------------------------------------------------------------------------------------- write
def export_gguf(checkpoint: Path, out: Path, file_type: str = "f32") -> Path:
    """Write `checkpoint` as a GGUF file at `out` (streamed: one tensor in memory at a time).

    Everything written comes from the checkpoint (its config, tensors and tokenizer), never from the
    run config's model name."""
    gguf = _gguf()
    if file_type not in GGUF_TYPES:
        raise ExportError(f"unknown GGUF type {file_type!r}; choose one of {list(GGUF_TYPES)}")
    checkpoint, out = Path(checkpoint), Path(out)
    h = _hparams(checkpoint)
    arch = gguf_arch(checkpoint)
    plan = plan_tensors(checkpoint)
    writer = gguf.GGUFWriter(None, arch)
    _write_metadata(writer, h, file_type, gguf_name(h))
    _write_vocab(writer, checkpoint, h)

    def np_dtype(t: PlannedTensor):
        return np.float32 if file_type == "f32" or t.keep_f32 else np.float16

    for t in plan:
        dt = np_dtype(t)
        writer.add_tensor_info(t.name, t.shape, np.dtype(dt), int(np.prod(t.shape)) * np.dtype(dt).itemsize)
    writer.write_header_to_file(out)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in plan:
        data = t.load().to(torch.float32).numpy().astype(np_dtype(t), copy=False)
        if tuple(data.shape) != t.shape:
            raise ExportError(f"{t.name}: produced shape {tuple(data.shape)}, planned {t.shape}")
        writer.write_tensor_data(np.ascontiguousarray(data))
    writer.close()
    return out


# Bumped whenever the export writes something else for the same checkpoint (a cached file is then redone).
EXPORT_VERSION = 2


def export_key(checkpoint: Path, weights_digest: str) -> str:
    """What the export depends on: the weights, the config, the tokenizer files and EXPORT_VERSION."""
    import hashlib

    h = hashlib.sha256(f"v{EXPORT_VERSION}|{weights_digest}|".encode())
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        f = Path(checkpoint) / name
        h.update(f"{name}|".encode() + (f.read_bytes() if f.is_file() else b"-") + b"|")
    return h.hexdigest()[:12]


def cached_gguf(checkpoint: Path, file_type: str, label: str | None = None) -> Path:
    """The checkpoint's GGUF under $SPECTER_HOME/gguf, exported on first use (keyed by the weights' digest).

    Beside it, `<name>.sha256` holds the export's content digest (written before the file is renamed
    into place); a cached file is used only when its content still matches (`specter.paths.cached_sha256`,
    hashed once per content), else it is exported again."""
    import sys

    from specter.models.registry import checkpoint_digest
    from specter.paths import atomic_write_text, cached_sha256, file_sha256, safe_name, specter_home

    checkpoint = Path(checkpoint)
    label = safe_name(label or checkpoint.name, "model.name")
    path = specter_home() / "gguf" / f"{label}-{export_key(checkpoint, checkpoint_digest(checkpoint))}-{file_type}.gguf"
    sums = path.with_name(path.name + ".sha256")
    if path.exists():
        try:
            expected = sums.read_text().strip()
        except OSError:
            expected = None
        if expected == cached_sha256(path):
            return path
        print(f"specter: the cached {path} does not match its checksum ({sums.name}); exporting it again",
              file=sys.stderr, flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        export_gguf(checkpoint, Path(tmp), file_type)
        atomic_write_text(sums, file_sha256(Path(tmp)) + "\n")
        os.replace(tmp, path)  # atomic: a half-written export is never picked up
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def tensor_bytes(path: Path) -> dict[str, int]:
    """Bytes of every tensor in a GGUF file, by name."""
    gguf = _gguf()
    return {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}


def iter_layers(names: dict[str, int]) -> Iterator[tuple[int, int]]:
    """(layer, bytes) of the `blk.N.*` tensors, by layer."""
    per: dict[int, int] = {}
    for name, n in names.items():
        if name.startswith("blk."):
            layer = int(name.split(".")[1])
            per[layer] = per.get(layer, 0) + n
    yield from sorted(per.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Export a Qwen2-MoE / DeepSeek-V2 / PhiMoE checkpoint to GGUF.")
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--type", choices=GGUF_TYPES, default="f32")
    ap.add_argument("--out", type=Path, default=None, help="default: the cache under $SPECTER_HOME/gguf")
    args = ap.parse_args(argv)
    try:
        path = export_gguf(args.checkpoint, args.out, args.type) if args.out else cached_gguf(args.checkpoint, args.type)
    except ConfigError as err:  # ExportError, a missing gguf package: one line, no traceback
        import sys

        print(f"gguf_export: error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
