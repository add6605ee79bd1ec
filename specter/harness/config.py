"""Validation of a composed run configuration, before any model or dataset is loaded."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

DATASET_CHOICES = ("c4", "wikitext2", "humaneval", "gsm8k", "gpqa", "all")
PREFETCH_CHOICES = ("adaptive", "none", "early", "late", "oracle")


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _int(cfg: DictConfig, key: str, minimum: int) -> int:
    value = OmegaConf.select(cfg, key)
    _require(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        f"{key} must be an integer >= {minimum}, got {value!r}",
    )
    return value


def validate(cfg: DictConfig) -> None:
    """Reject impossible settings with a message naming the key; never touches the model."""
    missing = OmegaConf.missing_keys(cfg)
    _require(not missing, f"required settings are missing: {sorted(missing)}")
    for group in ("model", "memory", "dataset", "method", "hardware"):
        _require(isinstance(cfg.get(group), DictConfig), f"config group '{group}' is not selected")
    _int(cfg, "num_prompts", 1)
    _int(cfg, "repeats", 1)
    _int(cfg, "max_new_tokens", 1)
    _int(cfg, "prefix_tokens", 1)
    _int(cfg, "warmup_tokens", 0)
    _int(cfg, "seed", 0)
    ctx = cfg.model.context_length
    _require(
        cfg.prefix_tokens <= ctx,
        f"prefix_tokens={cfg.prefix_tokens} is longer than {cfg.model.name}'s context ({ctx} tokens)",
    )
    K = effective_K(cfg)
    extra = K + 1 if cfg.method.get("speculative") else 0
    _require(
        cfg.prefix_tokens + cfg.max_new_tokens + extra <= ctx,
        f"prefix_tokens + max_new_tokens (+ K+1 speculative positions) = "
        f"{cfg.prefix_tokens + cfg.max_new_tokens + extra} exceeds {cfg.model.name}'s context ({ctx})",
    )
    _require(cfg.temperature >= 0, f"temperature must be >= 0, got {cfg.temperature}")
    _require(0 < cfg.top_p <= 1, f"top_p must be in (0, 1], got {cfg.top_p}")
    _require(cfg.top_k >= 0, f"top_k must be >= 0 (0 = off), got {cfg.top_k}")
    _require(
        cfg.dataset.name in DATASET_CHOICES,
        f"unknown dataset {cfg.dataset.name!r}; choose one of {list(DATASET_CHOICES)}",
    )
    _require(cfg.hardware.link in ("cpu", "emulated", "cuda"), f"unknown hardware link {cfg.hardware.link!r}")
    prefetch = cfg.method.get("prefetch")
    if prefetch is not None:
        _require(prefetch in PREFETCH_CHOICES, f"unknown prefetch policy {prefetch!r}; choose one of {list(PREFETCH_CHOICES)}")
    if cfg.verify_lossless and cfg.temperature > 0:
        raise ConfigError("verify_lossless compares against greedy target-only decoding: it needs temperature=0")


def effective_K(cfg: DictConfig) -> int:
    """Speculation depth: the top-level `K=` override, else the model config's K."""
    K: Any = cfg.get("K")
    if K is None and cfg.get("k_profile"):
        K = _profiled_K(cfg)
    if K is None:
        K = cfg.model.get("K", 1)
    _require(isinstance(K, int) and not isinstance(K, bool) and K >= 1, f"K must be an integer >= 1, got {K!r}")
    return K


def resident_experts(cfg: DictConfig) -> int:
    """Resident experts per MoE layer (M) for the model and memory tier."""
    override = cfg.memory.get("resident_experts")
    if override is not None:
        M = int(override)
    else:
        key = cfg.model.get("real") or cfg.model.name
        fractions = cfg.memory.resident_fraction
        _require(key in fractions, f"memory tier {cfg.memory.name!r} has no resident fraction for {key!r}")
        M = max(1, round(fractions[key] * cfg.model.num_experts))
    _require(M >= 1, f"memory tier {cfg.memory.name!r} leaves no expert slot per layer for {cfg.model.name}")
    _require(
        M <= cfg.model.num_experts,
        f"resident_experts={M} exceeds {cfg.model.name}'s {cfg.model.num_experts} routed experts",
    )
    return M


def _profiled_K(cfg: DictConfig) -> int:
    import json
    from pathlib import Path

    path = Path(cfg.k_profile)
    if not path.exists():
        raise ConfigError(f"k_profile={path} does not exist; run experiment=k_sweep first")
    try:
        profile = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"k_profile={path} is not valid JSON ({err})") from None
    if profile.get("model") != cfg.model.name:
        raise ConfigError(f"k_profile={path} was measured for {profile.get('model')!r}, not {cfg.model.name!r}")
    return profile["K"]
