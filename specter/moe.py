"""Specter's routed-experts module: one model instance, two modes.

Every MoE block keeps its own router and shared experts; only `block.experts` is replaced by
`SpecterExperts`, called exactly like transformers' fused experts module:
`experts(hidden [T,H], topk_idx [T,k], topk_w [T,k]) -> [T,H]`. All layers consult one
`MoERuntime`, which says which mode the shared instance is in:

    draft   resident INT4 experts, fused multi-expert kernel; routes counted into the ELB
    target  FP experts from the per-layer device cache, expert-wise (or token-wise) schedule
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from specter.kernels.reference import expert_ffn, grouped_moe
from specter.offload.residency import expert_wise_moe, token_wise_moe

if TYPE_CHECKING:
    from specter.offload.cache import ExpertCache
    from specter.predict.elb import ExpertLoadBuffer

SCHEDULES = ("expert", "token")


@dataclass
class RouteLog:
    """The target's routes per window and MoE layer: which experts, and how many (token, slot) routes
    each took (for metrics, the I/O oracle and the routing-diversity figure)."""

    windows: list[dict[int, set[int]]] = field(default_factory=list)
    counts: list[dict[int, Counter]] = field(default_factory=list)

    def begin_window(self) -> None:
        self.windows.append({})
        self.counts.append({})

    def add(self, layer: int, topk_idx: torch.Tensor) -> None:
        if not self.windows:
            self.begin_window()
        ids = topk_idx.flatten().tolist()
        self.windows[-1].setdefault(layer, set()).update(ids)
        self.counts[-1].setdefault(layer, Counter()).update(ids)

    def rows(self) -> list[dict[str, int]]:
        """One row per (window, layer, expert) with its route count."""
        return [{"window": w, "layer": layer, "expert": e, "count": n}
                for w, per_layer in enumerate(self.counts)
                for layer, counter in sorted(per_layer.items()) for e, n in sorted(counter.items())]


Mode = Literal["target", "draft"]


@dataclass
class MoERuntime:
    """Shared state every `SpecterExperts` layer consults.

    Change the mode only through `mode(...)`, which restores the previous state on exit, so no
    caller can leave the shared instance in draft mode or with a stale ELB / route log attached.
    """

    cache: ExpertCache
    schedule: str = "expert"  # target-mode schedule: "expert" | "token"
    draft: dict[int, Any] | None = None  # MoE layer -> INT4 draft experts (resident)
    draft_forward: Callable[..., torch.Tensor] | None = None  # fused draft kernel
    current: Mode = "target"
    elb: ExpertLoadBuffer | None = None  # counted in draft mode
    route_log: RouteLog | None = None  # target routes per window, when metrics need them
    host_compute: bool = False  # target experts straight from the host store (untimed probes only)
    capture: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None  # calibration hook
    expert_filter: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    tracer: Any = None  # specter.speculative.trace.WindowTracer: per-layer / per-expert verification spans

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown target schedule {self.schedule!r}; choose one of {SCHEDULES}")

    @contextmanager
    def mode(self, mode: Mode, *, elb: ExpertLoadBuffer | None = None, route_log: RouteLog | None = None,
             host_compute: bool = False, capture=None, expert_filter=None) -> Iterator[MoERuntime]:
        """Run the shared instance as the draft or the target inside the block; always restored."""
        if mode not in ("target", "draft"):
            raise ValueError(f"unknown MoE mode {mode!r}")
        if mode == "draft" and self.draft is None:
            raise RuntimeError("draft mode needs the INT4 draft experts attached (moe.draft)")
        saved = (self.current, self.elb, self.route_log, self.host_compute, self.capture, self.expert_filter)
        self.current, self.elb, self.route_log = mode, elb, route_log
        self.host_compute, self.capture, self.expert_filter = host_compute, capture, expert_filter
        try:
            yield self
        finally:
            (self.current, self.elb, self.route_log, self.host_compute, self.capture, self.expert_filter) = saved

    def experts_forward(self, layer: int, x, topk_idx, topk_w, act_fn) -> torch.Tensor:
        if self.current == "draft":
            if self.elb is not None:
                self.elb.add(layer, topk_idx)
            return self.draft_forward(x, topk_idx, topk_w, self.draft[layer], act_fn)
        routed = topk_idx
        if self.expert_filter is not None:  # e.g. verification-time expert budgeting (lossy baselines)
            topk_idx, topk_w = self.expert_filter(layer, topk_idx, topk_w)  # a dropped route becomes id E ("no expert")
            routed = topk_idx[topk_idx < self.cache.store.num_experts]  # [n]
        if self.route_log is not None:
            self.route_log.add(layer, routed)
        if self.capture is not None:
            self.capture(layer, x, topk_idx)
        if self.host_compute:
            return host_moe(x, topk_idx, topk_w, layer, self.cache.store, act_fn)
        if self.schedule == "token":
            return token_wise_moe(x, topk_idx, topk_w, layer, self.cache, act_fn)
        if self.tracer is None:
            return expert_wise_moe(x, topk_idx, topk_w, layer, self.cache, act_fn)
        t0 = time.perf_counter()
        out = expert_wise_moe(x, topk_idx, topk_w, layer, self.cache, act_fn, tracer=self.tracer)
        self.tracer.span("moe", t0, time.perf_counter(), layer=layer)
        return out


class SpecterExperts(torch.nn.Module):
    """Drop-in replacement for a transformers fused experts module (no parameters of its own)."""

    def __init__(self, layer: int, act_fn: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.layer = layer
        self.act_fn = act_fn
        self.runtime: MoERuntime | None = None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.runtime is None:
            raise RuntimeError(f"SpecterExperts of layer {self.layer} has no runtime attached")
        return self.runtime.experts_forward(self.layer, hidden_states, top_k_index, top_k_weights, self.act_fn)

    def extra_repr(self) -> str:
        return f"layer={self.layer}"


def host_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, layer: int, store, act_fn) -> torch.Tensor:
    """Routed experts computed from host-store views, HF's order; bypasses the device cache."""
    from specter.offload.store import ExpertUID

    def ffn(e: int, xs: torch.Tensor) -> torch.Tensor:
        gate_up, down = (w.to(x.device) for w in store.views(ExpertUID(layer, e)))
        return expert_ffn(xs, gate_up, down, act_fn)  # [n, H]

    return grouped_moe(x, topk_idx, topk_w, store.num_experts, ffn)
