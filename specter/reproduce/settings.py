"""The settings of one reproduce_all invocation, read once from the environment."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from specter.assembly.runners import is_method

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODELS = ("tiny_dsv2", "tiny_qwen", "tiny_phi")
DEFAULT_BATCH_METHODS = ("specter", "mo_sm", "specmoeoff", "transformers")
HARDWARE_KINDS = ("emulated", "cpu", "cuda")
LAUNCHERS = ("", "slurm", "local")


class SettingsError(ValueError):
    """A setting the user gave cannot be used; the message says which and why."""


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "0").strip().lower()
    if value not in {"0", "1", "", "true", "false"}:
        raise SettingsError(f"{name}={env[name]!r}: use 1 or 0")
    return value in {"1", "true"}


def _words(env: Mapping[str, str], name: str, default: tuple[str, ...]) -> tuple[str, ...]:
    raw = env.get(name)
    return tuple(raw.split()) if raw is not None and raw.strip() else default


def available_methods(hardware: str, home: Path, env: Mapping[str, str], repo: Path = REPO) -> tuple[str, ...]:
    """Every conf/method/*.yaml whose runner can start here (target_only and offload_ar first).

    llamacpp needs llama_cpp importable; vllm needs its own environment (scripts/setup_vllm.sh) and
    HARDWARE=cuda (vLLM's CPU weight offload serves a GPU).
    """
    names = sorted(p.stem for p in (repo / "conf" / "method").glob("*.yaml"))
    vllm_python = Path(env.get("SPECTER_VLLM_PYTHON") or home / "venvs" / "vllm" / "bin" / "python")
    present = {"llamacpp": importlib.util.find_spec("llama_cpp") is not None,
               "vllm": vllm_python.exists() and hardware == "cuda"}
    keep = [n for n in names if present.get(n, True)]
    first = [n for n in ("target_only", "offload_ar") if n in keep]
    return tuple(first + [n for n in keep if n not in first])


@dataclass(frozen=True)
class Settings:
    quick: bool                       # a shortened protocol (QUICK=1 or REFERENCE=1): see `sizes`
    dry_run: bool
    check: bool
    force: bool
    python: str
    hardware: str
    models: tuple[str, ...]
    tiers: tuple[str, ...]
    dataset: str                      # as requested (DATASET); the plan uses the decided subset
    trained: bool
    launcher: str
    results: Path
    figures: Path
    logs: Path
    assets: str | None                # ASSETS: the runs' assets_dir (None: the config's default)
    home: Path                        # SPECTER_HOME
    methods: tuple[str, ...]
    batch_models: tuple[str, ...]
    batch_methods: tuple[str, ...]
    dry_fail: tuple[str, ...] = field(default=())  # DRY_RUN only: steps to treat as failed
    sizes: str = "quick"              # a shortened run's sizes: quick | reference (specter/reproduce/protocol.py)
    jobs: int = 1                     # measuring steps run at once (JOBS; specter/reproduce/execute.py)

    @property
    def mode(self) -> str:
        return self.sizes if self.quick else "full"

    @property
    def sweep_tiers(self) -> tuple[str, ...]:
        """The tiers K is profiled at: every tier, except QUICK's (the low tier's profile serves both)."""
        return ("low",) if self.mode == "quick" else self.tiers

    def profile_tier(self, tier: str) -> str:
        """The tier whose K profile a run at `tier` reads."""
        return tier if tier in self.sweep_tiers else self.sweep_tiers[0]

    @property
    def one_dataset_steps(self) -> bool:
        """QUICK batches and ablates prefetching on one dataset; REFERENCE and the full protocol on every one."""
        return self.mode == "quick"

    @property
    def assets_dir(self) -> str:
        """The assets folder the runs read: ASSETS, else the config default ($SPECTER_ASSETS or assets)."""
        return self.assets or os.environ.get("SPECTER_ASSETS", "assets")

    def method_hardware(self, method: str) -> str:
        # a method that places every weight itself (no offloading through our link: the registry's places_itself)
        # runs on plain CPU when the others use the emulated link
        return "cpu" if self.hardware == "emulated" and is_method(method, places_itself=True) else self.hardware


def read_settings(env: Mapping[str, str] | None = None, repo: Path = REPO) -> Settings:
    """Settings from the environment (see scripts/reproduce_all.sh); SettingsError on a bad value."""
    env = dict(os.environ if env is None else env)
    quick, reference = _flag(env, "QUICK"), _flag(env, "REFERENCE")
    if quick and reference:
        raise SettingsError("QUICK=1 and REFERENCE=1: choose one (REFERENCE is the larger shortened protocol)")
    sizes = "reference" if reference else "quick"
    default_results = {"quick": "results/quick", "reference": "results/reference_run"}[sizes]
    quick = quick or reference
    hardware = env.get("HARDWARE", "emulated")
    if hardware not in HARDWARE_KINDS:
        raise SettingsError(f"HARDWARE={hardware!r}: choose one of {', '.join(HARDWARE_KINDS)}")
    launcher = env.get("LAUNCHER", "")
    if launcher not in LAUNCHERS:
        raise SettingsError(f"LAUNCHER={launcher!r}: choose slurm or local (or leave it unset)")
    trained = env.get("TRAINED", "true").strip().lower()
    if trained not in {"true", "false"}:
        raise SettingsError(f"TRAINED={env['TRAINED']!r}: use true or false")
    home = Path(env.get("SPECTER_HOME") or Path.home() / ".cache" / "specter")
    models = _words(env, "MODELS", DEFAULT_MODELS)
    methods = _words(env, "METHODS", ()) or available_methods(hardware, home, env, repo)
    known = {p.stem for p in (repo / "conf" / "method").glob("*.yaml")}
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise SettingsError(f"METHODS: no conf/method/{unknown[0]}.yaml; choose from {', '.join(sorted(known))}")
    batch_models = _words(env, "BATCH_MODELS", tuple(m for m in models if "dsv2" in m or "qwen" in m))
    batch_methods = _words(env, "BATCH_METHODS", DEFAULT_BATCH_METHODS)
    results = Path(env.get("RESULTS") or (default_results if quick else "results"))
    figures = Path(env.get("FIGURES") or (f"figures/{sizes}" if quick else "figures"))
    logs = Path(env.get("LOGS") or "results/logs")
    for name, folder in (("RESULTS", results), ("FIGURES", figures), ("LOGS", logs), ("SPECTER_HOME", home)):
        _folder(name, folder)
    return Settings(
        quick=quick, dry_run=_flag(env, "DRY_RUN"), check=_flag(env, "CHECK"), force=_flag(env, "FORCE"),
        python=env.get("PYTHON") or "python", hardware=hardware, models=models,
        tiers=_words(env, "TIERS", ("high", "low")), dataset=env.get("DATASET") or "all", trained=trained == "true",
        launcher=launcher, results=results, figures=figures,
        logs=logs, assets=env.get("ASSETS") or None, home=home,
        methods=methods, batch_models=batch_models, batch_methods=batch_methods,
        dry_fail=tuple(env.get("DRY_FAIL", "").replace(",", " ").split()), sizes=sizes, jobs=_jobs(env),
    )


def _jobs(env: Mapping[str, str]) -> int:
    raw = env.get("JOBS", "1").strip() or "1"
    if not raw.isdigit() or not 1 <= int(raw) <= (os.cpu_count() or 1):
        raise SettingsError(f"JOBS={raw!r}: a whole number from 1 to this machine's {os.cpu_count()} cores")
    return int(raw)


def _folder(name: str, folder: Path) -> None:
    """A folder setting must be a folder, or not exist yet with no file on its way: refused before
    any step (also under CHECK=1, whose preflight would otherwise pass and the real run fail later)."""
    for part in (folder, *folder.parents):
        if part.exists() and not part.is_dir():
            where = "is a file" if part == folder else f"lies under {part}, which is a file"
            raise SettingsError(f"{name}={folder} {where}, not a folder")
