"""Host expert store: every routed target expert in host memory, one flat buffer each.

Each expert's ``gate_up [2I, H]`` (gate rows first, then up rows) and ``down [H, I]``
live back to back in ONE contiguous buffer, so moving an expert to a device slot is a
single copy. On CUDA machines the buffers are page-locked so copies can be
``non_blocking``; they are carved from one arena per MoE layer that is registered
with the driver as a whole (``cudaHostRegister``), which avoids the power-of-two
rounding of PyTorch's pinned allocator (a 17.3 MB expert would otherwise take 32 MB).

Layout of one expert's flat buffer (``numel = 3·I·H`` elements)::

    [ gate (I·H) | up (I·H) | down (H·I) ]
      \\______ gate_up [2I,H] ______/ \\_ down [H,I] _/
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

Part = Literal["gate", "up", "down"]
PARTS: tuple[Part, ...] = ("gate", "up", "down")



class IncompleteStore(RuntimeError):
    """Some expert parts were never written into the host store (a checkpoint lacks them)."""

class ExpertUID(NamedTuple):
    """A routed expert: decoder-layer index of its MoE block and expert id within it."""

    layer: int
    expert: int


@dataclass(frozen=True)
class ExpertLayout:
    """Shape and dtype of one routed expert; maps a flat buffer to its two weights."""

    hidden: int  # H
    intermediate: int  # I
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.hidden < 1 or self.intermediate < 1:
            raise ValueError(f"expert dims must be positive, got H={self.hidden}, I={self.intermediate}")

    @property
    def gate_up_numel(self) -> int:
        return 2 * self.intermediate * self.hidden

    @property
    def down_numel(self) -> int:
        return self.hidden * self.intermediate

    @property
    def numel(self) -> int:
        return self.gate_up_numel + self.down_numel

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-copy ``(gate_up [2I,H], down [H,I])`` views of one expert's flat buffer."""
        if flat.dim() != 1 or flat.numel() != self.numel or not flat.is_contiguous():
            raise ValueError(f"expected a contiguous flat buffer of {self.numel} elements, got {tuple(flat.shape)}")
        if flat.dtype != self.dtype:
            raise ValueError(f"expected dtype {self.dtype}, got {flat.dtype}")
        H, I = self.hidden, self.intermediate
        gate_up = flat[: self.gate_up_numel].view(2 * I, H)
        down = flat[self.gate_up_numel :].view(H, I)
        return gate_up, down

    def part_view(self, flat: torch.Tensor, part: Part) -> torch.Tensor:
        """View of one checkpoint tensor inside the flat buffer: gate/up ``[I,H]``, down ``[H,I]``."""
        gate_up, down = self.views(flat)
        I = self.intermediate
        if part == "gate":
            return gate_up[:I]
        if part == "up":
            return gate_up[I:]
        if part == "down":
            return down
        raise ValueError(f"unknown expert part {part!r}; expected one of {PARTS}")

    def part_shape(self, part: Part) -> tuple[int, int]:
        H, I = self.hidden, self.intermediate
        return (H, I) if part == "down" else (I, H)


def _cuda_host_register(arena: torch.Tensor) -> bool:
    """Page-lock an existing host tensor in place; False where the runtime lacks the call."""
    try:
        cudart = torch.cuda.cudart()
        # flag 1 = cudaHostRegisterPortable: pinned for every CUDA context
        err = cudart.cudaHostRegister(arena.data_ptr(), arena.numel() * arena.element_size(), 1)
    except (AttributeError, AssertionError, RuntimeError):
        return False
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed ({err}) for a {arena.nbytes / 2**30:.2f} GiB host arena")
    return True


def _cuda_host_unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown or driver already gone: nothing left to release
        pass


class HostExpertStore:
    """All routed experts of the listed MoE layers, one contiguous host buffer per expert.

    Tracks which parts (gate/up/down) of each expert were written so a partially loaded
    checkpoint is caught by :meth:`assert_complete` before any inference runs.
    """

    def __init__(self, layout: ExpertLayout, moe_layers: list[int], num_experts: int, pin_memory: bool = False):
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if len(set(moe_layers)) != len(moe_layers) or not moe_layers:
            raise ValueError(f"moe_layers must be a non-empty list of distinct layer indices, got {moe_layers}")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs a CUDA machine; use pin_memory=False on CPU-only hosts")
        self.layout = layout
        self.moe_layers = list(moe_layers)
        self.num_experts = num_experts
        self.pinned = pin_memory
        self._arenas: dict[int, torch.Tensor] = {}
        self._buffers: dict[ExpertUID, torch.Tensor] = {}
        self._written: dict[ExpertUID, set[str]] = {}
        for layer in self.moe_layers:
            arena = torch.empty(num_experts, layout.numel, dtype=layout.dtype)  # [E, numel]
            if pin_memory:
                if _cuda_host_register(arena):
                    weakref.finalize(arena, _cuda_host_unregister, arena.data_ptr())
                else:  # fall back to PyTorch's pinned allocator
                    arena = torch.empty(num_experts, layout.numel, dtype=layout.dtype, pin_memory=True)
            self._arenas[layer] = arena
            for e in range(num_experts):
                uid = ExpertUID(layer, e)
                self._buffers[uid] = arena[e]  # contiguous row = one expert's flat buffer
                self._written[uid] = set()

    # -- access -------------------------------------------------------------------------
    def _check(self, uid: ExpertUID) -> ExpertUID:
        uid = ExpertUID(*uid)
        if uid not in self._buffers:
            raise KeyError(
                f"no expert {uid} in the store (MoE layers {self.moe_layers}, experts 0..{self.num_experts - 1})"
            )
        return uid

    def buffer(self, uid: ExpertUID) -> torch.Tensor:
        """The expert's flat host buffer ``[numel]`` (what a transfer link copies)."""
        return self._buffers[self._check(uid)]

    def views(self, uid: ExpertUID) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-copy host ``(gate_up [2I,H], down [H,I])`` of one expert."""
        return self.layout.views(self.buffer(uid))

    @property
    def nbytes_per_expert(self) -> int:
        return self.layout.nbytes

    @property
    def total_bytes(self) -> int:
        return self.layout.nbytes * self.num_experts * len(self.moe_layers)

    # -- filling ------------------------------------------------------------------------
    def write(self, uid: ExpertUID, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Write a whole expert from fused ``gate_up [2I,H]`` and ``down [H,I]`` (dtype converted)."""
        uid = self._check(uid)
        dst_gate_up, dst_down = self.layout.views(self._buffers[uid])
        for name, src, dst in (("gate_up", gate_up, dst_gate_up), ("down", down, dst_down)):
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"{uid} {name}: expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
        dst_gate_up.copy_(gate_up)
        dst_down.copy_(down)
        self._written[uid].update(PARTS)

    def write_part(self, uid: ExpertUID, part: Part, tensor: torch.Tensor) -> None:
        """Write one checkpoint tensor: gate -> rows [0,I) of gate_up, up -> rows [I,2I), or down."""
        uid = self._check(uid)
        if part not in PARTS:
            raise ValueError(f"unknown expert part {part!r}; expected one of {PARTS}")
        expected = self.layout.part_shape(part)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{uid} {part}: expected shape {expected}, got {tuple(tensor.shape)}")
        self.layout.part_view(self._buffers[uid], part).copy_(tensor)
        self._written[uid].add(part)

    def missing(self) -> dict[ExpertUID, list[str]]:
        """Experts with parts never written, and which parts."""
        return {uid: [p for p in PARTS if p not in done] for uid, done in self._written.items() if len(done) < 3}

    def assert_complete(self) -> None:
        """Raise if any expert part was never written (names the first few offenders)."""
        missing = self.missing()
        if missing:
            first = list(missing.items())[:8]
            shown = ", ".join(f"layer {u.layer} expert {u.expert} ({'/'.join(p)})" for u, p in first)
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise IncompleteStore(f"host expert store incomplete: {len(missing)} experts missing parts: {shown}{more}")
