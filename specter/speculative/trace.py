"""Per-window traces of the speculative pipeline, and the lower bound a perfect scheduler could reach.

A `WindowTracer` records, for every window, when the draft ran, where the planner's boundaries
fell, every expert copy (submitted / started / landed, bytes), every verification MoE layer and
expert (waiting for its copy, computing), and the residents each layer started the window with.
Times are milliseconds since the record's start. Host-timed links only (cpu, emulated): on CUDA
the copies run on their own stream and are not traced here.

The lower bound of one window, under the same device buffers (`window_limits`; M below is a
layer's slots plus its share of the staging buffers, `engine.plan_capacity`):

    D   draft time (measured; the draft's compute is not what we try to hide)
    V   verification compute, waits excluded (measured)
    t   one expert load (the link model: latency + bytes / bandwidth)
    for layer l, with R_l its residents at window start and W_l the experts verification used:
        free_l = M − |W_l ∩ R_l|          slots the draft may overwrite without losing a needed expert
        pre_l  = min(|W_l − R_l|, free_l)  loads that can be hidden behind the draft
        m_l    = |W_l − R_l| − pre_l       loads that must wait until layer l frees a slot, i.e. overlap
                                           only layer l's own expert compute c_l
        v_l    = c_l + m_l·t  (M = 1: load and compute serialize)   else max(c_l, m_l·t)
    spill = max(0, Σ pre_l·t − D)           draft-phase loads the draft was too short to hide
    limit = D + max(V, (V − Σ c_l) + Σ v_l, spill + Σ m_l·t)

Every term is something no scheduler with these slots, this draft and this link can avoid, so
`limit` is a lower bound on the window's time (it ignores the compute after the last copy).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TraceEvent:
    window: int
    event: str  # draft | boundary | copy | moe | wait | compute | verify
    start_ms: float
    end_ms: float
    layer: int | None = None
    expert: int | None = None
    bytes: int = 0
    phase: str = ""
    queued_ms: float = 0.0  # copies: time between submission and the link starting it

    def as_row(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class WindowInfo:
    window: int
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    K: int = 0
    accepted: int = 0
    residents: dict[int, set[int]] = field(default_factory=dict)  # at window start
    used: dict[int, set[int]] = field(default_factory=dict)  # experts verification computed


class WindowTracer:
    """Collects `TraceEvent`s; the engine, the MoE runtime and the link report into it."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.window = -1
        self.events: list[TraceEvent] = []
        self.windows: list[WindowInfo] = []

    def now_ms(self, t: float | None = None) -> float:
        return ((time.perf_counter() if t is None else t) - self.t0) * 1e3

    def begin_window(self, residents: dict[int, set[int]], K: int) -> None:
        self.window += 1
        self.windows.append(WindowInfo(self.window, K=K, residents={k: set(v) for k, v in residents.items()}))

    def span(self, event: str, start: float, end: float, **kw: Any) -> None:
        """Record an event between two perf_counter() readings."""
        if self.window >= 0:
            self.events.append(TraceEvent(self.window, event, self.now_ms(start), self.now_ms(end), **kw))

    def on_copy(self, tag: Any, nbytes: int, submitted: float, start: float, finish: float) -> None:
        """`TransferLink.observer`: one landed copy (runs on the copy thread)."""
        layer, expert = (tag.layer, tag.expert) if tag is not None and hasattr(tag, "layer") else (None, None)
        self.events.append(TraceEvent(max(self.window, 0), "copy", self.now_ms(start), self.now_ms(finish),
                                      layer, expert, nbytes, queued_ms=(start - submitted) * 1e3))

    def rows(self) -> list[dict[str, Any]]:
        return [e.as_row() for e in sorted(self.events, key=lambda e: (e.window, e.start_ms))]


def window_limits(tracer: WindowTracer, capacity: dict[int, int], load_ms: float) -> list[dict[str, Any]]:
    """Per window: measured time, the lower bound (module docstring), and where the difference goes."""
    by_window: dict[int, list[TraceEvent]] = defaultdict(list)
    for e in tracer.events:
        by_window[e.window].append(e)
    out = []
    for info in tracer.windows:
        evs = by_window.get(info.window, [])
        D = info.draft_ms
        waits = sum(e.end_ms - e.start_ms for e in evs if e.event == "wait")
        compute_l: dict[int, float] = defaultdict(float)
        for e in evs:
            if e.event == "compute":
                compute_l[e.layer] += e.end_ms - e.start_ms
        V = max(info.verify_ms - waits, 0.0)
        non_moe = max(V - sum(compute_l.values()), 0.0)
        pre_total, m_total, v_sum = 0.0, 0.0, 0.0
        for layer, M in capacity.items():
            W, R = info.used.get(layer, set()), info.residents.get(layer, set())
            misses = len(W - R)
            free = M - len(W & R)
            pre = min(misses, free)
            m = misses - pre
            c = compute_l.get(layer, 0.0)
            v_sum += c + m * load_ms if M == 1 else max(c, m * load_ms)
            pre_total += pre * load_ms
            m_total += m * load_ms
        spill = max(0.0, pre_total - D)
        limit = D + max(V, non_moe + v_sum, spill + m_total)
        actual = D + info.verify_ms
        draft_start = min((e.start_ms for e in evs if e.event == "draft"), default=0.0)
        draft_end = draft_start + D
        busy_in_draft = sum(max(0.0, min(e.end_ms, draft_end) - max(e.start_ms, draft_start))
                            for e in evs if e.event == "copy")
        queued = sum(e.queued_ms for e in evs if e.event == "copy")
        out.append({
            "window": info.window, "K": info.K, "accepted": info.accepted,
            "actual_ms": actual, "limit_ms": limit, "ratio": actual / limit if limit > 0 else None,
            "draft_ms": D, "verify_compute_ms": V, "verify_wait_ms": waits,
            "loads_needed": round((pre_total + m_total) / load_ms) if load_ms else 0,
            "link_idle_in_draft_ms": max(0.0, min(D, pre_total) - busy_in_draft),
            "copy_queued_ms": queued,
        })
    return out
