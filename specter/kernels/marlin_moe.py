"""Marlin backend of the INT4 draft MoE (CUDA only; for comparison with the Triton kernel).

Each expert's gate_up and down become one gptqmodel `MarlinLinear` (Marlin's W4A16 GEMM, the
kernel of the paper's Fig. 10), converted once from our packing through `to_gptq_tensors`:

    Int4Experts [E, N, K/8] ──to_gptq_tensors──► qweight [K/8, N], scales [G, N] ──post_init──► Marlin tiles
    x [T, H], topk [T, k] ──for each active expert e (host loop)──►
        gate, up = Marlin(x[tok], gate_up[e]).chunk(2)        # [n, I] each
        y = Marlin(act(gate)·up, down[e]) · topk_w[tok, slot]  # [n, H]
        out.index_add_(0, tok, y)                              # ascending expert id, as the reference

Not fused across experts: finding the active experts reads them on the host (one sync per
call) and costs 2 launches per active expert, so `select.py` never picks it by default.
gptqmodel compiles its Marlin extension on first use (needs nvcc; can take minutes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specter.kernels.reference import grouped_moe
from specter.quant.int4 import Int4ExpertLayer, Int4Experts, to_gptq_tensors

ActFn = Callable[[torch.Tensor], torch.Tensor]


def marlin_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when gptqmodel's Marlin kernels can run on `device` for `dtype`, else why not.

    May JIT-compile gptqmodel's Marlin extension on a CUDA machine (minutes, once per machine).
    """
    if device.type != "cuda":
        return f"Marlin needs a CUDA device, not {device.type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"Marlin runs fp16/bf16 activations, not {dtype}"
    from specter.quiet import quiet_import

    try:
        with quiet_import():  # gptqmodel's banner stays out of the run's output
            from gptqmodel.utils.marlin import marlin_runtime_available, marlin_runtime_error
    except Exception as exc:  # gptqmodel missing or broken
        return f"gptqmodel's Marlin is not importable: {exc}"
    try:
        if not marlin_runtime_available(dtype):
            return f"gptqmodel's Marlin runtime is unavailable: {marlin_runtime_error(dtype)}"
    except Exception as exc:
        return f"gptqmodel's Marlin runtime check failed: {exc}"
    return None


def _marlin_linear(packed: Int4Experts, expert: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from gptqmodel.nn_modules.qlinear.marlin import MarlinLinear

    qweight, qzeros, scales, g_idx = to_gptq_tensors(packed, expert)  # [K/8, N], [G, N/8], [G, N], [K]
    lin = MarlinLinear(bits=4, group_size=packed.group_size, desc_act=False, sym=True,
                       in_features=packed.in_features, out_features=packed.out_features, bias=False, dtype=dtype)
    lin.qweight.data = qweight.to(device)
    lin.qzeros.data = qzeros.to(device)
    lin.scales.data = scales.to(device, dtype)
    lin.g_idx.data = g_idx.to(device)
    lin = lin.to(device)
    lin.post_init()  # repack to Marlin's tile layout on the device
    return lin.eval()


@dataclass
class MarlinExperts:
    """One MoE layer's draft experts as Marlin linears (gate_up [2I, H] and down [H, I] per expert)."""

    gate_up: list[torch.nn.Module]
    down: list[torch.nn.Module]

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the Marlin modules hold (weights, scales, workspaces)."""
        seen: set[int] = set()
        total = 0
        for m in (*self.gate_up, *self.down):
            for t in (*m.parameters(), *m.buffers()):
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
        return total


def prepare_marlin(layer: Int4ExpertLayer, dtype: torch.dtype, device: torch.device) -> MarlinExperts:
    """Convert one layer's packed INT4 experts to Marlin modules on `device` (once, at load time)."""
    reason = marlin_unavailable(device, dtype)
    if reason is not None:
        raise RuntimeError(reason)
    e = layer.gate_up.num_experts
    return MarlinExperts([_marlin_linear(layer.gate_up, i, dtype, device) for i in range(e)],
                         [_marlin_linear(layer.down, i, dtype, device) for i in range(e)])


@torch.inference_mode()
def marlin_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, experts: MarlinExperts,
               act_fn: ActFn) -> torch.Tensor:
    """Routed-expert MoE with one Marlin GEMM per projection per active expert: x [T, H] -> [T, H]."""

    def ffn(e: int, xs: torch.Tensor) -> torch.Tensor:
        gate, up = experts.gate_up[e](xs).chunk(2, dim=-1)  # [n, I] each
        return experts.down[e](act_fn(gate) * up)  # [n, H]

    return grouped_moe(x, topk_idx, topk_w, len(experts.gate_up), ffn)  # host sync: the backend's known cost
