"""The registry of known methods: which `runner:` (conf/method/*.yaml) may be instantiated.

A configuration names its runner as "package.module:Class"; only the names listed here are ever
imported (`specter.harness.methods.build_method`), so no configuration value can import or call
arbitrary code. A new method adds its runner with `register_runner`.
"""

from __future__ import annotations

_RUNNERS: set[str] = {
    "specter.harness.methods:TargetOnly", "specter.harness.methods:OffloadAR", "specter.harness.methods:Specter",
    "baselines.mixtral_offloading:MixtralOffloading", "baselines.mixtral_offloading:MixtralOffloadingSM",
    "baselines.specmoeoff:SpecMoEOff", "baselines.moe_spec:MoESpec", "baselines.transformers_engine:TransformersEngine",
    "baselines.specmoeoff:SpecMoEOffArtifact",
    "baselines.llamacpp_engine:LlamaCpp", "baselines.vllm_engine:Vllm",
}


def known_runners() -> frozenset[str]:
    return frozenset(_RUNNERS)


def register_runner(runner: str) -> None:
    """Add a runner ("package.module:Class", a `specter.harness.methods.Method` subclass)."""
    _RUNNERS.add(runner)


def runner_problem(name: str, runner: object) -> str | None:
    """Why method `name`'s runner cannot be used, or None."""
    if str(runner) in _RUNNERS:
        return None
    return f"method {name!r}: unknown runner {runner!r}; known runners: {sorted(_RUNNERS)}"
