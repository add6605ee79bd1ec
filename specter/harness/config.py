"""Validation of a composed run configuration, before any model or dataset is loaded."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from specter.harness.datasets import DATASETS
from specter.kernels.select import KERNELS as DRAFT_KERNELS
from specter.models.loading import DTYPES
from specter.moe import SCHEDULES
from specter.offload.link import LINK_KINDS
from specter.predict.planner import POLICIES
from specter.quant.draft import QUANT_METHODS
from specter.speculative.engine import PLANNER_STATES



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
    K = effective_K(cfg)  # validates K / k_profile for every method
    extra = K + 1 if cfg.method.get("speculative") else 0
    _require(
        cfg.prefix_tokens + cfg.max_new_tokens + extra <= ctx,
        f"prefix_tokens + max_new_tokens (+ K+1 speculative positions) = "
        f"{cfg.prefix_tokens + cfg.max_new_tokens + extra} exceeds {cfg.model.name}'s context ({ctx})",
    )
    _require(cfg.temperature >= 0, f"temperature must be >= 0, got {cfg.temperature}")
    _require(0 < cfg.top_p <= 1, f"top_p must be in (0, 1], got {cfg.top_p}")
    _require(cfg.top_k >= 0, f"top_k must be >= 0 (0 = off), got {cfg.top_k}")
    for name in str(cfg.dataset.name).split(","):  # one name, 'all', or a comma list ('c4,humaneval')
        _choice("dataset.name", name.strip(), (*DATASETS, "all"))
    _choice("hardware.link", cfg.hardware.link, LINK_KINDS)
    _choice("hardware.dtype", cfg.hardware.dtype, tuple(DTYPES))
    _choice("hardware.draft_kernel", cfg.hardware.get("draft_kernel", "auto"), ("auto", *DRAFT_KERNELS))
    hw = cfg.hardware
    _require(hw.threads is None or hw.threads >= 1, f"hardware.threads must be >= 1 (or null), got {hw.threads}")
    _require(hw.bandwidth_gbps is None or hw.bandwidth_gbps > 0,
             f"hardware.bandwidth_gbps must be > 0 (or null to calibrate), got {hw.bandwidth_gbps}")
    _require(hw.latency_us is None or hw.latency_us >= 0, f"hardware.latency_us must be >= 0, got {hw.latency_us}")
    _require(cfg.model.load_ratio > 0, f"model.load_ratio must be > 0, got {cfg.model.load_ratio}")
    _require(hw.get("load_ratio_tolerance", 0.25) > 0,
             f"hardware.load_ratio_tolerance must be > 0 (relative), got {hw.get('load_ratio_tolerance')}")
    _require(hw.get("ratio_probe_steps", 0) >= 0, f"hardware.ratio_probe_steps must be >= 0, got {hw.get('ratio_probe_steps')}")
    budget = cfg.memory.budget_mb
    _require(budget is None or budget > 0, f"memory.budget_mb must be > 0 (or null for the tier's budget), got {budget}")
    m = cfg.method
    # methods without an offloading schedule (schema.OffloadMethodConfig) keep every weight on the device
    _require(budget is None or "schedule" in m,
             f"{m.name} keeps every weight on the device and does not apply a memory budget; drop "
             "memory.budget_mb, or use an offloading method (offload_ar, specter)")
    for key, choices in (("prefetch", POLICIES), ("schedule", SCHEDULES), ("quant", QUANT_METHODS),
                         ("planner_state", PLANNER_STATES)):
        if m.get(key) is not None:
            _choice(f"method.{key}", m.get(key), choices)
    if m.get("calibration_prompts") is not None:
        _int(cfg, "method.calibration_prompts", 1)
    if cfg.verify_lossless and cfg.temperature > 0:
        raise ConfigError("verify_lossless compares against greedy target-only decoding: it needs temperature=0")


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    _require(value in choices, f"unknown {key} {value!r}; choose one of {list(choices)}")


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
    """Resident experts per MoE layer (M): `memory.resident_experts` if given, else the model's tier."""
    override = cfg.memory.get("resident_experts")
    if override is not None:
        M = override
    else:
        tiers = cfg.model.get("tiers") or {}
        _require(cfg.memory.name in tiers,
                 f"{cfg.model.name} defines no memory tier {cfg.memory.name!r} (it has {sorted(tiers)})")
        M = tiers[cfg.memory.name].resident_experts
    _require(isinstance(M, int) and not isinstance(M, bool),
             f"memory.resident_experts must be an integer, got {M!r}")
    _require(M >= 1, f"memory tier {cfg.memory.name!r} leaves no expert slot per layer for {cfg.model.name} (M={M})")
    _require(
        M <= cfg.model.num_experts,
        f"resident_experts={M} exceeds {cfg.model.name}'s {cfg.model.num_experts} routed experts",
    )
    return M


def _profiled_K(cfg: DictConfig) -> int:
    import json
    from pathlib import Path

    path = Path(cfg.k_profile)
    if not path.is_file():
        raise ConfigError(f"k_profile={path} does not exist; run experiment=k_sweep first")
    try:
        profile = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"k_profile={path} cannot be read ({err})") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"k_profile={path} is not valid JSON ({err})") from None
    if not isinstance(profile, dict):
        raise ConfigError(f"k_profile={path} holds a {type(profile).__name__}, not the JSON object "
                          "experiment=k_sweep writes")
    if profile.get("model") != cfg.model.name:
        raise ConfigError(f"k_profile={path} was measured for {profile.get('model')!r}, not {cfg.model.name!r}")
    K = profile.get("K")
    if not isinstance(K, int) or isinstance(K, bool) or K < 1:
        raise ConfigError(f"k_profile={path} has no usable K (K={K!r}); run experiment=k_sweep again")
    return K
