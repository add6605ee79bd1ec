"""Assemble the offloading runtime for a run: model, host store, link, per-layer cache, budget.

Shared by every method that offloads experts (`offload_ar`, `specter`). The emulated link's
bandwidth is calibrated once per (model, machine) so that loading one expert costs
`model.load_ratio` × the measured per-layer decode step — the ratio PCIe 4.0 has to an A100
layer step for the corresponding real model — and cached so every method of a benchmark sees
the same link.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from specter.harness.config import effective_K, resident_experts
from specter.models.loading import OffloadedModel, load_offloaded, non_expert_bytes
from specter.models.tiny import specter_home
from specter.moe import MoERuntime
from specter.offload.budget import Footprint, check_budget, kv_bytes_per_token
from specter.offload.cache import ExpertCache
from specter.offload.link import TransferLink, make_link

GB = 1e9


@dataclass
class LinkParams:
    kind: str
    bandwidth_bytes_per_s: float | None = None
    latency_s: float | None = None
    per_layer_step_s: float | None = None
    expert_load_s: float | None = None
    load_ratio: float | None = None
    calibrated: bool = False

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Runtime:
    om: OffloadedModel
    cache: ExpertCache
    link: TransferLink
    moe: MoERuntime
    link_params: LinkParams
    footprint: Footprint
    budget_bytes: int
    resident: int  # M

    @property
    def model(self) -> torch.nn.Module:
        return self.om.model

    def close(self) -> None:
        self.link.close()

    def enforce_budget(self, draft_bytes: int = 0, what: str = "") -> None:
        """Add the draft's resident bytes and refuse a footprint over the tier's budget."""
        from dataclasses import replace

        self.footprint = replace(self.footprint, draft_experts=draft_bytes)
        try:
            check_budget(self.footprint, self.budget_bytes, what)
        except Exception:
            self.close()
            raise


def measure_layer_step(checkpoint: Path, device: torch.device, dtype: torch.dtype, steps: int = 24) -> float:
    """Median one-token decode step of the full model (all experts on the device) / its layer count."""
    from transformers import DynamicCache

    from specter.harness.methods import load_full_model

    model = load_full_model(checkpoint, dtype, device)
    ids = torch.arange(16, device=device)[None]  # [1, 16]
    times = []
    with torch.inference_mode():
        for _ in range(3):
            cache = DynamicCache(config=model.config)
            model(input_ids=ids, cache=cache)
            tok = ids[:, -1:]
            for _ in range(steps // 3):
                t = time.perf_counter()
                model(input_ids=tok, cache=cache)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
    return statistics.median(times) / model.config.num_hidden_layers


def calibrated_link(cfg: DictConfig, checkpoint: Path, expert_bytes: int, device, dtype) -> LinkParams:
    hw = cfg.hardware
    if hw.link != "emulated":
        return LinkParams(kind=hw.link)
    if hw.get("bandwidth_gbps"):
        bw = float(hw.bandwidth_gbps) * GB
        lat = float(hw.latency_us or 0) * 1e-6
        return LinkParams("emulated", bw, lat, expert_load_s=lat + expert_bytes / bw)
    ratio = float(cfg.model.load_ratio)
    key = f"{cfg.model.name}{'-trained' if cfg.model.get('trained') else ''}-{hw.dtype}-t{torch.get_num_threads()}"
    path = specter_home() / "calibration" / f"{key}.json"
    if path.exists() and not hw.get("recalibrate"):
        per_layer = json.loads(path.read_text())["per_layer_step_s"]
    else:
        per_layer = measure_layer_step(checkpoint, device, dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"per_layer_step_s": per_layer, "measured": time.strftime("%F %T")}))
    load_s = ratio * per_layer
    latency = float(hw.latency_us) * 1e-6 if hw.get("latency_us") is not None else 0.05 * load_s
    bandwidth = expert_bytes / max(load_s - latency, 1e-9)
    print(f"emulated link for {key}: layer step {per_layer * 1e3:.3f} ms x load_ratio {ratio} -> expert load "
          f"{load_s * 1e3:.3f} ms ({expert_bytes / 1e6:.2f} MB at {bandwidth / 1e9:.3f} GB/s + {latency * 1e6:.0f} us)"
          f" [calibration: {path}]", flush=True)
    return LinkParams("emulated", bandwidth, latency, per_layer, load_s, ratio, calibrated=True)


def budget_bytes(cfg: DictConfig, full_bytes: int) -> int:
    mem = cfg.memory
    if mem.get("budget_mb") is not None:
        return int(float(mem.budget_mb) * (1 << 20))
    if cfg.model.source == "tiny":
        return int(mem.budget_fraction[cfg.model.real] * full_bytes)
    return int(mem.budget_gb[cfg.model.name] * GB)


def build_runtime(cfg: DictConfig, checkpoint: Path, speculative: bool = False) -> Runtime:
    """Everything but the draft; call `enforce_budget(draft_bytes)` once the draft is known."""
    from specter.harness.methods import DTYPES

    device = torch.device(cfg.hardware.device)
    dtype = DTYPES[cfg.hardware.dtype]
    M = resident_experts(cfg)
    om = load_offloaded(checkpoint, device, dtype, pin_memory=device.type == "cuda")
    layers = om.moe_layers
    expert_bytes = om.store.nbytes_per_expert
    non_expert = non_expert_bytes(om.model)
    K = effective_K(cfg) if speculative else 0
    seq = cfg.prefix_tokens + cfg.max_new_tokens + K + 1
    cfgm = om.model.config
    scratch = (K + 1) * (cfgm.hidden_size * 8 + cfgm.vocab_size) * torch.finfo(dtype).bits // 8
    params = calibrated_link(cfg, checkpoint, expert_bytes, device, dtype)
    link = make_link(
        params.kind,
        **({"bandwidth_bytes_per_s": params.bandwidth_bytes_per_s, "latency_s": params.latency_s}
           if params.kind == "emulated" else {"device": device} if params.kind == "cuda" else {}),
    )
    cache = ExpertCache(om.store, link, {layer: M for layer in layers}, device, dtype)
    moe = MoERuntime(cache)
    for module in om.experts.values():
        module.runtime = moe
    footprint = Footprint(
        non_expert=non_expert,
        cache_slots=cache.device_bytes(),
        draft_experts=0,
        kv_cache=kv_bytes_per_token(om.model, device, dtype) * seq,
        scratch=scratch,
    )
    cache.reset()  # the KV probe above ran through the cache
    full = non_expert + expert_bytes * len(layers) * om.num_experts
    return Runtime(om, cache, link, moe, params, footprint, budget_bytes(cfg, full), M)
