"""The registry of known methods: each `method=` name, the runner that may be instantiated for it, and its facts.

A configuration (conf/method/<name>.yaml) names its runner as "package.module:Class"; only the runners
listed here are ever imported (`specter.assembly.methods.build_method`), so no configuration value can import
or call arbitrary code. Each method's facts (is it speculative, does it own an expert cache, how are its slots
sized, which K profile does it read, ...) are written once, on its line below; its class reads them
(`Method.facts`), and every place that lists methods asks this registry (`method_names`) instead of keeping
a tuple of names. This module imports nothing heavy: the plan, the projection and the reproduction driver
query it without loading a model, a baseline or torch.

A new method is its config file, its class (with its config schema) and one line here (`register_method`
for a method defined outside this repository, e.g. a test's).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# How a method's expert slots per MoE layer are sized at a memory tier (`experiment=plan`, assembly/plan.py):
#  all: every expert on the device (target_only; not bound by the tier)
#  tier: the tier's M slots (memory.resident_experts), staging by the rule every cache-owning method follows
#  same_memory: Specter's device bytes at the tier given to extra slots (MO-SM), or a checkpoint-bound preset
#  fit: every slot the budget holds beside the method's own draft (SpecMoEOff as designed)
#  preset: a fixed count per tier, capped by what the budget holds (the paper artifact's presets)
#  own: the engine places whole layers or tensors itself from the tier's budget (external engines)
SLOTS_RULES = ("all", "tier", "same_memory", "fit", "preset", "own")


@dataclass(frozen=True)
class MethodFacts:
    """What a method is, declared once: the registry's line for it."""

    runner: str  # "package.module:Class", a `specter.assembly.methods.Method` subclass
    summary: str = ""  # what it is, in a few words (the projection's note column)
    speculative: bool = False  # drafts K tokens per window and verifies them with the target
    owns_cache: bool = False  # decodes through Specter's offloading runtime: an expert cache, the link, staging buffers
    external: bool = False  # another engine (transformers, llama.cpp, vLLM) decodes; Specter's runtime is not used
    out_of_process: bool = False  # runs in a process of its own (a server): it cannot share a cell's process
    lossy: bool = False  # its tokens may differ from target-only greedy decoding by design
    tunes_k: bool = False  # its design tunes K: a K sweep (experiment=k_sweep, project.profile) profiles it
    reads_k_profile: bool = False  # runs with a profiled K (k_profile=) when one is given
    own_k_profile: bool = False  # that profile is its own sweep over method.k_range, not Specter's
    slots_rule: str = "tier"  # one of SLOTS_RULES
    preset_of: str | None = None  # a fixed preset of this method's design, measured beside it (the projection and
    #                               the staging ablation run the design itself)

    def __post_init__(self) -> None:
        if self.slots_rule not in SLOTS_RULES:
            raise ValueError(f"slots_rule {self.slots_rule!r} is not one of {SLOTS_RULES}")
        if ":" not in self.runner:
            raise ValueError(f"runner {self.runner!r} is not 'package.module:Class'")

    @property
    def places_itself(self) -> bool:
        """No expert cache of ours: every weight on the device, or an engine's own placement (no emulated link,
        so an emulated-hardware run of it is a CPU run)."""
        return not self.owns_cache

    @property
    def reads_specter_profile(self) -> bool:
        """Runs with Specter's K profile (the paper's sweep) when one is given."""
        return self.reads_k_profile and not self.own_k_profile

    @property
    def projected(self) -> bool:
        """Built in-process by `build_method` and run on the projection's virtual clock."""
        return not self.external and self.preset_of is None

    @property
    def batched_projection(self) -> bool:
        """Has a batched loop (microbatched speculative engines) the projection runs on the virtual clock."""
        return self.projected and self.speculative


_METHODS: dict[str, MethodFacts] = {
    "target_only": MethodFacts("specter.assembly.methods:TargetOnly", "every expert resident", slots_rule="all"),
    "offload_ar": MethodFacts("specter.assembly.methods:OffloadAR", "LRU on demand", owns_cache=True),
    "mo_sc": MethodFacts("baselines.mixtral_offloading:MixtralOffloading", "LRU + staging, same cache", owns_cache=True),
    "mo_sm": MethodFacts("baselines.mixtral_offloading:MixtralOffloadingSM", "LRU, same memory", owns_cache=True,
                         slots_rule="same_memory"),
    "specter": MethodFacts("specter.assembly.methods:Specter", "shared INT4 draft, adaptive prefetch", speculative=True,
                           owns_cache=True, tunes_k=True, reads_k_profile=True),
    "moe_spec": MethodFacts("baselines.moe_spec:MoESpec", "Specter + verification expert budget", speculative=True,
                            owns_cache=True, lossy=True, reads_k_profile=True),
    "specmoeoff": MethodFacts("baselines.specmoeoff:SpecMoEOff", "separate draft, route-frequency prefetch",
                              speculative=True, owns_cache=True, tunes_k=True, reads_k_profile=True, own_k_profile=True,
                              slots_rule="fit"),
    "specmoeoff_artifact": MethodFacts("baselines.specmoeoff:SpecMoEOffArtifact", "SpecMoEOff at the artifact's preset",
                                       speculative=True, owns_cache=True, slots_rule="preset", preset_of="specmoeoff"),
    "transformers": MethodFacts("baselines.transformers_engine:TransformersEngine", "transformers + accelerate offload",
                                external=True, slots_rule="own"),
    "llamacpp": MethodFacts("baselines.llamacpp_engine:LlamaCpp", "llama.cpp over a GGUF export", external=True,
                            slots_rule="own"),
    "vllm": MethodFacts("baselines.vllm_engine:Vllm", "vLLM with CPU weight offload", external=True,
                        out_of_process=True, slots_rule="own"),
}
FACTS = tuple(f.name for f in fields(MethodFacts) if f.name not in ("runner", "summary")) + (
    "places_itself", "reads_specter_profile", "projected", "batched_projection")


def method_names(**where: object) -> tuple[str, ...]:
    """The registered method names (in registry order) whose facts equal every `where` value, e.g.
    `method_names(owns_cache=True)`, `method_names(projected=True, speculative=True)`."""
    unknown = [k for k in where if k not in FACTS]
    if unknown:
        raise TypeError(f"unknown method facts {unknown}; known: {FACTS}")
    return tuple(name for name, facts in _METHODS.items()
                 if all(getattr(facts, key) == value for key, value in where.items()))


def method_facts(name: str) -> MethodFacts | None:
    """The facts of method `name` (None: not a registered method)."""
    return _METHODS.get(str(name))


def is_method(name: str, **where: object) -> bool:
    """`name` is a registered method whose facts equal every `where` value."""
    return str(name) in method_names(**where)


def register_method(name: str, facts: MethodFacts) -> None:
    """Add (or replace) method `name` with its facts: one registry line, for a method defined outside this file."""
    _METHODS[str(name)] = facts


def unregister_method(name: str) -> None:
    _METHODS.pop(str(name), None)


def known_runners() -> frozenset[str]:
    return frozenset(f.runner for f in _METHODS.values())


def runner_class(name: str) -> type:
    """The class registered for method `name` (imported on first use: a baseline's module is named by its
    registry line, never imported by the assembly room)."""
    import importlib

    facts = method_facts(name)
    if facts is None:
        raise KeyError(f"unknown method {name!r}; known: {method_names()}")
    module, _, cls = facts.runner.partition(":")
    return getattr(importlib.import_module(module), cls)


def runner_problem(name: str, runner: object) -> str | None:
    """Why method `name`'s runner cannot be used, or None."""
    if str(runner) in known_runners():
        return None
    return f"method {name!r}: unknown runner {runner!r}; known runners: {sorted(known_runners())}"
