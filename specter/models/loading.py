"""Load a checkpoint with its routed experts in the host store and everything else on the device.

The model skeleton is built with empty (meta) parameters; non-expert tensors are read from the
safetensors files and assigned on the device, routed-expert tensors are read straight into the
`HostExpertStore` (never materialised as the fused `[E, 2I, H]` parameters). Each MoE block's
experts module is swapped for `SpecterExperts`; routers and shared experts stay untouched.
A missing, unexpected or mis-shaped tensor is an error, never skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from specter.models.arch import MoEArch, arch_for, moe_blocks
from specter.models.compat import accept_cache_argument
from specter.moe import SpecterExperts
from specter.offload.store import ExpertLayout, ExpertUID, HostExpertStore, IncompleteStore


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def load_full_model(checkpoint: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The plain transformers model, every weight on the device (HF's eager experts loop)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, experts_implementation="eager")
    return accept_cache_argument(model.to(device).eval())


class WeightError(RuntimeError):
    """The checkpoint does not match the architecture (missing, unexpected or mis-shaped tensors)."""


@dataclass
class OffloadedModel:
    model: torch.nn.Module  # HF model; MoE blocks' experts are SpecterExperts
    store: HostExpertStore  # routed target experts, host memory
    arch: MoEArch
    experts: dict[int, SpecterExperts]  # MoE layer -> its experts module
    top_k: int

    @property
    def moe_layers(self) -> list[int]:
        return sorted(self.experts)

    @property
    def num_experts(self) -> int:
        return self.store.num_experts


def _safetensors_files(checkpoint: Path) -> list[Path]:
    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        raise WeightError(f"no *.safetensors files in {checkpoint}")
    return files


def offloaded_skeleton(config, dtype: torch.dtype) -> tuple[torch.nn.Module, ExpertLayout, int, dict[int, SpecterExperts]]:
    """The model as `load_offloaded` builds it before reading weights: parameters on the meta device
    (shapes and dtypes only, no memory), buffers real, each MoE block's routed experts swapped for
    `SpecterExperts`. Returns (model, one expert's layout, routed experts per layer, layer -> experts).
    Also what the memory plan counts, so both read the same tensors."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):  # parameters on meta, buffers (rotary) real
        model = accept_cache_argument(AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                                       experts_implementation="eager"))
    blocks = moe_blocks(model)
    first = next(iter(blocks.values())).experts
    E, two_i, H = first.gate_up_proj.shape  # [E, 2I, H]
    experts = {}
    for layer, block in blocks.items():
        experts[layer] = SpecterExperts(layer, block.experts.act_fn)
        block.experts = experts[layer]
    return model, ExpertLayout(H, two_i // 2, dtype), E, experts


def load_offloaded(
    checkpoint: Path, device: torch.device, dtype: torch.dtype, pin_memory: bool = False
) -> OffloadedModel:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)
    arch = arch_for(config.model_type)
    model, layout, E, experts = offloaded_skeleton(config, dtype)
    blocks = moe_blocks(model)
    store = HostExpertStore(layout, sorted(blocks), E, pin_memory=pin_memory)

    expected = {k: v for k, v in model.state_dict().items()}  # meta tensors: shapes and dtypes
    state: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(checkpoint):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                parsed = arch.parse_expert_key(key)
                if parsed is not None:
                    layer, e, part = parsed
                    if layer not in blocks or e >= E:
                        raise WeightError(f"{file.name}: expert tensor {key} has no place in the model")
                    store.write_part(ExpertUID(layer, e), part, f.get_tensor(key).to(dtype))
                    continue
                name = arch.module_key(key)
                if name not in expected:
                    raise WeightError(f"{file.name}: unexpected tensor {key} (as {name})")
                tensor = f.get_tensor(key)
                if tuple(tensor.shape) != tuple(expected[name].shape):
                    raise WeightError(f"{key}: shape {tuple(tensor.shape)} != expected {tuple(expected[name].shape)}")
                state[name] = tensor.to(device=device, dtype=expected[name].dtype)  # keeps fp32 routers fp32
    try:
        store.assert_complete()
    except IncompleteStore as err:
        raise WeightError(f"{checkpoint}: {err}") from None
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = sorted(set(expected) - set(state))
    if missing:
        raise WeightError(f"checkpoint {checkpoint} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)  # buffers (rotary tables); parameters are already there
    leftover = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if leftover:
        raise WeightError(f"parameters never loaded: {leftover[:3]}")
    return OffloadedModel(model.eval(), store, arch, experts, top_k=config.num_experts_per_tok)


def non_expert_bytes(model: torch.nn.Module) -> int:
    """Device bytes of every parameter and buffer (routed experts are not parameters here).

    Shared tensors count once: by storage on a real device, by object on the meta device (where
    every tensor reports the same null address), so a meta skeleton counts what a loaded model holds."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = ("object", id(t)) if t.device.type == "meta" else ("storage", t.data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
