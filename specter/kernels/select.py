"""Which kernel runs the INT4 draft's routed experts: `draft_kernel = auto | triton | marlin | torch`.

    triton : `triton_moe.fused_moe_w4a16` — two fused launches per layer, no host sync (CUDA).
    marlin : `marlin_moe.marlin_moe` — gptqmodel's Marlin GEMM per active expert (CUDA, comparison).
    torch  : `draft_moe.draft_moe_fused` — int4mm / grouped paths (any device; the CPU default).
    auto   : the first available of AUTO_ORDER on a CUDA device, "torch" elsewhere.

Marlin is never chosen by "auto": it loops over experts with a host sync and its first use may
compile gptqmodel's extension for minutes; request it explicitly to compare. Availability is
probed by small functions (device, dtype) -> reason or None, injectable so tests can pretend
to be on a GPU. The choice and every probe's answer go to env.json through `KernelChoice.as_dict`.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping

import torch

DraftKernel = Literal["auto", "triton", "marlin", "torch"]
KERNELS: tuple[str, ...] = ("triton", "marlin", "torch")
AUTO_ORDER: tuple[str, ...] = ("triton", "torch")  # fastest first (Triton: one launch per projection, no sync)

Probe = Callable[[torch.device, torch.dtype], "str | None"]


def triton_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the Triton draft kernel can run on `device` (a CUDA GPU with triton installed)."""
    if device.type != "cuda":
        return f"the Triton draft kernel runs on CUDA devices, not {device.type} (CPU: interpreter tests only)"
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"unsupported activation dtype {dtype}"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install -e '.[gpu]')"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return None


def marlin_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    from specter.kernels.marlin_moe import marlin_unavailable as probe

    return probe(device, dtype)


def torch_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    return None


PROBES: Mapping[str, Probe] = {"triton": triton_unavailable, "marlin": marlin_unavailable, "torch": torch_unavailable}


@dataclass(frozen=True)
class KernelChoice:
    """The requested and selected draft kernel, with the reason of every probe that ran."""

    requested: str
    selected: str
    device: str
    probed: dict[str, str | None] = field(default_factory=dict)  # kernel -> None (available) or why not

    def as_dict(self) -> dict[str, object]:
        """For env.json: {"requested", "selected", "device", "unavailable": {kernel: reason}}."""
        return {"requested": self.requested, "selected": self.selected, "device": self.device,
                "unavailable": {k: v for k, v in self.probed.items() if v is not None}}


def select_draft_kernel(requested: str, device: torch.device | str, dtype: torch.dtype,
                        probes: Mapping[str, Probe] = PROBES) -> KernelChoice:
    """Resolve `requested` to a kernel that can run; an explicit but unavailable request is an error.

    Probes run lazily in order, so "auto" on a GPU with triton never touches Marlin.
    """
    device = torch.device(device)
    if requested not in ("auto", *KERNELS):
        raise ValueError(f"unknown draft_kernel {requested!r}; choose auto or one of {KERNELS}")
    probed: dict[str, str | None] = {}
    if requested != "auto":
        probed[requested] = probes[requested](device, dtype)
        if probed[requested] is not None:
            raise RuntimeError(f"draft_kernel={requested} cannot run here: {probed[requested]}")
        return KernelChoice(requested, requested, str(device), probed)
    if device.type == "cuda":
        for name in AUTO_ORDER:
            probed[name] = probes[name](device, dtype)
            if probed[name] is None:
                return KernelChoice(requested, name, str(device), probed)
    return KernelChoice(requested, "torch", str(device), probed)
