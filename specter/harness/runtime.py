"""Assemble the offloading runtime for a run from its composed config.

This is the harness's boundary: it reads the config once and hands the engine typed values
(devices, dtypes, resident counts, link parameters, budgets). Shared by every method that
offloads experts (`offload_ar`, `specter`, the offloading baselines).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
import torch
from omegaconf import DictConfig

from specter.harness.config import ConfigError, resident_experts
from specter.harness.load_ratio import probe_model
from specter.models.loading import DTYPES, load_offloaded, non_expert_bytes
from specter.models.registry import ModelUnavailable, checkpoint_digest, checkpoint_problem, resolve_checkpoint
from specter.moe import MoERuntime
from specter.offload.budget import Footprint, kv_bytes_per_token
from specter.offload.cache import ExpertCache
from specter.offload.calibrate import LinkParams, calibrated_link, fixed_link, measure_layer_step
from specter.offload.link import make_link
from specter.offload.runtime import Runtime
from specter.paths import safe_name, specter_home

GB = 1e9


def model_checkpoint(cfg: DictConfig) -> Path:
    """The checkpoint folder of the configured model (built on first use for tiny models)."""
    m = cfg.model
    path = resolve_checkpoint(m.name, m.source, trained=bool(m.get("trained")), local_dir=m.get("local_dir"),
                              hf_id=m.get("hf_id"), revision=m.get("revision"))
    problem = checkpoint_problem(path, m.name, m.get("real"), offloads="schedule" in cfg.method)
    if problem:
        raise ModelUnavailable(problem)
    return path


def device_and_dtype(cfg: DictConfig) -> tuple[torch.device, torch.dtype]:
    hw = cfg.hardware
    if hw.dtype not in DTYPES:
        raise ConfigError(f"hardware.dtype={hw.dtype!r} is not one of {sorted(DTYPES)}")
    device = torch.device(hw.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("hardware=cuda needs a CUDA GPU, and torch.cuda.is_available() is False here; "
                          "use hardware=cpu or hardware=emulated")
    return device, DTYPES[hw.dtype]


def link_params(cfg: DictConfig, checkpoint: Path, expert_bytes: int, digest: str) -> LinkParams:
    hw = cfg.hardware
    if hw.link != "emulated":
        return LinkParams(kind=hw.link)
    if hw.get("bandwidth_gbps"):
        return fixed_link(expert_bytes, hw.bandwidth_gbps, hw.get("latency_us"))
    device, dtype = device_and_dtype(cfg)
    key = f"{safe_name(cfg.model.name, 'model.name')}-{digest[:12]}-{hw.dtype}-t{torch.get_num_threads()}"
    path = specter_home() / "calibration" / f"{key}.json"
    params = calibrated_link(expert_bytes, float(cfg.model.load_ratio), path,
                             lambda: measure_layer_step(probe_model(checkpoint, dtype, device)),
                             latency_us=hw.get("latency_us"), recalibrate=bool(hw.get("recalibrate")))
    print(f"emulated link for {cfg.model.name}: layer step {params.per_layer_step_s * 1e3:.3f} ms x load_ratio "
          f"{params.load_ratio} -> expert load {params.expert_load_s * 1e3:.3f} ms ({expert_bytes / 1e6:.2f} MB at "
          f"{params.bandwidth_bytes_per_s / 1e9:.3f} GB/s + {params.latency_s * 1e6:.0f} us) "
          f"[layer step {params.calibration_source}; calibration: {path}]",
          flush=True)
    return params


def budget_bytes(cfg: DictConfig, full_bytes: int) -> int:
    """The tier's device budget: `memory.budget_mb` if given, else the model's own tier entry."""
    mem = cfg.memory
    if mem.get("budget_mb") is not None:
        return int(float(mem.budget_mb) * (1 << 20))
    tier = cfg.model.tiers[mem.name]
    if tier.get("budget_gb") is not None:
        return int(float(tier.budget_gb) * GB)
    return int(float(tier.budget_fraction) * full_bytes)


def scratch_bytes(model_config, K: int, batch_size: int, dtype: torch.dtype) -> int:
    """Verification activations (a few [K+1, H] buffers per layer) and logits [K+1, V], per request."""
    return batch_size * (K + 1) * (model_config.hidden_size * 8 + model_config.vocab_size) * torch.finfo(dtype).bits // 8


def build_runtime(cfg: DictConfig, checkpoint: Path, K: int = 0, resident: int | None = None,
                  batch_size: int = 1, staging: int = 0) -> Runtime:
    """Everything but the draft; call `enforce_budget(...)` once the draft is known.

    K: speculative positions to reserve KV and scratch for (0 = autoregressive);
    resident: slots per MoE layer (default: the tier's M); staging: extra expert buffers
    shared by all layers (Mixtral-Offloading's), counted with the cache slots.
    """
    device, dtype = device_and_dtype(cfg)
    M = resident if resident is not None else resident_experts(cfg)
    om = load_offloaded(checkpoint, device, dtype, pin_memory=device.type == "cuda")
    digest = checkpoint_digest(checkpoint)
    layers = om.moe_layers
    expert_bytes = om.store.nbytes_per_expert
    non_expert = non_expert_bytes(om.model)
    seq = cfg.prefix_tokens + cfg.max_new_tokens + K + 1
    scratch = scratch_bytes(om.model.config, K, batch_size, dtype)
    params = link_params(cfg, checkpoint, expert_bytes, digest)
    link = make_link(
        params.kind,
        **({"bandwidth_bytes_per_s": params.bandwidth_bytes_per_s, "latency_s": params.latency_s}
           if params.kind == "emulated" else {"device": device} if params.kind == "cuda" else {}),
    )
    cache = ExpertCache(om.store, link, {layer: M for layer in layers}, device, dtype, staging=staging)
    moe = MoERuntime(cache, schedule=cfg.method.get("schedule") or "expert")
    for module in om.experts.values():
        module.runtime = moe
    footprint = Footprint(
        non_expert=non_expert,
        cache_slots=cache.device_bytes(),
        draft_experts=0,
        kv_cache=batch_size * kv_bytes_per_token(om.model, device, dtype) * seq,
        scratch=scratch,
    )
    cache.reset()  # the KV probe above ran through the cache
    full = non_expert + expert_bytes * len(layers) * om.num_experts
    return Runtime(om, cache, link, moe, params, footprint, budget_bytes(cfg, full), M, digest)


def resize_cache(rt: Runtime, resident: int, staging: int | None = None) -> Runtime:
    """The same runtime (model, host store, link) with `resident` slots per MoE layer
    (and `staging` shared staging buffers; None keeps the current count).

    For methods whose slot count follows from bytes only known once the model is loaded
    (a derived same-memory count, what fits beside a separate draft)."""
    if not 1 <= resident <= rt.om.num_experts:
        raise ConfigError(f"{resident} resident experts per layer: need 1..{rt.om.num_experts}")
    old = rt.cache
    cache = ExpertCache(old.store, rt.link, {layer: resident for layer in old.layers}, old.device, old.dtype,
                        staging=old.staging if staging is None else staging)
    rt.moe.cache = cache
    return replace(rt, cache=cache, resident=resident,
                   footprint=replace(rt.footprint, cache_slots=cache.device_bytes()))


def calibration_batches(cfg: DictConfig, tokenizer, device: torch.device, n_prompts: int,
                        max_tokens: int = 128) -> list[torch.Tensor]:
    """GPTQ calibration prompts: taken after the evaluated ones, so no measured prompt calibrates its own draft.

    A dataset too small for that calibrates on its evaluated prompts (recorded by the caller);
    a malformed dataset file is an error, never a fallback.
    """
    from specter.harness.datasets import TooFewPrompts, expand_datasets, load_prompts

    batches = []
    datasets = expand_datasets(cfg.dataset.name)
    per = max(1, n_prompts // len(datasets))
    for ds in datasets:
        try:
            texts = load_prompts(ds, cfg.num_prompts + per, cfg.assets_dir, allow_hub=cfg.allow_hub)
        except TooFewPrompts:
            texts = load_prompts(ds, cfg.num_prompts, cfg.assets_dir, allow_hub=cfg.allow_hub)
        texts = texts[cfg.num_prompts:] or texts
        for text in texts[:per]:
            ids = tokenizer(text, add_special_tokens=False).input_ids[:max_tokens]
            if ids:
                batches.append(torch.tensor([ids], device=device))
    return batches


def gptq_draft_for(cfg: DictConfig, rt: Runtime, checkpoint: Path, group_size: int = 128):
    """The GPTQ draft of this run: cached under $SPECTER_HOME keyed by weights and calibration tokens."""
    from transformers import AutoTokenizer

    from specter.quant.calibration import calibration_digest, gptq_draft

    n = int(cfg.method.calibration_prompts)
    if n < 1:
        raise ConfigError(f"method.calibration_prompts must be >= 1, got {n}")
    batches = calibration_batches(cfg, AutoTokenizer.from_pretrained(checkpoint), rt.cache.device, n)
    path = (specter_home() / "drafts" / f"{safe_name(cfg.model.name, 'model.name')}-{rt.weights_digest[:12]}"
            / f"gptq-gs{group_size}-{calibration_digest(batches)[:12]}.safetensors")
    t = time.perf_counter()
    layers, info = gptq_draft(rt, batches, path, group_size)
    return layers, {**info, "draft_build_s": round(time.perf_counter() - t, 2)}
