"""What a model's config alone says about its device bytes: no weights, nothing allocated.

`model_facts(config, dtype)` builds the same meta-device skeleton `load_offloaded` builds (routed
experts swapped out, so the parameters left are what the engine keeps on the device) and reads
off the counts the budget check uses: non-expert bytes, one expert's bytes, MoE layers, KV bytes
per token, and each decoder layer's full bytes (experts included, for the engines that place
whole layers). The real models' config.json files ship in `real_configs/` so this works on a
machine without their weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REAL_CONFIGS = Path(__file__).resolve().parent / "real_configs"


def real_config_path(name: str) -> Path:
    """The shipped config.json of a real model (`dsv2`, `qwen15moe`, `phi35moe`)."""
    path = REAL_CONFIGS / name / "config.json"
    if not path.exists():
        known = sorted(p.name for p in REAL_CONFIGS.iterdir() if (p / "config.json").exists())
        raise FileNotFoundError(f"no shipped config.json for {name!r}; shipped: {known}")
    return path


def load_config(path: Path | str, **overrides: Any):
    """A transformers config from a config.json (or a folder holding one), with field overrides."""
    from transformers import AutoConfig

    path = Path(path)
    data = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    data.update(overrides)
    model_type = data.pop("model_type")
    return AutoConfig.for_model(model_type, **data)


SHRINK = {  # what the KV probe may shrink: none of it shapes the attention or its cache
    "vocab_size": 64, "intermediate_size": 64, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "n_routed_experts": 4, "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": None,
}


def kv_bytes_per_token_config(config, itemsize: int) -> int:
    """KV-cache bytes one token adds across all layers, as the installed transformers caches them.

    Measured, like the engine's budget check (`specter.offload.budget.kv_bytes_per_token`: one token
    through the model, then the cache's bytes), on a one-layer float32 copy of the model with its real
    attention widths and everything else shrunk; scaled to the model's layers and `itemsize`. What a
    layer caches depends on the transformers version (DeepSeek-V2's MLA: the compressed latent
    [kv_lora + rope] in some releases, decompressed keys and values in others), so it is read off the
    library, never assumed. About a second on a CPU."""
    key = (config.to_json_string(use_diff=False), itemsize)
    if key not in _KV_PROBES:
        _KV_PROBES[key] = _probe_kv_bytes_per_token(config, itemsize)
    return _KV_PROBES[key]


_KV_PROBES: dict[tuple[str, int], int] = {}


def _probe_kv_bytes_per_token(config, itemsize: int) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from specter.models.compat import accept_cache_argument
    from specter.offload.budget import kv_bytes_per_token

    data = config.to_dict()
    shrink = {k: v for k, v in SHRINK.items() if k in data}
    model_type = data.pop("model_type")
    for per_layer_key in ("layer_types", "mlp_layer_types", "mlp_only_layers"):  # derived from the layer count
        data.pop(per_layer_key, None)
    data.update(shrink, num_hidden_layers=1)
    small = type(config).from_dict({**data, "model_type": model_type})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = accept_cache_argument(AutoModelForCausalLM.from_config(small, dtype=torch.float32).eval())
    per_layer_fp32 = kv_bytes_per_token(model, torch.device("cpu"), torch.float32)
    return int(config.num_hidden_layers) * per_layer_fp32 // 4 * itemsize


@dataclass(frozen=True)
class ModelFacts:
    """Counts and bytes of one model at one dtype, read from its config via the meta skeleton."""

    model_type: str
    dtype: torch.dtype
    hidden: int
    expert_inter: int
    vocab: int
    num_layers: int
    moe_layers: int
    num_experts: int
    top_k: int
    non_expert_bytes: int  # every device tensor of the offloaded model (routers kept in their own dtype)
    expert_bytes: int  # one routed expert (gate, up, down) in `dtype`
    kv_bytes_per_token: int  # all layers
    layer_bytes: tuple[int, ...]  # each decoder layer's parameters, routed experts included (dtype)
    head_bytes: int  # final norm + lm_head
    embed_bytes: int

    @property
    def full_bytes(self) -> int:
        """Every weight on the device: non-expert tensors plus every routed expert."""
        return self.non_expert_bytes + self.moe_layers * self.num_experts * self.expert_bytes


def model_facts(config, dtype: torch.dtype) -> ModelFacts:
    """Read a model's footprint facts from its config (meta tensors: milliseconds, no memory)."""
    from specter.models.loading import non_expert_bytes, offloaded_skeleton

    model, layout, E, experts = offloaded_skeleton(config, dtype)
    itemsize = torch.finfo(dtype).bits // 8
    eb = layout.nbytes
    layer_bytes = []
    for i, layer in enumerate(model.model.layers):
        own = sum(p.numel() * p.element_size() for p in layer.parameters())
        layer_bytes.append(own + (E * eb if i in experts else 0))
    head = sum(p.numel() * p.element_size() for p in model.lm_head.parameters())
    head += sum(p.numel() * p.element_size() for p in model.model.norm.parameters())
    embed = sum(p.numel() * p.element_size() for p in model.model.embed_tokens.parameters())
    return ModelFacts(
        model_type=config.model_type, dtype=dtype, hidden=layout.hidden, expert_inter=layout.intermediate,
        vocab=int(config.vocab_size), num_layers=int(config.num_hidden_layers), moe_layers=len(experts),
        num_experts=int(E), top_k=int(config.num_experts_per_tok), non_expert_bytes=non_expert_bytes(model),
        expert_bytes=eb, kv_bytes_per_token=kv_bytes_per_token_config(config, itemsize),
        layer_bytes=tuple(layer_bytes), head_bytes=head, embed_bytes=embed,
    )
