"""GPTQ calibration for the draft: capture the hidden states the target routes to each expert,
quantize, and cache the packed draft beside the model with a checksum.

The caller chooses the calibration token batches and where the archive is cached (the harness
takes prompts after the evaluated ones and keys the archive by the target weights' digest).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specter.paths import atomic_write_text, file_sha256
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

    with rt.moe.mode("target", host_compute=True, capture=record), torch.inference_mode():
        for ids in token_batches:
            rt.model(input_ids=ids)
    H = rt.om.store.layout.hidden
    return {layer: [torch.cat(xs) if xs else torch.zeros(0, H) for xs in per] for layer, per in captured.items()}


def save_draft(path: Path, layers: dict[int, Int4ExpertLayer]) -> None:
    """Write the archive and its `.sha256` so that a crash at any point leaves either nothing
    usable (the archive is rebuilt next time) or a complete, verifiable pair.

    Order: archive to a temp file (fsynced), checksum written atomically, archive renamed into
    place last. A `.sha256` without its archive is harmless; an archive never exists without
    the checksum that matches it.
    """
    tensors, meta = {}, {}
    for layer, d in layers.items():
        for part in ("gate_up", "down"):
            p: Int4Experts = getattr(d, part)
            tensors[f"{layer}.{part}.qweight"] = p.qweight.contiguous().cpu()
            tensors[f"{layer}.{part}.scales"] = p.scales.contiguous().cpu()
            meta[f"{layer}.{part}"] = {"group_size": p.group_size, "method": p.method,
                                       "rtn_fallback_experts": list(p.rtn_fallback_experts)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        save_file(tensors, tmp, metadata={"specter": json.dumps(meta)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        atomic_write_text(path.with_suffix(".sha256"), file_sha256(tmp) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_draft(path: Path) -> dict[int, Int4ExpertLayer]:
    sums = path.with_suffix(".sha256")
    try:
        expected = sums.read_text().strip()
    except OSError:
        expected = None
    if expected != file_sha256(path):
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


def calibration_digest(batches: list[torch.Tensor]) -> str:
    """sha256 over the calibration token ids: part of the draft archive's cache key."""
    return hashlib.sha256(b"|".join(b.cpu().numpy().tobytes() for b in batches)).hexdigest()


def gptq_draft(rt, batches: list[torch.Tensor], path: Path,
               group_size: int = 128, bits: int = 4) -> tuple[dict[int, Int4ExpertLayer], dict]:
    """The GPTQ draft for these calibration batches: loaded from `path`, else quantized and saved there."""
    from specter.quant.draft import layer_weights
    from specter.quant.gptq import gptq_quantize_experts

    if path.exists() and path.with_suffix(".sha256").exists():  # no checksum: an interrupted build, redo it
        return load_draft(path), {"draft_archive": str(path), "cached": True, "bits": bits}
    inputs = capture_expert_inputs(rt, batches)
    layers = {}
    for layer in rt.om.moe_layers:
        gate_up, down = layer_weights(rt.om.store, layer)
        layers[layer] = gptq_quantize_experts(gate_up, down, inputs[layer], rt.om.experts[layer].act_fn, group_size,
                                              bits=bits)
    save_draft(path, layers)
    fallback = sum(len(d.rtn_fallback_experts) for d in layers.values())
    return layers, {"draft_archive": str(path), "cached": False, "calibration_prompts": len(batches), "bits": bits,
                    "rtn_fallback_experts": fallback}
