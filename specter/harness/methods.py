"""Decoding methods behind one interface, so the harness measures them all the same way.

A method owns its model instance. `generate` is timed by the caller's commit clock;
`reset` runs between measured records, outside timing (e.g. restoring the expert cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig

from specter.decode.autoregressive import generate_autoregressive
from specter.metrics import CommitClock
from specter.predict.oracle import oracle_bytes
from specter.spec.sampling import SamplingParams

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class Generation:
    tokens: list[int]
    clock: CommitClock
    stats: dict[str, Any] = field(default_factory=dict)  # extra record columns (acceptance, I/O, ...)


class Method:
    """Base class: a named decoding method over one loaded model."""

    name = "base"

    def __init__(self, cfg: DictConfig, checkpoint: Path):
        self.cfg = cfg
        self.checkpoint = checkpoint
        self.device = torch.device(cfg.hardware.device)
        self.dtype = DTYPES[cfg.hardware.dtype]
        self.params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)

    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, generator: torch.Generator) -> Generation:
        raise NotImplementedError

    def reset(self) -> None:
        """Restore per-record state outside timing."""

    def static_fields(self) -> dict[str, Any]:
        """Record columns that are the same for every record of this method."""
        return {}

    def environment(self) -> dict[str, Any]:
        """Parameters worth recording in env.json (e.g. the emulated link)."""
        return {}

    def close(self) -> None:
        pass


def load_full_model(checkpoint: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The plain transformers model, every weight on the device (HF's eager experts loop)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, experts_implementation="eager")
    return model.to(device).eval()


class TargetOnly(Method):
    """Reference decoding: the full target model, autoregressive, no offloading."""

    name = "target_only"

    def __init__(self, cfg: DictConfig, checkpoint: Path):
        super().__init__(cfg, checkpoint)
        self.model = load_full_model(checkpoint, self.dtype, self.device)

    def generate(self, prompt_ids, max_new_tokens, generator):
        clock = CommitClock()
        tokens = generate_autoregressive(self.model, prompt_ids, max_new_tokens, self.params, generator, clock)
        return Generation(tokens, clock)


METHODS: dict[str, Callable[[DictConfig, Path], Method]] = {"target_only": TargetOnly}


def register(name: str, factory: Callable[[DictConfig, Path], Method]) -> None:
    METHODS[name] = factory


def build_method(cfg: DictConfig, checkpoint: Path) -> Method:
    name = cfg.method.name
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(METHODS)}")
    return METHODS[name](cfg, checkpoint)


class OffloadAR(Method):
    """Autoregressive decoding through the offloading runtime: on-demand loads, per-layer LRU.

    The Mixtral-Offloading-style core (no speculation, no prefetch) that Specter is measured against.
    """

    name = "offload_ar"

    def __init__(self, cfg: DictConfig, checkpoint: Path):
        super().__init__(cfg, checkpoint)
        from specter.runtime import build_runtime

        self.rt = build_runtime(cfg, checkpoint)
        self.rt.enforce_budget(0, f"{cfg.model.name} offload_ar at memory={cfg.memory.name} (M={self.rt.resident})")
        self.rt.moe.schedule = cfg.method.get("schedule", "expert")

    def reset(self) -> None:
        self.rt.cache.reset()  # initial residents, counters cleared; outside timing

    def generate(self, prompt_ids, max_new_tokens, generator):
        from specter.moe import RouteLog

        clock = CommitClock()
        log = self.rt.moe.route_log = RouteLog()
        hook = self.rt.model.register_forward_pre_hook(lambda *_: log.begin_window())  # one window per step
        try:
            tokens = generate_autoregressive(self.rt.model, prompt_ids, max_new_tokens, self.params, generator, clock)
        finally:
            hook.remove()
            self.rt.moe.route_log = None
        return Generation(tokens, clock, {**io_stats(self.rt.cache), "oracle_h2d_bytes": oracle_bytes(self.rt, log)})

    def environment(self) -> dict[str, Any]:
        return runtime_environment(self.rt)

    def close(self) -> None:
        self.rt.close()


def io_stats(cache) -> dict[str, Any]:
    c = cache.snapshot_counters()
    return {"h2d_bytes": int(c["h2d_bytes"]), "demand_hits": int(c["demand_hits"]),
            "demand_misses": int(c["demand_misses"]), "copy_wait_ms": c["copy_wait_s"] * 1e3}


def runtime_environment(rt) -> dict[str, Any]:
    return {"link": rt.link_params.as_dict(), "resident_experts_per_layer": rt.resident,
            "expert_bytes": rt.om.store.nbytes_per_expert, "moe_layers": rt.om.moe_layers,
            "footprint_bytes": rt.footprint.__dict__, "budget_bytes": rt.budget_bytes}


register("offload_ar", OffloadAR)


class Specter(Method):
    """Speculative decoding: shared-instance INT4 draft, ELB-driven prefetch, expert-wise verification."""

    name = "specter"

    def __init__(self, cfg: DictConfig, checkpoint: Path):
        super().__init__(cfg, checkpoint)
        from specter.draft import build_draft, draft_forward
        from specter.harness.config import effective_K
        from specter.runtime import build_runtime
        from specter.spec.engine import SpeculativeEngine

        self.rt = build_runtime(cfg, checkpoint, speculative=True)
        self.quant = cfg.method.get("quant", "rtn")
        packed, self.draft_info = None, {}
        if self.quant == "gptq":
            from transformers import AutoTokenizer

            from specter.calibration import gptq_draft

            packed, self.draft_info = gptq_draft(self.rt, cfg, AutoTokenizer.from_pretrained(checkpoint))
        self.draft = build_draft(self.rt.om, self.quant, self.device, self.dtype, packed_layers=packed)
        draft_bytes = sum(d.nbytes for d in self.draft.values())
        self.rt.enforce_budget(draft_bytes, f"{cfg.model.name} specter at memory={cfg.memory.name} (M={self.rt.resident})")
        self.rt.moe.draft, self.rt.moe.draft_forward = self.draft, draft_forward
        self.rt.moe.schedule = cfg.method.get("schedule", "expert")
        self.K = effective_K(cfg)
        self.engine = SpeculativeEngine(self.rt, self.K, self.params, prefetch=cfg.method.get("prefetch", "adaptive"))
        self.verify = bool(cfg.get("verify_lossless")) and self.params.temperature == 0

    def reset(self) -> None:
        self.rt.cache.reset()

    def generate(self, prompt_ids, max_new_tokens, generator):
        clock = CommitClock()
        tokens, stats = self.engine.generate(prompt_ids, max_new_tokens, generator, clock)
        if self.verify:
            self._check_lossless(prompt_ids, tokens)
        return Generation(tokens, clock, stats)

    def _check_lossless(self, prompt_ids, tokens) -> None:
        """Greedy target-only decoding through the same runtime (bit-identical to target_only)."""
        self.rt.moe.mode = "target"
        self.rt.moe.route_log = None
        reference = generate_autoregressive(self.rt.model, prompt_ids, len(tokens), self.params)
        self.rt.cache.reset()
        if reference != tokens:
            first = next(i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b)
            raise LosslessViolation(
                f"speculative output differs from target-only greedy decoding at token {first}: "
                f"{tokens[first:first + 8]} vs {reference[first:first + 8]}"
            )

    def static_fields(self) -> dict[str, Any]:
        return {"K": self.K, "draft_quant": self.quant}

    def environment(self) -> dict[str, Any]:
        return {**runtime_environment(self.rt), "K": self.K, "draft_quant": self.quant,
                "draft_bytes": sum(d.nbytes for d in self.draft.values()), **self.draft_info}

    def close(self) -> None:
        self.rt.close()


class LosslessViolation(AssertionError):
    """A greedy speculative record differs from target-only decoding."""


register("specter", Specter)
