"""GPTQ calibration for the draft: capture the hidden states the target routes to each expert,
quantize, and cache the packed draft beside the model with a checksum.

Calibration prompts come from the run's datasets, taken *after* the prompts that are evaluated
(so the measured prompts never calibrate their own draft) when the dataset has enough of them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from omegaconf import DictConfig
from safetensors.torch import load_file, save_file

from specter.models.tiny import specter_home
from specter.quant.int4 import Int4ExpertLayer, Int4Experts


class CorruptDraft(RuntimeError):
    """A cached draft archive failed its checksum or cannot be read."""


def capture_expert_inputs(rt, token_batches: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
    """layer -> per-expert hidden states [n_e, H] routed there by the target (host-store compute)."""
    captured: dict[int, list[list[torch.Tensor]]] = {
        layer: [[] for _ in range(rt.om.num_experts)] for layer in rt.om.moe_layers
    }

    def record(layer: int, x: torch.Tensor, topk_idx: torch.Tensor) -> None:
        for e in topk_idx.unique().tolist():
            rows = (topk_idx == e).any(dim=-1)  # [T]
            captured[layer][e].append(x[rows].detach().float().cpu())

    moe = rt.moe
    moe.mode, moe.host_compute, moe.capture = "target", True, record
    try:
        with torch.inference_mode():
            for ids in token_batches:
                rt.model(input_ids=ids)
    finally:
        moe.host_compute, moe.capture = False, None
    H = rt.om.store.layout.hidden
    return {layer: [torch.cat(xs) if xs else torch.zeros(0, H) for xs in per] for layer, per in captured.items()}


def calibration_batches(cfg: DictConfig, tokenizer, device, n_prompts: int, max_tokens: int = 128) -> list[torch.Tensor]:
    from specter.harness.datasets import expand_datasets, load_prompts

    batches = []
    datasets = expand_datasets(cfg.dataset.name)
    per = max(1, n_prompts // len(datasets))
    for ds in datasets:
        try:
            texts = load_prompts(ds, cfg.num_prompts + per, cfg.assets_dir, allow_hub=cfg.allow_hub)
        except ValueError:  # a small dataset: calibrate on the evaluated prompts themselves
            texts = load_prompts(ds, cfg.num_prompts, cfg.assets_dir, allow_hub=cfg.allow_hub)
        texts = texts[cfg.num_prompts:] or texts  # prefer prompts that are not evaluated
        for text in texts[:per]:
            ids = tokenizer(text, add_special_tokens=False).input_ids[:max_tokens]
            if ids:
                batches.append(torch.tensor([ids], device=device))
    return batches


def draft_cache_path(cfg: DictConfig, group_size: int, calib_digest: str) -> Path:
    name = f"{cfg.model.name}{'-trained' if cfg.model.get('trained') else ''}"
    return specter_home() / "drafts" / name / f"gptq-gs{group_size}-{calib_digest[:12]}.safetensors"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_draft(path: Path, layers: dict[int, Int4ExpertLayer]) -> None:
    tensors, meta = {}, {}
    for layer, d in layers.items():
        for part in ("gate_up", "down"):
            p: Int4Experts = getattr(d, part)
            tensors[f"{layer}.{part}.qweight"] = p.qweight.contiguous().cpu()
            tensors[f"{layer}.{part}.scales"] = p.scales.contiguous().cpu()
            meta[f"{layer}.{part}"] = {"group_size": p.group_size, "method": p.method,
                                       "rtn_fallback_experts": list(p.rtn_fallback_experts)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    save_file(tensors, tmp, metadata={"specter": json.dumps(meta)})
    tmp.rename(path)
    path.with_suffix(".sha256").write_text(_sha256(path) + "\n")


def load_draft(path: Path) -> dict[int, Int4ExpertLayer]:
    sums = path.with_suffix(".sha256")
    if not sums.exists() or sums.read_text().strip() != _sha256(path):
        raise CorruptDraft(f"draft archive {path} fails its checksum; delete it (and {sums.name}) to rebuild")
    try:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["specter"])
        tensors = load_file(path)
    except Exception as err:  # noqa: BLE001
        raise CorruptDraft(f"draft archive {path} cannot be read ({err}); delete it to rebuild") from None
    layers = {}
    for key in sorted({k.split(".")[0] for k in tensors}, key=int):
        parts = {}
        for part in ("gate_up", "down"):
            m = meta[f"{key}.{part}"]
            parts[part] = Int4Experts(tensors[f"{key}.{part}.qweight"], tensors[f"{key}.{part}.scales"],
                                      m["group_size"], method=m["method"],
                                      rtn_fallback_experts=tuple(m["rtn_fallback_experts"]))
        layers[int(key)] = Int4ExpertLayer(parts["gate_up"], parts["down"])
    return layers


def gptq_draft(rt, cfg: DictConfig, tokenizer, group_size: int = 128) -> tuple[dict[int, Int4ExpertLayer], dict]:
    """The GPTQ draft for this model and calibration set: from the cache, else quantized and cached."""
    from specter.draft import layer_weights
    from specter.quant.gptq import gptq_quantize_experts

    n = int(cfg.method.get("calibration_prompts", 16))
    batches = calibration_batches(cfg, tokenizer, rt.cache.device, n)
    digest = hashlib.sha256(b"|".join(b.cpu().numpy().tobytes() for b in batches)).hexdigest()
    path = draft_cache_path(cfg, group_size, digest)
    if path.exists():
        return load_draft(path), {"draft_archive": str(path), "cached": True}
    inputs = capture_expert_inputs(rt, batches)
    layers = {}
    for layer in rt.om.moe_layers:
        gate_up, down = layer_weights(rt.om.store, layer)
        layers[layer] = gptq_quantize_experts(gate_up, down, inputs[layer], rt.om.experts[layer].act_fn, group_size)
    save_draft(path, layers)
    fallback = sum(len(d.rtn_fallback_experts) for d in layers.values())
    return layers, {"draft_archive": str(path), "cached": False, "calibration_prompts": len(batches),
                    "rtn_fallback_experts": fallback}
