"""Validation of a composed run configuration, before any model or dataset is loaded."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from specter.assembly.config_error import ConfigError  # torch-free, so the row store and figures can raise it
from specter.datasets import DATASETS
from specter.kernels.select import KERNELS as DRAFT_KERNELS
from specter.models.loading import DTYPES
from specter.moe import SCHEDULES
from specter.offload.link import LINK_KINDS
from specter.offload.policy import RESIDENCIES
from specter.predict.planner import POLICIES
from specter.quant.draft import QUANT_METHODS
from specter.speculative.engine import PLANNER_STATES

if TYPE_CHECKING:
    from specter.models.facts import CheckpointFacts

SEED_LIMIT = 2**31  # record_seed's modulus


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
    _protocol(cfg)
    _sampling(cfg)
    for name in str(cfg.dataset.name).split(","):  # one name, 'all', or a comma list ('c4,humaneval')
        _choice("dataset.name", name.strip(), (*DATASETS, "all"))
    _hardware(cfg)
    _model_draft(cfg)
    _method_settings(cfg)
    _names(cfg)
    _method_values(cfg)
    from specter.assembly.runners import runner_problem

    m = cfg.method
    problem = runner_problem(m.name, m.get("runner"))
    _require(problem is None, problem or "")
    _runner_identity(m.name, m.get("runner"))


def _protocol(cfg: DictConfig) -> None:
    """Counts, the seed, and the lengths that must fit the model's context (K+1 speculative positions included)."""
    _int(cfg, "num_prompts", 1)
    _int(cfg, "repeats", 1)
    _int(cfg, "max_new_tokens", 1)
    _int(cfg, "prefix_tokens", 1)
    _int(cfg, "warmup_tokens", 0)
    _int(cfg, "seed", 0)
    # record_seed() folds the base seed with a per-record offset mod 2**31: a larger base would give the
    # per-record seeds of a smaller one without a word, so it is refused instead
    _require(cfg.seed < SEED_LIMIT, f"seed must be below 2**31 = {SEED_LIMIT} (per-record seeds are 31-bit), "
             f"got {cfg.seed}")
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
    _require(cfg.prefix_tokens + cfg.warmup_tokens + extra <= ctx,
             f"prefix_tokens + warmup_tokens (+ K+1 speculative positions) = "
             f"{cfg.prefix_tokens + cfg.warmup_tokens + extra} exceeds {cfg.model.name}'s context ({ctx})")


def _sampling(cfg: DictConfig) -> None:
    _require(math.isfinite(cfg.temperature) and cfg.temperature >= 0,
             f"temperature must be a finite number >= 0, got {cfg.temperature}")
    _require(math.isfinite(cfg.top_p) and 0 < cfg.top_p <= 1, f"top_p must be in (0, 1], got {cfg.top_p}")
    _require(cfg.top_k >= 0, f"top_k must be >= 0 (0 = off), got {cfg.top_k}")


def _hardware(cfg: DictConfig) -> None:
    """The link, dtype, kernel and device, and the numbers that time an emulated link."""
    _choice("hardware.link", cfg.hardware.link, LINK_KINDS)
    _choice("hardware.dtype", cfg.hardware.dtype, tuple(DTYPES))
    _choice("hardware.draft_kernel", cfg.hardware.get("draft_kernel", "auto"), ("auto", *DRAFT_KERNELS))
    hw = cfg.hardware
    _device(hw.device)
    _require(hw.threads is None or hw.threads >= 1, f"hardware.threads must be >= 1 (or null), got {hw.threads}")
    _require(hw.bandwidth_gbps is None or hw.bandwidth_gbps > 0,
             f"hardware.bandwidth_gbps must be > 0 (or null to calibrate), got {hw.bandwidth_gbps}")
    _require(hw.latency_us is None or hw.latency_us >= 0, f"hardware.latency_us must be >= 0, got {hw.latency_us}")


def _model_draft(cfg: DictConfig) -> None:
    """The model's load ratio and draft precision; an emulated link with no bandwidth needs the ratio."""
    hw = cfg.hardware
    ratio = cfg.model.get("load_ratio")
    _require(ratio is None or (isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and math.isfinite(ratio)
                               and ratio > 0),
             f"model.load_ratio must be a finite number > 0 (or null: from the cost model), got {ratio}")
    bits, gs = cfg.model.get("draft_bits", 4), cfg.model.get("draft_group_size", 128)
    _require(bits in (2, 3, 4), f"model.draft_bits must be 2, 3 or 4 (the INT4 layout holds them all), got {bits!r}")
    _require(isinstance(gs, int) and gs >= 8 and gs % 8 == 0,
             f"model.draft_group_size must be a multiple of 8, got {gs!r}")
    if hw.link == "emulated" and hw.bandwidth_gbps is None:
        load_ratio_of(cfg)  # a ratio the cost model cannot give is refused before any model loads
    _require(hw.get("load_ratio_tolerance", 0.25) > 0,
             f"hardware.load_ratio_tolerance must be > 0 (relative), got {hw.get('load_ratio_tolerance')}")
    _require(hw.get("ratio_probe_steps", 0) >= 0, f"hardware.ratio_probe_steps must be >= 0, got {hw.get('ratio_probe_steps')}")


def _method_settings(cfg: DictConfig) -> None:
    """The memory budget against the method's schedule, and the method's own choices."""
    budget = cfg.memory.budget_mb
    _require(budget is None or budget > 0, f"memory.budget_mb must be > 0 (or null for the tier's budget), got {budget}")
    m = cfg.method
    # methods without an offloading schedule (schema.OffloadMethodConfig) keep every weight on the device
    _require(budget is None or "schedule" in m,
             f"{m.name} keeps every weight on the device and does not apply a memory budget; drop "
             "memory.budget_mb, or use an offloading method (offload_ar, specter)")
    for key, choices in (("prefetch", POLICIES), ("schedule", SCHEDULES), ("quant", QUANT_METHODS),
                         ("planner_state", PLANNER_STATES), ("residency", RESIDENCIES)):
        if m.get(key) is not None:
            _choice(f"method.{key}", m.get(key), choices)
    if m.get("calibration_prompts") is not None:
        _int(cfg, "method.calibration_prompts", 1)
    if cfg.verify_lossless and cfg.temperature > 0:
        raise ConfigError("verify_lossless compares against greedy target-only decoding: it needs temperature=0")


def _runner_identity(name: str, runner: Any) -> None:
    """A method's identity is its runner: `method=specter method.runner=<TargetOnly>` would save
    target-only records as `method=specter`. A name with a method file under conf/method/ takes that
    file's runner only; another runner must come with a new `method.name`."""
    from specter.assembly.compose import CONF_DIR

    path = CONF_DIR / "method" / f"{name}.yaml"
    if not path.is_file():
        return
    registered = OmegaConf.load(path).get("runner")
    _require(registered is None or str(runner) == str(registered),
             f"method.runner={runner} is not the runner of method {name!r} ({registered}): records would be saved "
             f"under the wrong name; drop method.runner, or name the new method (method.name=...)")


def _device(value: Any) -> None:
    """hardware.device as torch reads it: cpu, cuda or cuda:<index>."""
    import torch

    try:
        kind = torch.device(str(value)).type
    except (RuntimeError, TypeError, ValueError):
        kind = None
    _require(kind in ("cpu", "cuda"), f"hardware.device must be cpu, cuda or cuda:<index>, got {value!r}")


def _names(cfg: DictConfig) -> None:
    """Configured names that become file or folder names (caches, run folders) obey one rule."""
    from specter.paths import UnsafeName, safe_name

    try:
        for group in ("model", "method", "memory", "hardware"):
            safe_name(cfg[group].get("name"), f"{group}.name")
        for method in (cfg.get("compare") or {}).get("methods") or ():
            safe_name(method, "compare.methods entry")
    except UnsafeName as err:
        raise ConfigError(str(err)) from None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _method_values(cfg: DictConfig) -> None:
    """Method settings with a range, checked before anything loads."""
    import dataclasses

    from specter.predict.planner import PlannerConfig

    m = cfg.method
    tol = cfg.get("lossless_tie_tolerance", 0.0)
    _require(_number(tol) and tol >= 0, f"lossless_tie_tolerance must be a number >= 0, got {tol!r}")
    planner = m.get("planner")
    if planner:
        known = {f.name for f in dataclasses.fields(PlannerConfig)}
        unknown = sorted(set(planner) - known)
        _require(not unknown, f"unknown method.planner key(s) {unknown}; choose from {sorted(known)}")
        bad = [k for k, v in planner.items() if not _number(v)]
        _require(not bad, f"method.planner.{bad[0] if bad else ''} must be a number")
        try:
            PlannerConfig(**{k: float(v) for k, v in planner.items()})
        except ValueError as err:
            raise ConfigError(f"method.planner: {err}") from None
    if m.get("staging_per_layer") is not None:
        v = m.staging_per_layer
        _require(_number(v) and v >= 0, f"method.staging_per_layer must be a number >= 0, got {v!r}")
    if m.get("staging_buffers") is not None:
        _int(cfg, "method.staging_buffers", 0)
    residents = m.get("residents")
    if isinstance(residents, DictConfig):
        for tier, n in residents.items():
            _require(isinstance(n, int) and not isinstance(n, bool) and n >= 1,
                     f"method.residents.{tier} must be an integer >= 1, got {n!r}")
    elif residents is not None:
        _int(cfg, "method.residents", 1)
    for key, minimum in (("n_batch", 1), ("n_threads", 1)):
        if m.get(key) is not None:
            _int(cfg, f"method.{key}", minimum)
    if m.get("experts_implementation") is not None:
        _choice("method.experts_implementation", m.experts_implementation, ("eager", "batched_mm", "grouped_mm"))
    if m.get("startup_timeout_s") is not None:
        v = m.startup_timeout_s
        _require(_number(v) and v > 0, f"method.startup_timeout_s must be > 0, got {v!r}")


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    _require(value in choices, f"unknown {key} {value!r}; choose one of {list(choices)}")


def load_ratio_of(cfg: DictConfig) -> tuple[float, str]:
    """The emulated link's load ratio and where it comes from: `model.load_ratio` when set, else the
    cost model of the real model this one stands for (`model.real`, or the model itself) on the
    device file `hardware.device_model` (`specter.projection.link_ratio`)."""
    stated = cfg.model.get("load_ratio")
    if stated is not None:
        return float(stated), "model.load_ratio (set)"
    from specter.projection.link_ratio import DEFAULT_DEVICE, link_ratio

    real = cfg.model.get("real") or cfg.model.name
    device = cfg.hardware.get("device_model") or DEFAULT_DEVICE
    try:
        lr = link_ratio(str(real), str(device))
    except (FileNotFoundError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"model.load_ratio=null takes the ratio from the cost model of {real} on "
                          f"hardware.device_model={device}, which failed: {err}; set model.load_ratio=<r>") from None
    return lr.ratio, lr.source


def effective_K(cfg: DictConfig) -> int:
    """Speculation depth: the top-level `K=` override, else the model config's K."""
    K: Any = cfg.get("K")
    if K is None and cfg.get("k_profile"):
        K = profiled_k_of(cfg)
    if K is None:
        K = cfg.model.get("K", 1)
    _require(isinstance(K, int) and not isinstance(K, bool) and K >= 1, f"K must be an integer >= 1, got {K!r}")
    return K


def resident_experts(cfg: DictConfig, stated_experts: bool = True) -> int:
    """Resident experts per MoE layer (M): `memory.resident_experts` if given, else the model's tier.

    `stated_experts=False` skips the M <= E check while `model.num_experts` is only what the user
    stated (before the checkpoint is read): a wrong E is the checkpoint's to refuse, by its own name."""
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
    E = cfg.model.get("num_experts") if stated_experts else None  # null until the checkpoint is read (bind_checkpoint)
    _require(E is None or M <= E, f"resident_experts={M} exceeds {cfg.model.name}'s {E} routed experts")
    return M


# Run-config keys that state a checkpoint fact: (model.<key>, CheckpointFacts field).
CHECKPOINT_FACT_KEYS = (("num_experts", "num_experts"), ("top_k", "top_k"))


def bind_checkpoint(cfg: DictConfig, checkpoint: Any) -> CheckpointFacts:
    """Check the run config against the checkpoint's own facts and fill in the ones it leaves null.

    `model.num_experts` / `model.top_k` belong to the checkpoint: null takes its value, a stated value
    that contradicts it is refused in one message. The run's longest sequence must fit the
    checkpoint's positions. Returns the checkpoint's `CheckpointFacts`."""
    from pathlib import Path

    from omegaconf import open_dict

    from specter.models.facts import CheckpointFactsError, read_facts

    where = Path(checkpoint).resolve() / "config.json"
    try:
        facts = read_facts(Path(checkpoint))
    except CheckpointFactsError as err:
        raise ConfigError(str(err)) from None
    wrong = []
    for key, field in CHECKPOINT_FACT_KEYS:
        stated = cfg.model.get(key)
        if stated is not None and stated != getattr(facts, field):
            wrong.append(f"model.{key}={stated} (the checkpoint has {getattr(facts, field)})")
    _require(1 <= facts.top_k <= facts.num_experts,
             f"the checkpoint {where} routes each token to num_experts_per_tok={facts.top_k} experts but has "
             f"{facts.num_experts} routed experts per layer: its config.json is inconsistent")
    if wrong:
        raise ConfigError(f"{' and '.join(wrong)} contradicts the checkpoint {where}. These facts come from the "
                          f"checkpoint's config: drop the override, or set it to the checkpoint's value.")
    longest = cfg.prefix_tokens + cfg.max_new_tokens + (effective_K(cfg) + 1 if cfg.method.get("speculative") else 0)
    _require(longest <= facts.max_position_embeddings,
             f"prefix_tokens + max_new_tokens (+ K+1 speculative positions) = {longest} exceeds the "
             f"{facts.max_position_embeddings} positions of the checkpoint {where}")
    with open_dict(cfg):
        for key, field in CHECKPOINT_FACT_KEYS:
            cfg.model[key] = getattr(facts, field)
    resident_experts(cfg)  # the tier's M against the checkpoint's expert count
    return facts


def profiled_k_of(cfg: DictConfig) -> int:
    """The K a `k_profile=` file chose (it exists, parses, was measured on this model, K is usable)."""
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
    _require_same_link(cfg, path, profile)
    return K


PROFILE_RATIO_TOLERANCE = 0.05  # a K chosen at another link cost is another machine's K


def _require_same_link(cfg: DictConfig, path, profile: dict) -> None:
    """A K profiled on the emulated link holds only at the load ratio it was measured at: the best window
    length grows with the cost of a load. A profile that predates the recorded ratio is used as given."""
    profiled = profile.get("load_ratio")
    if cfg.hardware.get("link") != "emulated" or profiled is None:
        return
    ratio, source = load_ratio_of(cfg)
    if not isinstance(profiled, (int, float)) or isinstance(profiled, bool) or profiled <= 0:
        raise ConfigError(f"k_profile={path} records an unusable load_ratio={profiled!r}; run experiment=k_sweep again")
    if abs(profiled / ratio - 1) > PROFILE_RATIO_TOLERANCE:
        raise ConfigError(f"k_profile={path} was profiled at load ratio {profiled:.3g}, but this run emulates "
                          f"{ratio:.3g} ({source}); profile K at this ratio (experiment=k_sweep) or give K=")


def check_composed(cfg: DictConfig) -> None:
    """What every experiment needs of the composed config, before it starts: no key outside the
    typed schema (a `+key=` addition is a typo that would be saved and never used), a non-empty
    method list, an output folder whose every name fits the file system, a usable $SPECTER_HOME."""
    unknown = unknown_keys(cfg)
    _require(not unknown, f"unknown setting(s) {unknown}: not in the configuration schema "
             "(specter/assembly/schema.py); check the spelling (`python run.py --cfg job` lists every key)")
    compare = cfg.get("compare")
    if isinstance(compare, DictConfig) and "methods" in compare:
        methods = compare.methods
        _require(OmegaConf.is_list(methods) and len(methods) > 0,
                 f"compare.methods must list at least one method, got {OmegaConf.to_container(methods) if OmegaConf.is_config(methods) else methods!r}")
    check_output_dir(cfg.get("output_dir"))
    check_home()
    if cfg.get("experiment") == "project":
        check_project(cfg)


def check_project(cfg: DictConfig) -> None:
    """experiment=project's counts: its warm-up always runs (a negative one never ended), so every
    count is at least 1, and new_tokens at least 2 (a TPOT needs two commits)."""
    for key, minimum in (("prompts", 1), ("new_tokens", 2), ("warmup_tokens", 1), ("tokens", 1),
                         ("timeline_window", 0)):
        _int(cfg, f"project.{key}", minimum)


def unknown_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Keys of `cfg` that no schema dataclass declares (free-form dict fields such as
    model.tiers or method.planner are open by design and are not walked)."""
    import dataclasses

    out: list[str] = []
    kind = OmegaConf.get_type(cfg)
    fields = {f.name for f in dataclasses.fields(kind)} if dataclasses.is_dataclass(kind) else None
    for key in cfg.keys():
        if fields is not None and key not in fields and key != "hydra":
            out.append(f"{prefix}{key}")
            continue
        if fields is None or OmegaConf.is_missing(cfg, key) or OmegaConf.is_interpolation(cfg, key):
            continue
        node = cfg[key]
        if isinstance(node, DictConfig):  # None-valued groups are plain None here
            out += unknown_keys(node, f"{prefix}{key}.")
    return out


# The longest file name a folder holds (bytes); 255 on every file system Specter runs on.
NAME_MAX = 255


def check_output_dir(value: Any) -> None:
    from pathlib import Path

    if value is None:
        return
    for part in Path(str(value)).parts:
        _require(len(part.encode("utf-8", errors="surrogateescape")) <= NAME_MAX,
                 f"output_dir has a folder name of {len(part.encode('utf-8', errors='surrogateescape'))} bytes "
                 f"({part[:24]}...): a file system allows at most {NAME_MAX}; choose a shorter output_dir")


def check_home() -> None:
    """$SPECTER_HOME (tiny models, drafts, calibrations) must be a folder, or not exist yet."""
    from specter.paths import specter_home

    home = specter_home()
    _require(not home.exists() or home.is_dir(),
             f"SPECTER_HOME={home} is a file, not a folder: point it at a folder (or unset it for ~/.cache/specter)")
    if not home.exists():
        parent = next((p for p in home.parents if p.exists()), None)
        _require(parent is None or parent.is_dir(),
                 f"SPECTER_HOME={home} lies under {parent}, which is a file, not a folder")
