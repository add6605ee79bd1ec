"""The INT4 draft: routed experts quantized from the host store, resident on the device.

Everything else of the draft *is* the target (the same tensor objects), so the draft costs only
its packed expert weights. `quant=rtn` (round-to-nearest, fast, for tests) or `quant=gptq`
(GPTQ on calibration prompts, cached beside the model with a checksum); records say which.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

import torch

from specter.kernels.draft_moe import (DequantWorkspace, Int4mmWeights, choose_backend, draft_moe_fused, int4mm_nbytes,
                                      prepare_int4mm)
from specter.quant.int4 import Int4ExpertLayer, concat_experts, default_group_size, packed_nbytes, quantize_rtn

QUANT_METHODS = ("rtn", "gptq")


@dataclass
class DraftExperts:
    """One MoE layer's draft experts, resident on the device in exactly one INT4 layout.

    On the CPU the packed GPTQ-style tensors are repacked once into torch's int4mm layout and
    then dropped (the draft decodes one token per step, the int4mm regime). On a GPU the packed
    layout feeds `kernel`: the fused Triton W4A16 MoE ("triton"), the grouped dequantize-and-multiply
    path ("torch"), or per-expert Marlin GEMMs ("marlin", repacked once; packed then dropped).
    """

    packed: Int4ExpertLayer | None
    prepared: Int4mmWeights | None
    method: str = "rtn"
    workspace: DequantWorkspace | None = None
    kernel: str = "torch"  # "torch" | "triton" | "marlin" (see specter.kernels.select)
    marlin: Any = None  # specter.kernels.marlin_moe.MarlinExperts when kernel == "marlin"

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in (self.packed, self.prepared, self.marlin) if part is not None)


def draft_forward(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, d: DraftExperts, act_fn) -> torch.Tensor:
    """The fused multi-expert draft MoE for one layer: x [T,H] -> [T,H]."""
    if d.packed is None:
        # One token (a B=1 draft step): int4mm. Several (a batched draft step): int4mm while its
        # T·A work stays small for the dtype, else the grouped path on the same int4mm layout.
        many = x.shape[0] > 1 and choose_backend(x, topk_idx, d.prepared) != "int4mm"
        return draft_moe_fused(x, topk_idx, topk_w, None, None, act_fn, backend="grouped" if many else "int4mm",
                               prepared=d.prepared)
    return draft_moe_fused(x, topk_idx, topk_w, d.packed.gate_up, d.packed.down, act_fn,
                           prepared=d.prepared, workspace=d.workspace)


def layer_weights(store, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A layer's host-store experts as views, not stacked: gate_up[e] [2I, H], down[e] [H, I]
    (a stacked copy of Phi-3.5-MoE's layer alone is 5 GB in fp32)."""
    from specter.offload.store import ExpertUID

    views = [store.views(ExpertUID(layer, e)) for e in range(store.num_experts)]
    return [v[0] for v in views], [v[1] for v in views]


def quantize_layer_rtn(gate_up: Sequence[torch.Tensor], down: Sequence[torch.Tensor],
                       group_size: int = 128) -> Int4ExpertLayer:
    """RTN INT4 of a layer's experts (gate_up[e] [2I, H], down[e] [H, I]; stacked or views), one expert at a time."""
    gs_gu = default_group_size(gate_up[0].shape[-1], group_size)
    gs_dn = default_group_size(down[0].shape[-1], group_size)
    return Int4ExpertLayer(concat_experts([quantize_rtn(w[None], gs_gu) for w in gate_up]),
                           concat_experts([quantize_rtn(w[None], gs_dn) for w in down]))


def draft_layer_nbytes(experts: int, hidden: int, inter: int, device_type: str, dtype: torch.dtype,
                       group_size: int = 128, kernel: str = "torch") -> int:
    """Device bytes `build_draft` keeps for one MoE layer of these shapes (`DraftExperts.nbytes`), without
    quantizing: the int4mm layout on the CPU, the packed INT4 layout (fp16 scales) for the triton and
    torch kernels on a GPU. Marlin's repacked layout is not modelled (ValueError)."""
    gs_gu, gs_dn = default_group_size(hidden, group_size), default_group_size(inter, group_size)
    if device_type == "cpu":
        return int4mm_nbytes(experts, 2 * inter, hidden, gs_gu, dtype) + int4mm_nbytes(experts, hidden, inter, gs_dn, dtype)
    if kernel == "marlin":
        raise ValueError("the Marlin draft layout's bytes are not modelled; plan with draft_kernel=triton or torch")
    return packed_nbytes(experts, 2 * inter, hidden, gs_gu) + packed_nbytes(experts, hidden, inter, gs_dn)


def build_draft(om, quant: str, device: torch.device, dtype: torch.dtype, group_size: int = 128,
                packed_layers: dict[int, Int4ExpertLayer] | None = None, kernel: str = "torch") -> dict[int, DraftExperts]:
    """Place every MoE layer's INT4 experts on the device: given (e.g. GPTQ) or quantized here (RTN).

    `kernel` (GPU only; see `specter.kernels.select.select_draft_kernel`) picks the layout kept."""
    if quant not in QUANT_METHODS:
        raise ValueError(f"unknown draft quantization {quant!r}; choose one of {QUANT_METHODS}")
    if quant == "gptq" and packed_layers is None:
        raise ValueError("a GPTQ draft needs its packed layers (see specter.quant.calibration.gptq_draft)")
    draft = {}
    for layer in om.moe_layers:
        if packed_layers is not None:
            packed = packed_layers[layer]
        else:
            packed = quantize_layer_rtn(*layer_weights(om.store, layer), group_size)
        packed = Int4ExpertLayer(packed.gate_up.to(device), packed.down.to(device))
        if device.type == "cpu":
            draft[layer] = DraftExperts(None, prepare_int4mm(packed.gate_up, packed.down, dtype), quant)
        elif kernel == "marlin":
            from specter.kernels.marlin_moe import prepare_marlin

            draft[layer] = DraftExperts(None, None, quant, kernel="marlin", marlin=prepare_marlin(packed, dtype, device))
        else:
            draft[layer] = DraftExperts(packed, None, quant, kernel=kernel)
    return draft
