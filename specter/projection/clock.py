"""A virtual clock with the CUDA path's two streams (compute, copy) and events between them.

Nothing is timed and nothing sleeps: every operation advances its stream by a modelled cost.
The dependencies are the CUDA path's:

- ops on one stream run in order (a stream's time only moves forward);
- `wait(stream, event)` makes a stream start its next op no earlier than the event (and only
  that far: a stream already past the event does not move);
- a copy into an expert slot cannot start before the slot's last compute has finished (the slot
  is not overwritten while read), and a compute on an expert waits for its slot's copy event.

So a copy that overlaps compute costs the maximum of the two, never the sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STREAMS = ("compute", "copy")


@dataclass(frozen=True)
class Event:
    """The moment an enqueued op ends on its stream (seconds of virtual time)."""

    stream: str
    time: float
    op: str = ""


@dataclass
class _Slot:
    copy_done: Event | None = None  # the copy that filled the slot (copy -> compute)
    last_use: Event | None = None  # the last compute that read it (compute -> next overwrite)


@dataclass
class VirtualClock:
    """Two streams' current times, per-slot events, and a log of (stream, op, start, end)."""

    now: dict[str, float] = field(default_factory=lambda: {s: 0.0 for s in STREAMS})
    log: list[tuple[str, str, float, float]] = field(default_factory=list)
    slots: dict[object, _Slot] = field(default_factory=dict)

    def _check(self, stream: str) -> None:
        if stream not in self.now:
            raise ValueError(f"unknown stream {stream!r}; streams: {STREAMS}")

    def wait(self, stream: str, event: Event | None) -> None:
        """The stream's next op starts no earlier than `event` (a no-op when the stream is already past it)."""
        self._check(stream)
        if event is not None and event.time > self.now[stream]:
            self.now[stream] = event.time

    def enqueue(self, stream: str, op: str, cost: float, after: tuple[Event | None, ...] = ()) -> Event:
        """Run `op` for `cost` seconds on `stream` after its previous op and every event in `after`."""
        self._check(stream)
        if cost < 0:
            raise ValueError(f"{op}: cost must be >= 0, got {cost}")
        for ev in after:
            self.wait(stream, ev)
        start = self.now[stream]
        end = start + cost
        self.now[stream] = end
        self.log.append((stream, op, start, end))
        return Event(stream, end, op)

    # -- expert slots: the two orderings of specter/offload/cache.py, as events ------------------
    def _slot(self, slot: object) -> _Slot:
        return self.slots.setdefault(slot, _Slot())

    def copy_into(self, slot: object, op: str, cost: float) -> Event:
        """An H2D copy into `slot`: on the copy stream, not before the slot's last compute has finished."""
        s = self._slot(slot)
        ev = self.enqueue("copy", op, cost, after=(s.last_use,))
        s.copy_done = ev
        return ev

    def compute_on(self, slot: object, op: str, cost: float) -> Event:
        """A compute reading `slot`: on the compute stream, not before the slot's copy has landed."""
        s = self._slot(slot)
        ev = self.enqueue("compute", op, cost, after=(s.copy_done,))
        s.last_use = ev
        return ev

    def sync(self) -> float:
        """Both streams meet (a host synchronisation); returns that time."""
        t = max(self.now.values())
        for s in self.now:
            self.now[s] = t
        return t

    @property
    def elapsed(self) -> float:
        return max(self.now.values())
