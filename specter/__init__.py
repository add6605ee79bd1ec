"""Specter: fast single-GPU MoE inference with offloaded experts and a shared-instance INT4 draft.

How a run is assembled (the config stops at the spec; the engine takes typed values only)::

    CLI / compose ──► DictConfig ──► assembly.runtime.method_spec ──► MethodSpec (frozen; env.json "spec")
                                                                        │ a baseline: replace(spec, ...)
    Method (assembly.methods) ── build_runtime(spec) ── draft ── final_runtime(rt, M, staging, draft)
                                                                        │ Runtime (frozen): its MoERuntime
                                                                        │ holds two immutable executors,
                                                                        │ TargetExecutor and DraftExecutor
    SpeculativeEngine(rt, spec values,
        drafter=SharedDrafter | SeparateDrafter, planner=PrefetchPlanner subclass, expert_filter=...)
        generate()        one request: B = 1 rows on the decode path's own cache (SequenceKV)
        generate_batch()  B requests: BatchKV rows on transformers' modules (per-row positions, masks)

    one window, any B: drafter drafts Kb ─► planner boundaries b_i: ELB top-M plan ─► prefetch
                ─► verify B×(Kb+1) (expert filter on verification passes) ─► accept ─► commit
    every switch: `with moe.mode("draft" | "target", **Observers)` (ELB, route log, filter, capture, tracer)
"""

import logging as _logging

# Optional third-party extensions (torchao kernels for other CUDA versions, torch pytree notices)
# log at import time; they say nothing about Specter's work.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)

__version__ = "0.1.0"


def load(*args, **kwargs):
    """One method, loaded for use from Python: ``specter.load(model=..., memory=..., method=..., **overrides)``
    returns a `specter.api.Engine` with `generate` and `stream` (docs/python_api.md). Imported on first
    call, so importing an engine package never loads the assembly code."""
    from specter.api import load as _load

    return _load(*args, **kwargs)


def __getattr__(name: str):
    if name in ("Engine", "Completion", "Stats", "Stream", "EngineClosed", "ConfigError"):
        import specter.api as _api

        return getattr(_api, name)
    raise AttributeError(f"module 'specter' has no attribute {name!r}")
