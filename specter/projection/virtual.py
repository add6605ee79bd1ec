"""The engine itself on a modelled device: a virtual link and an operation meter over one `VirtualClock`.

The method runs for real on the tiny proxy (its tokens, routes, cache decisions, planner and
acceptance are the engine's own), and every operation it does is charged to the clock at the
*real* model's cost (`cost_model.CostModel`):

    MoERuntime.experts_forward ─► meter.layer         attention + norms + router + shared, per real layer
    DraftExecutor              ─► meter.draft_experts the fused INT4 draft kernel, per real layer
    expert_wise_moe            ─► meter.expert        one FP16 routed expert on its tokens, per real layer
    lm_head forward hook       ─► meter.head          lm_head on its tokens (a forward ends here)
    VirtualLink.submit         ─► copy stream         one expert's H2D, per real layer

Layer mapping: tiny MoE layer j stands for the contiguous block of real MoE layers
`mapping.layer_blocks` gives it (b_j layers); each of its operations is charged b_j times the real
layer's cost, and its cache (the real tier's M slots) stands for each of the b_j real layers' caches,
which see the same routes up to a permutation of expert ids (`mapping.RouteMap`) and so the same
hits and misses. The real model's dense layers (DeepSeek-V2's layer 0) are charged before the first
MoE layer.

Dependencies are the CUDA path's: a copy is submitted when the host submits it (the host has just
read the routes, so no earlier than the compute stream's now), after the slot's last use
(`TransferLink.use_marker`, passed back by the cache as ``after=``); `Ticket.wait()` moves the
compute stream to the copy's event and `Ticket.done()` compares the event with the compute stream's
now. Copies happen synchronously (the data is right); nothing sleeps.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from specter.metrics import CommitClock
from specter.offload.instruments import Instruments
from specter.offload.link import Ticket, TransferLink
from specter.projection.clock import Event, VirtualClock
from specter.projection.cost_model import CostModel
from specter.projection.mapping import layer_blocks


@dataclass
class Forward:
    """One timed forward: when its lm_head ended on the compute stream, and which instance ran it."""

    end: float
    kind: str  # "target" | "draft"
    tokens: int


@dataclass
class CopyRecord:
    layer: int
    buffer: int  # the device buffer's address: slot identity (staging buffers keep theirs as they move)
    submit: float
    start: float
    end: float


@dataclass
class VirtualMachine:
    """The clock, the cost model and the proxy -> real layer blocks; implements `specter.moe.OpMeter`."""

    cm: CostModel
    tiny_layers: list[int]
    fused_draft: bool = True
    clock: VirtualClock = field(default_factory=VirtualClock)
    forwards: list[Forward] = field(default_factory=list)
    copies: list[CopyRecord] = field(default_factory=list)
    reads: dict[int, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))  # buffer -> computes
    keep_log: bool = True
    on_target_head: Any = None  # called once (then cleared) when the next target forward ends: a decode's start state

    def __post_init__(self) -> None:
        layers = sorted(self.tiny_layers)
        blocks = layer_blocks(len(layers), self.cm.s.moe_layers)
        self.block = {layer: len(b) for layer, b in zip(layers, blocks)}  # tiny MoE layer -> real layers it stands for
        self.first = layers[0]
        self.dense = self.cm.s.num_layers - self.cm.s.moe_layers  # the real model's dense layers
        self._t_expert: dict[int, float] = {}
        self._t_h2d = self.cm.h2d()

    # -- time
    @property
    def now(self) -> float:
        """The compute stream's time: when the host (which follows compute) does the next thing."""
        return self.clock.now["compute"]

    def _compute(self, op: str, cost: float, after: tuple[Event | None, ...] = ()) -> Event:
        ev = self.clock.enqueue("compute", op, cost, after)
        if not self.keep_log:
            self.clock.log.clear()
        return ev

    # -- OpMeter
    def layer(self, layer: int, tokens: int) -> None:
        cm, cost = self.cm, self.block[layer] * self.cm.dense_layer(tokens)
        if layer == self.first and self.dense:
            cost += self.dense * cm.dense_only_layer(tokens)
        self._compute(f"L{layer} attn+router+shared", cost)

    def draft_experts(self, layer: int, topk_idx: torch.Tensor) -> None:
        ids = topk_idx[topk_idx < self.cm.s.num_experts]  # [n]: a dropped route is id E
        distinct = int(torch.unique(ids).numel()) if ids.numel() else 0
        op = self.cm.draft_experts(distinct, self.fused_draft, routes=int(ids.numel()))
        self._compute(f"L{layer} draft experts", self.block[layer] * self.cm.t(op, int4=True))

    def expert(self, uid: Any, tokens: int, buffer: torch.Tensor) -> None:
        if tokens not in self._t_expert:
            self._t_expert[tokens] = self.cm.t(self.cm.expert(tokens))
        ev = self._compute(f"L{uid.layer} expert {uid.expert}", self.block[uid.layer] * self._t_expert[tokens])
        self.reads[buffer.data_ptr()].append((ev.time - self.block[uid.layer] * self._t_expert[tokens], ev.time))

    def resident_experts(self, layer: int, tokens: int) -> None:
        """target_only: the layer's routed experts, every one on the device (k per token, distinct up to E)."""
        s = self.cm.s
        distinct = min(s.num_experts, tokens * s.top_k)
        per = -(-tokens * s.top_k // distinct)  # tokens per expert, rounded up
        self._compute(f"L{layer} resident experts", self.block[layer] * distinct * self.cm.t(self.cm.expert(per)))

    def readback(self) -> None:
        """The ELB's counts of every real MoE layer (int32 [L, E]) read back to plan a prefetch."""
        s, d = self.cm.s, self.cm.d
        self._compute("plan D2H", d.d2h_latency + s.moe_layers * s.num_experts * 4 / d.d2h_bandwidth)

    def head(self, tokens: int, kind: str) -> None:
        ev = self._compute(f"lm_head {kind}", self.cm.t(self.cm.lm_head(tokens)))
        self.forwards.append(Forward(ev.time, kind, tokens))
        if kind == "target" and self.on_target_head is not None:
            hook, self.on_target_head = self.on_target_head, None
            hook()

    # -- the copy stream
    def copy(self, tag: Any, buffer: torch.Tensor, after: Any) -> Event:
        layer = getattr(tag, "layer", self.first)
        submit = Event("compute", self.now, "host submits")
        ev = self.clock.enqueue("copy", f"h2d L{layer} expert {getattr(tag, 'expert', '?')}",
                                self.block.get(layer, 1) * self._t_h2d,
                                after=(submit, after if isinstance(after, Event) else None))
        start = ev.time - self.block.get(layer, 1) * self._t_h2d
        self.copies.append(CopyRecord(layer, buffer.data_ptr(), submit.time, start, ev.time))
        if not self.keep_log:
            self.clock.log.clear()
        return ev

    def real_loads(self, since: float = float("-inf")) -> int:
        """Real expert copies (each proxy copy stands for b_j) submitted at or after `since`."""
        return sum(self.block.get(c.layer, 1) for c in self.copies if c.submit >= since)

    def copy_busy(self, t0: float, t1: float) -> float:
        """Seconds the copy stream spent copying inside [t0, t1]."""
        return sum(max(0.0, min(c.end, t1) - max(c.start, t0)) for c in self.copies)


class VirtualTicket(Ticket):
    """A copy that has landed in memory and lands on the clock at `event`."""

    def __init__(self, nbytes: int, event: Event, machine: VirtualMachine):
        self.nbytes, self.event, self.machine = nbytes, event, machine

    def done(self) -> bool:
        return self.event.time <= self.machine.now

    def wait(self) -> float:
        """The compute stream waits for the copy (no further); returns that stall in virtual seconds."""
        stall = max(0.0, self.event.time - self.machine.now)
        self.machine.clock.wait("compute", self.event)
        return stall


class VirtualLink(TransferLink):
    """A `TransferLink` on the machine's copy stream: each copy is real (synchronous) and modelled."""

    def __init__(self, machine: VirtualMachine):
        super().__init__()
        self.machine = machine

    def submit(self, src_flat: torch.Tensor, dst_flat: torch.Tensor, *, after: Any = None, tag: Any = None) -> Ticket:
        nbytes = self._check_submit(src_flat, dst_flat)
        dst_flat.copy_(src_flat)
        ev = self.machine.copy(tag, dst_flat, after)
        rec = self.machine.copies[-1]
        self._stats.busy_seconds += rec.end - rec.start
        return VirtualTicket(nbytes, ev, self.machine)

    def synchronize(self) -> None:
        """Every copy's data is already in place; on the clock nothing moves (callers sync the clock)."""

    def use_marker(self) -> Event:
        return Event("compute", self.machine.now, "slot released")


class VirtualCommitClock(CommitClock):
    """A request's commit clock read from the compute stream: a commit is stamped when the host (which
    follows compute) makes it, so batched TPOT and throughput are virtual seconds like everything else."""

    def __init__(self, machine: VirtualMachine):
        super().__init__()
        self.machine = machine

    def start(self) -> None:
        super().start()
        self.start_s = self.machine.now

    def commit(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.stamps.append(self.machine.now - self.excluded_s)
            self.counts.append(num_tokens)


# -- attaching a built method --------------------------------------------------------------------

def instruments_of(machine: VirtualMachine) -> Instruments:
    """What a method on the machine is measured by: a `VirtualLink` (its copies on the copy stream), the machine
    as the MoE runtimes' meter, the machine's time as the planner's step clock and commits stamped on it."""
    return Instruments(link=VirtualLink(machine), meter=machine, step_clock=lambda: machine.now,
                       commit_clock=lambda: VirtualCommitClock(machine))


def _lm_head(model: torch.nn.Module) -> torch.nn.Module:
    head = getattr(model, "lm_head", None)
    if head is None:
        raise TypeError(f"{type(model).__name__} has no lm_head module to time forwards by")
    return head


def _head_hook(machine: VirtualMachine, moe, kind: str | None):
    def hook(module, args, out) -> None:
        if moe is not None and moe.untimed:
            return  # probes and calibration from the host store are never timed
        hidden = args[0]
        mode = kind or (moe.current if moe is not None else "target")
        machine.head(hidden.numel() // hidden.shape[-1], mode)
    return hook


def attach(method, machine: VirtualMachine) -> list:
    """Make a method built by `build_method` run on the machine: the method is handed the machine's instruments
    (`instruments_of`: its link becomes a `VirtualLink`, its MoE runtimes report to the meter, its planner reads the
    clock; `Method.instrument`), and hooks on its lm_heads end forwards. Returns the hook handles (remove them to
    detach the hooks)."""
    from specter.models.arch import moe_blocks

    handles = []
    rt = method.rt
    if rt is None:  # target_only: every expert resident, transformers' own MoE blocks
        model = method.model
        for layer, block in moe_blocks(model).items():
            def pre(module, args, kwargs, layer=layer):
                hidden = args[0] if args else kwargs["hidden_states"]  # [B, T, H]
                n = hidden.numel() // hidden.shape[-1]
                machine.layer(layer, n)
                machine.resident_experts(layer, n)
            handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(_lm_head(model).register_forward_hook(_head_hook(machine, None, "target")))
        return handles
    method.instrument(instruments_of(machine))
    handles.append(_lm_head(rt.model).register_forward_hook(_head_hook(machine, rt.moe, None)))
    draft_moe, draft_model = method.draft_moe, method.draft_model
    if draft_moe is not None and draft_model is not None:  # a separate draft instance (SpecMoEOff): metered too
        handles.append(_lm_head(draft_model).register_forward_hook(_head_hook(machine, draft_moe, "draft")))
    return handles
