"""What a checkpoint is, read from its own config: expert count, top-k, depth, routing and rope switches.

These facts belong to the checkpoint, not to the run configuration: a model file under conf/model
may leave them null (read here) or state them, and a stated value that contradicts the checkpoint
is refused (`specter.assembly.config.bind_checkpoint`). Presets measured on one checkpoint
(MO-SM's slot counts) name the facts of that checkpoint and apply only where they all match.

The config is read through transformers' own config class (`AutoConfig`), so a key the file leaves
out takes the value transformers builds the model with, not a guess.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The transformers model_type of each real model's checkpoint (tiny models mirror theirs: `model.real`).
MODEL_TYPES = {"dsv2": "deepseek_v2", "qwen15moe": "qwen2_moe", "phi35moe": "phimoe"}

# Config attribute holding the routed-expert count, per architecture.
_EXPERT_KEYS = {"deepseek_v2": "n_routed_experts", "qwen2_moe": "num_experts", "phimoe": "num_local_experts"}


class CheckpointFactsError(RuntimeError):
    """The checkpoint's config cannot be read, or describes no supported MoE architecture."""


@dataclass(frozen=True)
class CheckpointFacts:
    """One checkpoint's architecture facts (from its config.json, with transformers' defaults)."""

    model_type: str  # deepseek_v2 | qwen2_moe | phimoe
    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts each token is routed to
    num_layers: int  # decoder layers
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    norm_topk_prob: bool | None  # the top-k weights renormalised to sum to 1 (None: the architecture has no switch)
    q_lora_rank: int | None  # DeepSeek-V2: low-rank query projection (None: a plain q_proj, as in DeepSeek-V2-Lite)
    rope_type: str  # default | yarn | longrope | linear | ...
    rope_factor: float | None  # the rope scaling factor (None without scaling)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def mismatches(self, wanted: Mapping[str, Any]) -> list[str]:
        """`key: wanted != actual` for every fact in `wanted` this checkpoint does not have (unknown keys too)."""
        have = self.as_dict()
        out = []
        for key, value in wanted.items():
            if key not in have:
                out.append(f"{key}: not a checkpoint fact (known: {', '.join(have)})")
            elif have[key] != value:
                out.append(f"{key}: {value!r} != {have[key]!r}")
        return out

    def matches(self, wanted: Mapping[str, Any]) -> bool:
        return not self.mismatches(wanted)


def rope_settings(config: Any) -> dict[str, Any]:
    """Rope settings in one dict: transformers 5's `rope_parameters`, or 4.x `rope_theta` + `rope_scaling`."""
    get = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
    rope = dict(get("rope_parameters") or get("rope_scaling") or {})
    if get("rope_theta") is not None:
        rope.setdefault("rope_theta", get("rope_theta"))
    rope.setdefault("rope_theta", 10000.0)
    rope.setdefault("rope_type", rope.get("type", "default"))
    if "original_max_position_embeddings" not in rope and get("original_max_position_embeddings"):
        rope["original_max_position_embeddings"] = get("original_max_position_embeddings")
    return rope


def facts_from_config(config: Any) -> CheckpointFacts:
    """The facts of a transformers config object (or its `to_dict()`)."""
    get = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
    model_type = get("model_type")
    if model_type not in _EXPERT_KEYS:
        raise CheckpointFactsError(f"model_type={model_type!r} is not a supported MoE architecture "
                                   f"(supported: {', '.join(sorted(_EXPERT_KEYS))})")
    def need(key: str) -> int:
        value = get(key)
        if value is None:
            raise CheckpointFactsError(f"the {model_type} config sets no {key} (nor does transformers default it)")
        return int(value)

    rope = rope_settings(config)
    scaled = rope["rope_type"] not in ("default", None)
    norm = get("norm_topk_prob") if model_type != "phimoe" else None
    q_lora = get("q_lora_rank") if model_type == "deepseek_v2" else None
    return CheckpointFacts(
        model_type=model_type,
        num_experts=need(_EXPERT_KEYS[model_type]),
        top_k=need("num_experts_per_tok"),
        num_layers=need("num_hidden_layers"),
        hidden_size=need("hidden_size"),
        vocab_size=need("vocab_size"),
        max_position_embeddings=need("max_position_embeddings"),
        norm_topk_prob=None if norm is None else bool(norm),
        q_lora_rank=int(q_lora) if q_lora else None,
        rope_type=str(rope["rope_type"]),
        rope_factor=float(rope["factor"]) if scaled and rope.get("factor") is not None else None,
    )


def read_config(checkpoint: Path) -> Any:
    """The checkpoint's transformers config (every attribute, defaults included)."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise CheckpointFactsError(f"{checkpoint.resolve()} has no config.json")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(checkpoint)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointFactsError(f"{(checkpoint / 'config.json').resolve()} cannot be read: {err}") from None


def read_facts(checkpoint: Path) -> CheckpointFacts:
    """The facts of the checkpoint in `checkpoint` (a folder holding config.json)."""
    return facts_from_config(read_config(checkpoint))


def matching_preset(presets: Any, facts: CheckpointFacts) -> tuple[int, Any] | None:
    """(index, preset) of the first preset whose `checkpoint` facts all match `facts`, else None.

    A preset naming no facts matches nothing (a preset must say which checkpoint it was measured on)."""
    for i, preset in enumerate(presets or []):
        wanted = dict(preset.get("checkpoint") or {}) if isinstance(preset, Mapping) else {}
        if wanted and facts.matches(wanted):
            return i, preset
    return None
