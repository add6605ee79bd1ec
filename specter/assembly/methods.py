"""Decoding methods behind one interface, so the harness measures them all the same way.

A method owns its model instance. `generate` is timed by the caller's commit clock; `reset`
runs between measured records, outside timing (restoring the expert cache and planner state).
Which class runs a `method=` is named by its config file (`runner: module:Class`), resolved only
from the registry of known methods (specter/assembly/runners.py): a config never imports arbitrary
code. The registry's line for a method also declares its facts (speculative, owns an expert cache,
its slots rule, which K profile it reads, ...), which its class reads as `facts`. A new method is a
config file, a class (with its config schema) and one registry line (docs/methods.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from specter.assembly.config import ConfigError, effective_K
from specter.assembly.runners import MethodFacts, method_facts, runner_problem
from specter.assembly.runtime import (build_runtime, compact_over, decode_path, final_runtime, gptq_draft_for, method_spec,
                                     staging_for)
from specter.kernels.select import select_draft_kernel
from specter.metrics import CommitClock, io_stats, step_windows, window_routing
from specter.models.loading import load_full_model
from specter.moe import RouteLog
from specter.offload.budget import Footprint
from specter.offload.calibrate import LinkParams
from specter.offload.instruments import NO_INSTRUMENTS, Instruments
from specter.offload.runtime import Runtime
from specter.predict.oracle import load_columns, oracle_bytes
from specter.predict.planner import PrefetchPlanner
from specter.quant.draft import build_draft
from specter.spec import MethodSpec
from specter.speculative.autoregressive import generate_autoregressive
from specter.speculative.batched import BatchedAutoregressive, BatchRun
from specter.speculative.drafter import SharedDrafter
from specter.speculative.engine import SpeculativeEngine, generate_microbatched
from specter.speculative.sampling import SamplingParams


@dataclass
class Generation:
    tokens: list[int]
    clock: CommitClock
    stats: dict[str, Any] = field(default_factory=dict)  # extra record columns (acceptance, I/O, ...)
    # Per-record tables the run folder keeps beside records.csv (name -> rows), e.g. "routes"
    # (the target's experts per window, Fig. 13) and "trace" (per-window pipeline events).
    artifacts: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


class Method:
    """Base class: a named decoding method over one loaded model.

    What a built method exposes, on every method (None or empty where it has none): `rt`, its offloading
    runtime; `engine`, its speculative engine, and `batch_engines`, a batch's microbatch engines (built by
    `make_engine`); `route_log`, the target's routes of its last generation; `K`, its draft length;
    `draft_moe` and `draft_model`, a separate draft instance's MoE runtime and model (SpecMoEOff).
    """

    name = "base"  # the method's registry name (specter/assembly/runners.py), where its facts are declared
    rt: Runtime | None = None
    engine: SpeculativeEngine | None = None
    batch_engines: list[SpeculativeEngine] | tuple = ()
    route_log: RouteLog | None = None
    K: int | None = None
    draft_moe: Any = None
    draft_model: torch.nn.Module | None = None
    instruments: Instruments = NO_INSTRUMENTS  # what it is measured by (`instrument`); none: its own link and clocks

    def __init__(self, cfg: DictConfig, checkpoint: Path):
        self.cfg = cfg
        self.checkpoint = checkpoint
        self.spec: MethodSpec = self.make_spec(cfg)  # the config, read once; everything below is built from it
        self.device, self.dtype = self.spec.torch_device, self.spec.torch_dtype
        self.params = self.spec.sampling

    @property
    def facts(self) -> MethodFacts:
        """What this method is, as its registry line declares it (a class outside the registry: no facts set)."""
        return method_facts(self.name) or MethodFacts(f"{type(self).__module__}:{type(self).__qualname__}")

    def make_spec(self, cfg: DictConfig) -> MethodSpec:
        """This method's spec: the config's, with the method's own fields (a baseline replaces some)."""
        return method_spec(cfg)

    def make_engine(self, params: SamplingParams | None = None) -> SpeculativeEngine:
        """A new speculative engine over this method's runtime (only a method with `engine` has one)."""
        raise TypeError(f"{type(self).__name__} has no speculative engine")

    def instrument(self, instruments: Instruments) -> None:
        """Measure this method by ``instruments`` from now on: its runtime gets their link and meter
        (`Runtime.instrumented`), and every engine it has built or builds their clocks. Called by
        `build_method(..., instruments=)`, or on a built method before it decodes (the projection, once
        it knows the method's layers)."""
        self.instruments = instruments
        if self.rt is not None:
            self.rt = self.rt.instrumented(instruments)
        for engine in [self.engine, *self.batch_engines]:
            if engine is not None:
                engine.instrument(self.rt, instruments)

    def footprint_at(self, B: int) -> Footprint | None:
        """The method's device footprint at batch size B (None: no budget applies): its runtime's at B=1 with
        KV cache and scratch per request. A method whose other state grows with B too overrides this."""
        if self.rt is None:
            return None
        fp = self.rt.footprint
        return replace(fp, kv_cache=B * fp.kv_cache, scratch=B * fp.scratch)

    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, generator: torch.Generator) -> Generation:
        raise NotImplementedError

    def generate_batch(self, prompts: list[torch.Tensor], max_new_tokens: int,
                       generators: list[torch.Generator]) -> BatchRun:
        """Decode the prompts together (experiment=batch); at temperature 0 each request's tokens equal
        its own `generate` output. Per-request clocks and stats are on the returned requests."""
        raise ConfigError(f"method {self.name!r} has no batched decoding")

    def reset(self) -> None:
        """Restore per-record state outside timing."""

    def warmed(self) -> None:
        """Called once after the warm-up generation (e.g. to snapshot learned estimates)."""

    def static_fields(self) -> dict[str, Any]:
        """Record columns that are the same for every record of this method."""
        return {}

    def final_spec(self) -> MethodSpec:
        """The spec as built: cache sizes a method derives once its model is loaded filled in."""
        rt = self.rt
        return self.spec if rt is None else replace(self.spec, resident=rt.resident, staging=rt.cache.staging)

    def environment(self) -> dict[str, Any]:
        """Parameters worth recording in env.json (e.g. the emulated link)."""
        return {}

    def retime_link(self, per_layer_step_s: float, latency_us: float | None, source: str) -> LinkParams:
        """Re-time this method's emulated link to a layer step measured in the run (`Runtime.recalibrate_link`)
        and decode through the runtime that carries the new link parameters -> them."""
        self.rt = self.rt.recalibrate_link(per_layer_step_s, latency_us, source)
        return self.rt.link_params

    def close(self) -> None:
        pass


def build_method(cfg: DictConfig, checkpoint: Path, instruments: Instruments | None = None) -> Method:
    """Instantiate the known method class named by `method.runner` ("package.module:Class"), measured by
    ``instruments`` when given (`Method.instrument`)."""
    runner = cfg.method.get("runner")
    problem = runner_problem(cfg.method.name, runner)
    if problem:
        raise ConfigError(problem)
    module, _, cls = str(runner).partition(":")
    try:
        factory = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"method {cfg.method.name!r}: cannot load runner {runner} ({err})") from None
    if not (isinstance(factory, type) and issubclass(factory, Method)):
        raise ConfigError(f"method {cfg.method.name!r}: runner {runner} is not a Method class")
    method = factory(cfg, checkpoint)
    if instruments is not None and not instruments.empty:
        try:
            method.instrument(instruments)
        except BaseException:
            method.close()
            raise
    return method


class TargetOnly(Method):
    """Reference decoding: the full target model, autoregressive, no offloading."""

    name = "target_only"

    def __init__(self, cfg: DictConfig, checkpoint: Path):
        super().__init__(cfg, checkpoint)
        if cfg.memory.get("budget_mb") is not None:
            raise ConfigError("target_only keeps every weight on the device and does not apply a memory budget; "
                              "drop memory.budget_mb, or use an offloading method (offload_ar, specter)")
        self.model = load_full_model(checkpoint, self.dtype, self.device)
        self.compact = compact_decoder(cfg, self.model)  # None: transformers' modules decode

    def generate(self, prompt_ids, max_new_tokens, generator):
        clock = CommitClock()
        tokens = generate_autoregressive(self.compact or self.model, prompt_ids, max_new_tokens, self.params,
                                         generator, clock)
        return Generation(tokens, clock)

    def static_fields(self) -> dict[str, Any]:
        return {"decode_path": self.spec.decode_path}

    def environment(self) -> dict[str, Any]:
        return {"decode_path": self.spec.decode_path}

    def generate_batch(self, prompts, max_new_tokens, generators):
        return BatchedAutoregressive(self.model, self.params).generate_batch(prompts, max_new_tokens, generators)


class OffloadAR(Method):
    """Autoregressive decoding through the offloading runtime: on-demand loads, per-layer LRU.

    The plain offloading reference Specter is measured against (no speculation, no prefetch);
    `mo_sc`/`mo_sm` are the Mixtral-Offloading presets of it.
    """

    name = "offload_ar"

    def __init__(self, cfg: DictConfig, checkpoint: Path):
        super().__init__(cfg, checkpoint)
        self.window_tokens = autoregressive_window(cfg)
        rt = build_runtime(self.spec, checkpoint)  # the tier's M slots: the design, before any staging buffer
        try:
            self.rt = self.finish_runtime(rt)
        except BaseException:
            rt.close()
            raise

    def finish_runtime(self, rt: Runtime) -> Runtime:
        """The runtime this method decodes through, from the first one at the tier's M: the final residents
        and staging buffers (a baseline with its own sizing rule overrides this)."""
        rt.check_budget(self.spec.describe())
        return final_runtime(rt, self.spec.resident, staging_for(self.spec, rt, rt.footprint), what=self.spec.describe())

    def reset(self) -> None:
        self.rt.cache.reset()  # initial residents, counters cleared; outside timing

    def generate(self, prompt_ids, max_new_tokens, generator):
        clock = CommitClock()
        log = RouteLog()
        busy0 = self.rt.link.busy_seconds
        with self.rt.moe.mode("target", route_log=log):
            tokens = generate_autoregressive(self.rt.forward_model, prompt_ids, max_new_tokens, self.params, generator,
                                             clock, on_step=log.begin_window)  # one window per step
        stats = {**io_stats(self.rt.cache, self.rt.link.busy_seconds - busy0), "oracle_h2d_bytes": oracle_bytes(self.rt, log),
                 **self.routing(log)}
        stats.update(load_columns(self.rt, log, stats["h2d_bytes"], stats["oracle_h2d_bytes"], len(tokens)))
        self.route_log = log
        return Generation(tokens, clock, stats, {"routes": log.rows()})

    def routing(self, log: RouteLog) -> dict[str, Any]:
        """window_experts and window_experts_vs_independent of one generation (`metrics.window_routing`).

        Autoregressive decoding has no verification window, so its windows are runs of K+1 consecutive
        target steps with the K a speculative method verifies on this config (`effective_K`: the top-level
        K=, else the profiled K, else the model's): the same number of tokens as a full Specter window on the same
        model, which makes the two comparable (a 1-token window would give exactly k experts, a ratio of 1
        by construction). Route-log window 0 is the prefill, not a window; the last group holds what is left.
        """
        om = self.rt.om
        windows = step_windows(1, len(log.windows), self.window_tokens)
        return window_routing(log, windows, om.moe_layers, om.num_experts, om.top_k)

    def generate_batch(self, prompts, max_new_tokens, generators):
        """Batched autoregressive offloading: each step's expert-wise MoE loads an expert once for all B."""
        decoder = BatchedAutoregressive(self.rt.model, self.params, moe=self.rt.moe, num_experts=self.rt.om.num_experts)
        run = decoder.generate_batch(prompts, max_new_tokens, generators)
        run.stats["oracle_h2d_bytes"] = oracle_bytes(self.rt, decoder.route_log)
        return run

    def static_fields(self) -> dict[str, Any]:
        return {"schedule": self.rt.moe.target.schedule, "resident_experts": self.rt.resident, "decode_path": self.spec.decode_path,
                **self.rt.record_fields()}

    def environment(self) -> dict[str, Any]:
        return {**self.rt.environment(), "routing_window_tokens": self.window_tokens}

    def close(self) -> None:
        self.rt.close()


class Specter(Method):
    """Speculative decoding: shared-instance INT4 draft, ELB-driven prefetch, expert-wise verification."""

    name = "specter"

    def __init__(self, cfg: DictConfig, checkpoint: Path):
        super().__init__(cfg, checkpoint)
        spec = self.spec
        self.K, self.quant = spec.K, spec.quant
        rt = build_runtime(spec, checkpoint)  # the tier's M; its final size once the draft's bytes are known
        try:
            self.rt = self.finish_runtime(rt, self.build_draft_experts(rt))
        except BaseException:
            rt.close()
            raise
        self.rt.cache.set_residency(self.residency())
        self.engine = self.make_engine()
        self.batch_engines: list[SpeculativeEngine] = []
        self.verify = spec.verify_lossless and self.params.temperature == 0
        self.tie_tolerance = spec.tie_tolerance

    def finish_runtime(self, rt: Runtime, draft: dict) -> Runtime:
        """The runtime this method decodes through, from the first one at the tier's M and the INT4 draft
        experts: the final residents and staging buffers beside the draft (a baseline overrides this)."""
        spec = self.spec
        rt.check_budget(spec.describe())  # the M slots beside the draft, before any staging buffer
        staging = staging_for(spec, rt, replace(rt.footprint, draft_experts=self.draft_bytes))
        return final_runtime(rt, spec.resident, staging, draft=draft, draft_bytes=self.draft_bytes, what=spec.describe())

    @property
    def route_log(self) -> RouteLog:
        """The target's routes of the last generation: its engine's."""
        return self.engine.route_log

    @property
    def draft(self) -> dict:
        """MoE layer -> the INT4 draft experts the shared instance drafts with."""
        return self.rt.moe.draft.experts

    def build_draft_experts(self, rt: Runtime) -> dict:
        """The INT4 draft experts of `rt`'s model (GPTQ calibrated through `rt`, or RTN); sets
        `draft_bytes`, `draft_info` and `kernel_choice`."""
        packed, self.draft_info = gptq_draft_for(self.spec, rt, self.checkpoint) if self.quant == "gptq" else (None, {})
        self.kernel_choice = select_draft_kernel(self.spec.draft_kernel, self.device, self.dtype)
        draft = build_draft(rt.om, self.quant, self.device, self.dtype, packed_layers=packed,
                            kernel=self.kernel_choice.selected)
        self.draft_bytes = sum(d.nbytes for d in draft.values())
        return draft

    def make_engine(self, params: SamplingParams | None = None) -> SpeculativeEngine:
        """This method's engine from its spec and the pieces it swaps (``params``: sampling that
        replaces the spec's, e.g. a served request's)."""
        s = self.spec
        return SpeculativeEngine(self.rt, s.K, s.sampling if params is None else params, prefetch=s.prefetch,
                                 planner_config=s.planner, planner_state=s.planner_state,
                                 expert_filter=self.expert_filter(), plan_cap=s.plan_cap, planner=self.planner(),
                                 drafter=self.drafter(), trace_windows=s.trace_windows, instruments=self.instruments)

    def residency(self) -> str:
        """The expert cache's residency policy (`specter.offload.policy`): `method.residency`; a baseline
        keeps the policy its design gives it."""
        return self.spec.residency

    def expert_filter(self):
        """Verification-time expert filter (None: every routed expert is computed, lossless)."""
        return None

    def planner(self) -> PrefetchPlanner | None:
        """A planner object replacing the spec's named prefetch policy (None: the named one)."""
        return None

    def drafter(self) -> SharedDrafter | None:
        """The drafter (None: the shared-instance INT4 draft)."""
        return None

    microbatches = 1  # a batch is decoded as this many microbatches sharing one expert cache

    def reset(self) -> None:
        self.rt.cache.reset()
        for engine in [self.engine, *self.batch_engines]:
            engine.reset()

    def warmed(self) -> None:
        for engine in [self.engine, *self.batch_engines]:
            engine.mark_warm()

    def build_batch_engines(self) -> list[SpeculativeEngine]:
        """One engine per microbatch, built at the first batch (or before it, e.g. before instruments are
        handed in); the same ones after that."""
        if not self.batch_engines:
            self.batch_engines = [self.make_engine() for _ in range(self.microbatches)]
        return self.batch_engines

    def generate_batch(self, prompts, max_new_tokens, generators):
        run = generate_microbatched(self.build_batch_engines(), prompts, max_new_tokens, generators)
        if self.verify:
            for prompt, req in zip(prompts, run.requests):
                req.stats["lossless_check"] = self._check_lossless(prompt, req.tokens)
        return run

    def generate(self, prompt_ids, max_new_tokens, generator):
        clock = CommitClock()
        tokens, stats = self.engine.generate(prompt_ids, max_new_tokens, generator, clock)
        artifacts = {"routes": self.engine.route_log.rows()}
        if self.engine.tracer is not None:
            artifacts["trace"] = self.engine.tracer.rows()
        if self.verify:
            stats["lossless_check"] = self._check_lossless(prompt_ids, tokens)
        return Generation(tokens, clock, stats, artifacts)

    def _check_lossless(self, prompt_ids, tokens) -> str:
        """Greedy target-only decoding through the same runtime; "exact", "tie@i" or a violation.

        On fp16/bf16 devices a (K+1)-token verification is not bit-identical to one-token decoding,
        so a flip where the target's two best logits are within `lossless_tie_tolerance` is a
        numerical tie (reported with its margin), not a violation of losslessness.
        """
        with self.rt.moe.mode("target"):
            reference = generate_autoregressive(self.rt.model, prompt_ids, len(tokens), self.params)
            self.rt.cache.reset()
            if reference == tokens:
                return "exact"
            first = next(i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b)
            ids = torch.cat([prompt_ids[0], torch.tensor(reference[:first], device=prompt_ids.device)])[None]
            with torch.inference_mode():
                logits = self.rt.model(input_ids=ids).logits[0, -1].float()  # [V]
            self.rt.cache.reset()
        margin = float(logits[reference[first]] - logits[tokens[first]])
        if margin <= self.tie_tolerance:
            return f"tie@{first} (margin {margin:.3g})"
        raise LosslessViolation(
            f"speculative output differs from target-only greedy decoding at token {first} "
            f"(logit margin {margin:.3g} > tie tolerance {self.tie_tolerance:g}): "
            f"{tokens[first:first + 8]} vs {reference[first:first + 8]}"
        )

    def retime_link(self, per_layer_step_s: float, latency_us: float | None, source: str) -> LinkParams:
        params = super().retime_link(per_layer_step_s, latency_us, source)
        for engine in [self.engine, *self.batch_engines]:  # built over the runtime before: same link, old params
            engine.use_runtime(self.rt)
        return params

    def set_draft_length(self, K: int) -> None:
        """Decode at draft length K from now on: a new engine over the same runtime, draft and instruments
        (what the builder would make at that K; building the method again costs seconds)."""
        self.spec = replace(self.spec, K=K)
        self.K = K
        self.engine = self.make_engine()
        self.batch_engines = []

    def static_fields(self) -> dict[str, Any]:
        return {"K": self.K, "draft_quant": self.quant, "schedule": self.rt.moe.target.schedule,
                "prefetch": self.engine.prefetch, "residency": self.rt.cache.residency, "resident_experts": self.rt.resident,
                "decode_path": self.spec.decode_path, **self.rt.record_fields()}

    def environment(self) -> dict[str, Any]:
        return {**self.rt.environment(), "K": self.K, "draft_quant": self.quant, "draft_bytes": self.draft_bytes,
                "draft_precision": draft_precision(self.spec), "draft_kernel": self.kernel_choice.as_dict(),
                "planner_state": self.engine.planner_state, **self.draft_info}

    def close(self) -> None:
        self.rt.close()


def draft_precision(spec: MethodSpec) -> dict[str, Any]:
    """The draft's precision as run (env.json): GPTQ bits and group size, and whether that is the paper's
    INT4 g128 or a proxy's acceptance calibration (the projection always charges INT4 g128)."""
    if spec.quant != "gptq":
        return {"bits": 4, "group_size": 128, "source": f"{spec.quant} INT4 (bits apply to GPTQ drafts only)"}
    paper = (spec.draft_bits, spec.draft_group_size) == (4, 128)
    return {"bits": spec.draft_bits, "group_size": spec.draft_group_size,
            "source": "the paper's INT4 g128" if paper else
            f"calibrated: model.draft_bits={spec.draft_bits} puts {spec.model}'s acceptance in the paper's band"}


def autoregressive_window(cfg: DictConfig) -> int:
    """Target steps per window of an autoregressive method's routing columns: K + 1 with the K a speculative
    method verifies on this config (see `OffloadAR.routing`), 1 where the config names no usable K."""
    try:
        return effective_K(cfg) + 1
    except (ConfigError, AttributeError, KeyError, TypeError, ValueError):
        return 1


def compact_decoder(cfg: DictConfig, model: torch.nn.Module):
    """The compact decoder over `model` when `method.decode_path` is compact or compiled, else None
    (the offloading methods get theirs from their runtime: `Runtime.forward_model`)."""
    path = decode_path(cfg)
    if path == "hf":
        return None
    return compact_over(model, cfg.prefix_tokens + cfg.max_new_tokens + 8, compiled=path == "compiled")


class LosslessViolation(AssertionError):
    """A greedy speculative record differs from target-only decoding beyond a numerical tie."""
