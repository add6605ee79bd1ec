"""Assemble the offloading runtime for a run from its composed config.

This is the harness's boundary: `method_spec` reads the config once into a frozen `MethodSpec`;
everything after it (the runtime, the draft, the engine) is built from the spec, never from the
config. Shared by every method that offloads experts (`offload_ar`, `specter`, the baselines).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
import torch
from omegaconf import DictConfig

from specter.assembly.config import ConfigError, bind_checkpoint, effective_K, load_ratio_of, resident_experts
from specter.assembly.load_ratio import probe_decoder
from specter.assembly.real_plan import planned_slots
from specter.assembly.sizing import budget_spec, scratch_bytes
from specter.models.loading import DTYPES, load_offloaded, non_expert_bytes
from specter.models.registry import ModelUnavailable, checkpoint_digest, checkpoint_problem, resolve_checkpoint
from specter.moe import DraftExecutor, MoERuntime, TargetExecutor
from specter.offload.budget import Footprint, STAGING_PER_LAYER, kv_bytes_per_token, staging_buffers
from specter.offload.cache import ExpertCache
from specter.offload.calibrate import LinkParams, calibrated_link, fixed_link, measure_layer_step
from specter.offload.link import make_link
from specter.offload.runtime import Runtime
from specter.paths import safe_name, specter_home
from specter.predict.planner import PlannerConfig
from specter.quant.draft import draft_forward
from specter.spec import BudgetSpec, CalibrationSpec, LinkSpec, MethodSpec
from specter.speculative.sampling import SamplingParams

DECODE_PATHS = ("hf", "compact", "compiled")


def model_checkpoint(cfg: DictConfig) -> Path:
    """The checkpoint folder of the configured model (built on first use for tiny models), with the
    config's model facts checked against it and filled in from it (`bind_checkpoint`)."""
    from specter.routing_stats import held_out_routing

    m = cfg.model
    checkpoint = resolve_checkpoint(m.name, m.source, trained=bool(m.get("trained")), local_dir=m.get("local_dir"),
                                    hf_id=m.get("hf_id"), revision=m.get("revision"), routing=held_out_routing)
    problem = checkpoint_problem(checkpoint, m.name, m.get("real"), offloads="schedule" in cfg.method)
    if problem:
        raise ModelUnavailable(problem)
    bind_checkpoint(cfg, checkpoint)
    return checkpoint


def device_and_dtype(cfg: DictConfig) -> tuple[torch.device, torch.dtype]:
    hw = cfg.hardware
    if hw.dtype not in DTYPES:
        raise ConfigError(f"hardware.dtype={hw.dtype!r} is not one of {sorted(DTYPES)}")
    device = torch.device(hw.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("hardware=cuda needs a CUDA GPU, and torch.cuda.is_available() is False here; "
                          "use hardware=cpu or hardware=emulated")
    return device, DTYPES[hw.dtype]


def method_spec(cfg: DictConfig) -> MethodSpec:
    """The config, read once, as the typed spec every engine piece is built from (a method's own
    fields are filled in by its class, `Method.make_spec`)."""
    device, _ = device_and_dtype(cfg)
    m, hw, mem = cfg.method, cfg.hardware, cfg.memory
    speculative = bool(m.get("speculative"))
    staging = m.get("staging_buffers")  # null (every cache-owning method's default): the one rule
    if staging is not None and (isinstance(staging, bool) or not isinstance(staging, int) or staging < 0):
        raise ConfigError(f"method.staging_buffers must be an integer >= 0 (or null = fit the budget), got {staging!r}")
    sizes = tuple(cfg.batch.sizes) if cfg.get("experiment") == "batch" and cfg.get("batch") else (1,)
    ratio, ratio_source = load_ratio_of(cfg) if hw.link == "emulated" else (1.0, "")
    return MethodSpec(
        method=str(m.name), model=str(cfg.model.name), memory=str(mem.name), device=str(device), dtype=str(hw.dtype),
        sampling=SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k),
        K=effective_K(cfg) if speculative else 0,
        quant=m.get("quant") if speculative else None, draft_kernel=str(hw.get("draft_kernel") or "auto"),
        draft_bits=int(cfg.model.get("draft_bits") or 4), draft_group_size=int(cfg.model.get("draft_group_size") or 128),
        calibration=calibration_spec(cfg),
        prefetch=str(m.get("prefetch") or "none"), planner=PlannerConfig(**(m.get("planner") or {})),
        planner_state=str(m.get("planner_state") or "warm"), residency=str(m.get("residency") or "lru"), schedule=str(m.get("schedule") or "expert"),
        resident=resident_experts(cfg), decode_path=decode_path(cfg),
        staging=staging,
        staging_per_layer=float(m.get("staging_per_layer", STAGING_PER_LAYER)),
        budget=budget_spec(cfg),
        link=LinkSpec(kind=str(hw.link), bandwidth_gbps=hw.get("bandwidth_gbps") or None,
                      latency_us=hw.get("latency_us"), load_ratio=ratio, load_ratio_source=ratio_source,
                      recalibrate=bool(hw.get("recalibrate"))),
        sequence_tokens=int(cfg.prefix_tokens + cfg.max_new_tokens), batch_sizes=sizes,
        verify_lossless=bool(cfg.get("verify_lossless")), tie_tolerance=float(cfg.get("lossless_tie_tolerance", 0.0)),
        trace_windows=bool(m.get("trace_windows")),
        planned=planned_slots(cfg),
    )


def decode_path(cfg: DictConfig) -> str:
    """`method.decode_path`, checked: hf, compact, or compiled (the compact decoder whose one-token
    step torch.compile traces: every expert resident, so target_only only)."""
    path = str(cfg.method.get("decode_path") or "hf")
    if path not in DECODE_PATHS:
        raise ConfigError(f"method.decode_path={path!r}: choose one of {', '.join(DECODE_PATHS)}")
    return path


def compact_over(model: torch.nn.Module, max_length: int, compiled: bool = False):
    """The compact decoder over a loaded model's tensors (ConfigError for an architecture it lacks);
    with `compiled`, its one-token forwards go through the compiled static step."""
    from specter.models.compact import SUPPORTED, build_compact
    from specter.models.compact.static import use_static_step

    if model.config.model_type not in SUPPORTED:
        path = "compiled" if compiled else "compact"
        raise ConfigError(f"method.decode_path={path} supports {SUPPORTED}, not {model.config.model_type!r}")
    decoder = build_compact(model, max_length=max_length)
    if compiled:
        try:
            use_static_step(decoder, compile=True)
        except ValueError as err:
            raise ConfigError(f"method.decode_path=compiled: {err}") from None
    return decoder


def link_params(spec: MethodSpec, checkpoint: Path, expert_bytes: int, digest: str) -> LinkParams:
    link = spec.link
    if link.kind != "emulated":
        return LinkParams(kind=link.kind)
    if link.bandwidth_gbps:
        return fixed_link(expert_bytes, link.bandwidth_gbps, link.latency_us)
    path_tag = "" if spec.decode_path == "hf" else f"-{spec.decode_path}"  # each decode path has its own step
    key = f"{safe_name(spec.model, 'model.name')}-{digest[:12]}-{spec.dtype}-t{torch.get_num_threads()}{path_tag}"
    path = specter_home() / "calibration" / f"{key}.json"
    params = calibrated_link(expert_bytes, link.load_ratio, path,
                             lambda: measure_layer_step(probe_decoder(checkpoint, spec.torch_dtype, spec.torch_device,
                                                                      spec.decode_path)),
                             latency_us=link.latency_us, recalibrate=link.recalibrate)
    print(f"emulated link for {spec.model}: layer step {params.per_layer_step_s * 1e3:.3f} ms x load_ratio "
          f"{params.load_ratio:.3g} -> expert load {params.expert_load_s * 1e3:.3f} ms ({expert_bytes / 1e6:.2f} MB at "
          f"{params.bandwidth_bytes_per_s / 1e9:.3f} GB/s + {params.latency_s * 1e6:.0f} us) "
          f"[layer step {params.calibration_source}; calibration: {path}]\n"
          f"  load_ratio {params.load_ratio:.3g} from {link.load_ratio_source or 'model.load_ratio'}",
          flush=True)
    return params


def build_runtime(spec: MethodSpec, checkpoint: Path, resident: int | None = None,
                  staging: int = 0, batch_size: int = 1, K: int | None = None) -> Runtime:
    """The model, host store, link and a cache of `resident` slots per MoE layer (default: the
    spec's M) and `staging` staging buffers (no draft; the budget is not checked yet).

    A method whose final cache size or draft follow from bytes only known once the model is loaded
    builds this first, then its final runtime once with `final_runtime`. Scripts pass their config's
    spec (`method_spec(cfg)`) and may pass a K (default: the spec's) to reserve KV and scratch for."""
    if spec.decode_path == "compiled":
        raise ConfigError(f"{spec.method}: method.decode_path=compiled traces the whole one-token step, which needs "
                          "every expert resident (target_only); offloading methods decide residency on the host "
                          "every layer: use method.decode_path=compact")
    device, dtype = spec.torch_device, spec.torch_dtype
    K = spec.K if K is None else K
    M = resident if resident is not None else spec.resident
    om = load_offloaded(checkpoint, device, dtype, pin_memory=device.type == "cuda")
    digest = checkpoint_digest(checkpoint)
    layers = om.moe_layers
    expert_bytes = om.store.nbytes_per_expert
    non_expert = non_expert_bytes(om.model)
    params = link_params(spec, checkpoint, expert_bytes, digest)
    link = make_link(
        params.kind,
        **({"bandwidth_bytes_per_s": params.bandwidth_bytes_per_s, "latency_s": params.latency_s}
           if params.kind == "emulated" else {"device": device} if params.kind == "cuda" else {}),
    )
    cache = ExpertCache(om.store, link, {layer: M for layer in layers}, device, dtype, staging=staging)
    moe = MoERuntime(TargetExecutor(cache, spec.schedule)).attach(om.experts.values())
    footprint = Footprint(
        non_expert=non_expert,
        cache_slots=cache.slot_bytes(),
        staging=cache.staging_bytes(),
        draft_experts=0,
        kv_cache=batch_size * kv_bytes_per_token(om.model, device, dtype) * (spec.sequence_tokens + K + 1),
        scratch=scratch_bytes(om.model.config, K, batch_size, dtype),
    )
    cache.reset()  # the KV probe above ran through the cache
    full = non_expert + expert_bytes * len(layers) * om.num_experts
    decoder = compact_over(om.model, spec.sequence_tokens + K + 2) if spec.decode_path == "compact" else None
    return Runtime(om, cache, link, moe, params, footprint, spec.budget.resolve(full), M, digest, decoder,
                   planned=spec.planned)


def staging_for(spec: MethodSpec, rt: Runtime, footprint: Footprint) -> int:
    """The staging buffers of a cache-owning method whose design (slots, draft, KV, scratch; no
    staging) takes `footprint` on `rt`: the one rule of `specter.offload.budget.staging_buffers`."""
    design = replace(footprint, staging=0)
    return staging_buffers(spec.staging, design, rt.budget_bytes, rt.om.store.nbytes_per_expert,
                           len(rt.om.moe_layers), spec.staging_per_layer,
                           per_request_bytes=design.kv_cache + design.scratch, batch_sizes=spec.batch_sizes)


def final_runtime(rt: Runtime, resident: int, staging: int, draft: dict | None = None, draft_bytes: int = 0,
                  separate_draft: dict[str, int] | None = None, what: str = "") -> Runtime:
    """The runtime a method decodes through, at its final size: `rt`'s model, host store and link, a
    cache of `resident` slots per layer and `staging` buffers (`rt`'s own when the size is the same),
    a MoE runtime with the draft experts attached, the draft's bytes in the footprint (and a
    separate draft's own `non_expert` copy, `kv_cache` and `scratch`); refused if over budget.
    Nothing is reassigned after.

    A runtime sized by the real model's plan (`rt.planned`, assembly.real_plan) takes the plan's slots and
    staging instead of the method's own sizing on the tiny tier, and the plan's budget check stands for
    the tiny tier's (the method's own numbers stay in its env.json entries)."""
    planned = rt.planned
    if planned is not None:
        resident, staging = planned.resident, planned.staging(len(rt.om.moe_layers))
    if not 1 <= resident <= rt.om.num_experts:
        raise ConfigError(f"{resident} resident experts per layer: need 1..{rt.om.num_experts}")
    old = rt.cache
    cache = old if (resident, staging) == (rt.resident, old.staging) else ExpertCache(
        old.store, rt.link, {layer: resident for layer in old.layers}, old.device, old.dtype, staging=staging)
    moe = MoERuntime(TargetExecutor(cache, rt.moe.target.schedule),
                     DraftExecutor(draft, draft_forward) if draft else None).attach(rt.om.experts.values())
    sep = separate_draft or {}
    footprint = replace(rt.footprint, cache_slots=cache.slot_bytes(), staging=cache.staging_bytes(),
                        draft_experts=draft_bytes, draft_non_expert=sep.get("non_expert", 0),
                        kv_cache=rt.footprint.kv_cache + sep.get("kv_cache", 0),
                        scratch=rt.footprint.scratch + sep.get("scratch", 0))
    final = replace(rt, cache=cache, moe=moe, resident=resident, footprint=footprint)
    if planned is None:
        final.check_budget(what + (f" with {staging} staging buffers" if staging else ""))
    return final


def calibration_spec(cfg: DictConfig) -> CalibrationSpec:
    """The run's GPTQ calibration source, read from the config once."""
    from specter.datasets import expand_datasets

    n = cfg.method.get("calibration_prompts")
    return CalibrationSpec(prompts=16 if n is None else int(n), datasets=tuple(expand_datasets(cfg.dataset.name)),
                           evaluated=int(cfg.num_prompts), assets_dir=str(cfg.assets_dir),
                           allow_hub=bool(cfg.allow_hub))


def calibration_batches(cal: CalibrationSpec, tokenizer, device: torch.device,
                        max_tokens: int = 128) -> list[torch.Tensor]:
    """GPTQ calibration prompts: taken after the evaluated ones, so no measured prompt calibrates its own draft.

    A dataset too small for that calibrates on its evaluated prompts (recorded by the caller);
    a malformed dataset file is an error, never a fallback.
    """
    from specter.datasets import TooFewPrompts, load_prompts

    batches = []
    per = max(1, cal.prompts // len(cal.datasets))
    for ds in cal.datasets:
        try:
            texts = load_prompts(ds, cal.evaluated + per, cal.assets_dir, allow_hub=cal.allow_hub)
        except TooFewPrompts:
            texts = load_prompts(ds, cal.evaluated, cal.assets_dir, allow_hub=cal.allow_hub)
        texts = texts[cal.evaluated:] or texts
        for text in texts[:per]:
            ids = tokenizer(text, add_special_tokens=False).input_ids[:max_tokens]
            if ids:
                batches.append(torch.tensor([ids], device=device))
    return batches


def gptq_draft_for(spec: MethodSpec, rt: Runtime, checkpoint: Path):
    """The GPTQ draft of this run (`spec.draft_bits` bits, groups of `spec.draft_group_size`): cached under
    $SPECTER_HOME keyed by weights, precision and calibration tokens."""
    from transformers import AutoTokenizer

    from specter.quant.calibration import calibration_digest, gptq_draft

    if spec.calibration.prompts < 1:
        raise ConfigError(f"method.calibration_prompts must be >= 1, got {spec.calibration.prompts}")
    batches = calibration_batches(spec.calibration, AutoTokenizer.from_pretrained(checkpoint), rt.cache.device)
    bits, group_size = spec.draft_bits, spec.draft_group_size
    bits_tag = "" if bits == 4 else f"b{bits}-"  # the paper's INT4 keeps its archive name
    path = (specter_home() / "drafts" / f"{safe_name(spec.model, 'model.name')}-{rt.weights_digest[:12]}"
            / f"gptq-{bits_tag}gs{group_size}-{calibration_digest(batches)[:12]}.safetensors")
    t = time.perf_counter()
    layers, info = gptq_draft(rt, batches, path, group_size, bits)
    return layers, {**info, "draft_build_s": round(time.perf_counter() - t, 2)}
