"""Specter's routed-experts module: one model instance, two modes.

Every MoE block keeps its own router and shared experts; only `block.experts` is replaced by
`SpecterExperts`, called exactly like transformers' fused experts module:
`experts(hidden [T,H], topk_idx [T,k], topk_w [T,k]) -> [T,H]`. All layers consult one
`MoERuntime`, which runs one of two immutable executors under one set of `Observers`:

    draft   DraftExecutor: resident INT4 experts, fused multi-expert kernel; routes counted into the ELB
    target  TargetExecutor: FP experts from the per-layer device cache, expert-wise (or token-wise)
            schedule; route log, expert filter, calibration capture and tracer watch it

    with moe.mode("draft", elb=elb): ...            # the one way to switch; restored on exit
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from specter.kernels.reference import expert_ffn, grouped_moe
from specter.offload.residency import expert_wise_moe, token_wise_moe

if TYPE_CHECKING:
    from specter.offload.cache import ExpertCache
    from specter.predict.elb import ExpertLoadBuffer

SCHEDULES = ("expert", "token")


@dataclass
class RouteLog:
    """The target's routes per window and MoE layer: which experts, how many (token, slot) routes
    each took, and how many tokens the router saw (for metrics, the I/O oracle and the
    routing-diversity figure)."""

    windows: list[dict[int, set[int]]] = field(default_factory=list)
    counts: list[dict[int, Counter]] = field(default_factory=list)
    tokens: list[dict[int, int]] = field(default_factory=list)  # tokens routed per window and layer

    def begin_window(self) -> None:
        self.windows.append({})
        self.counts.append({})
        self.tokens.append({})

    def add(self, layer: int, topk_idx: torch.Tensor, tokens: int | None = None) -> None:
        """Routes of one pass through `layer`: `topk_idx [T, k]`, or the routes a filter kept (flat) with
        `tokens`, the T tokens the router saw (a filter's dropped routes do not make a token unrouted)."""
        if not self.windows:
            self.begin_window()
        ids = topk_idx.flatten().tolist()
        self.windows[-1].setdefault(layer, set()).update(ids)
        self.counts[-1].setdefault(layer, Counter()).update(ids)
        n = tokens if tokens is not None else (topk_idx.shape[0] if topk_idx.dim() == 2 else 0)
        self.tokens[-1][layer] = self.tokens[-1].get(layer, 0) + int(n)

    def rows(self) -> list[dict[str, int]]:
        """One row per (window, layer, expert) with its route count."""
        return [{"window": w, "layer": layer, "expert": e, "count": n}
                for w, per_layer in enumerate(self.counts)
                for layer, counter in sorted(per_layer.items()) for e, n in sorted(counter.items())]


Mode = Literal["target", "draft"]
ExpertFilter = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Observers:
    """What watches the routed experts of the forwards inside one `MoERuntime.mode(...)`."""

    elb: ExpertLoadBuffer | None = None  # draft routes counted for the planner
    route_log: RouteLog | None = None  # target routes per window, when metrics need them
    expert_filter: ExpertFilter | None = None  # verification-time route filter (MoE-Spec's budget, padding)
    capture: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None  # calibration hook (layer, x, idx)
    tracer: Any = None  # specter.speculative.trace.WindowTracer: per-layer / per-expert verification spans
    meter: OpMeter | None = None  # charges each operation's modelled cost (specter/projection); None: nothing


NO_OBSERVERS = Observers()


class OpMeter(Protocol):
    """What a modelled time base is told about the work the routed-experts path does (the projection's
    virtual machine implements it; nothing in normal runs). Calls arrive in execution order."""

    def layer(self, layer: int, tokens: int) -> None:
        """A MoE layer's non-routed work (attention, norms, router, shared experts) on `tokens` tokens."""

    def draft_experts(self, layer: int, topk_idx: torch.Tensor) -> None:
        """The fused INT4 draft kernel over one layer's routes ``topk_idx [T, k]``."""

    def expert(self, uid: Any, tokens: int, buffer: torch.Tensor) -> None:
        """One routed FP expert on its `tokens` tokens, reading the device slot `buffer`."""

    def readback(self) -> None:
        """The host reads the draft's route counts back for a prefetch plan (one D2H copy)."""


@dataclass(frozen=True)
class DraftExecutor:
    """The shared instance as the draft: resident INT4 experts through the fused draft kernel."""

    experts: dict[int, Any]  # MoE layer -> INT4 draft experts (specter.quant.draft.DraftExperts)
    forward: Callable[..., torch.Tensor]  # fused draft kernel (x, idx, w, experts, act_fn) -> [T, H]

    def __call__(self, layer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, act_fn,
                 seen: Observers) -> torch.Tensor:
        if seen.elb is not None:
            seen.elb.add(layer, topk_idx)
        if seen.meter is not None:
            seen.meter.draft_experts(layer, topk_idx)
        return self.forward(x, topk_idx, topk_w, self.experts[layer], act_fn)


@dataclass(frozen=True)
class TargetExecutor:
    """The shared instance as the target: FP experts through the per-layer device cache on the
    expert-wise (or token-wise) schedule, or, with `host`, straight from the host store (untimed
    probes and calibration only)."""

    cache: ExpertCache
    schedule: str = "expert"  # "expert" | "token"
    host: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown target schedule {self.schedule!r}; choose one of {SCHEDULES}")

    def __call__(self, layer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, act_fn,
                 seen: Observers) -> torch.Tensor:
        routed, tokens = topk_idx, topk_idx.shape[0]  # [T, k], T
        if seen.expert_filter is not None:  # a dropped route becomes id E ("no expert")
            topk_idx, topk_w = seen.expert_filter(layer, topk_idx, topk_w)
            routed = topk_idx[topk_idx < self.cache.store.num_experts]  # [n]
        if seen.route_log is not None:
            seen.route_log.add(layer, routed, tokens)
        if seen.capture is not None:
            seen.capture(layer, x, topk_idx)
        if self.host:
            return host_moe(x, topk_idx, topk_w, layer, self.cache.store, act_fn)
        if self.schedule == "token":
            return token_wise_moe(x, topk_idx, topk_w, layer, self.cache, act_fn, meter=seen.meter)
        if seen.tracer is None:
            return expert_wise_moe(x, topk_idx, topk_w, layer, self.cache, act_fn, meter=seen.meter)
        t0 = time.perf_counter()
        out = expert_wise_moe(x, topk_idx, topk_w, layer, self.cache, act_fn, tracer=seen.tracer, meter=seen.meter)
        seen.tracer.span("moe", t0, time.perf_counter(), layer=layer)
        return out


class MoERuntime:
    """The executors every `SpecterExperts` layer consults, and which one runs now.

    The executors and observers are immutable; the only state is which executor runs with which
    observers, and it changes only through `mode(...)`, which restores it on exit, so no caller can
    leave the shared instance in draft mode or with a stale ELB / route log attached.
    """

    def __init__(self, target: TargetExecutor, draft: DraftExecutor | None = None):
        self.target, self.draft = target, draft
        self.host = replace(target, host=True)
        self._active: TargetExecutor | DraftExecutor = target
        self._seen = NO_OBSERVERS
        self._meter: OpMeter | None = None

    @property
    def meter(self) -> OpMeter | None:
        """The modelled time base every timed pass reports its work to (None: nothing is charged)."""
        return self._meter

    @meter.setter
    def meter(self, meter: OpMeter | None) -> None:
        self._meter = meter
        self._seen = replace(self._seen, meter=meter)

    @property
    def untimed(self) -> bool:
        """True while experts come straight from the host store (probes, calibration: never timed)."""
        return self._active is self.host

    @property
    def current(self) -> Mode:
        return "draft" if self._active is self.draft else "target"

    def attach(self, modules) -> MoERuntime:
        """Make `modules` (the model's `SpecterExperts`) consult this runtime."""
        for module in modules:
            module.runtime = self
        return self

    @contextmanager
    def mode(self, mode: Mode, *, elb: ExpertLoadBuffer | None = None, route_log: RouteLog | None = None,
             host_compute: bool = False, capture=None, expert_filter: ExpertFilter | None = None,
             tracer: Any = None) -> Iterator[MoERuntime]:
        """Run the shared instance as the draft or the target (from the host store with `host_compute`)
        inside the block, watched by the given observers; always restored."""
        if mode not in ("target", "draft"):
            raise ValueError(f"unknown MoE mode {mode!r}")
        if mode == "draft" and self.draft is None:
            raise RuntimeError("draft mode needs the INT4 draft experts attached (a DraftExecutor)")
        saved = (self._active, self._seen)
        self._active = self.draft if mode == "draft" else self.host if host_compute else self.target
        self._seen = Observers(elb, route_log, expert_filter, capture, tracer, self._meter)
        try:
            yield self
        finally:
            self._active, self._seen = saved

    def experts_forward(self, layer: int, x, topk_idx, topk_w, act_fn) -> torch.Tensor:
        if self._meter is not None and not self.untimed:
            self._meter.layer(layer, x.shape[0])
        return self._active(layer, x, topk_idx, topk_w, act_fn, self._seen)


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
