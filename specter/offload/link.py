"""Transfer links: host -> device expert copies behind one small interface.

Every link takes a flat source and destination buffer and returns a :class:`Ticket`
that the compute side can poll (``done``) or wait on (``wait``)::

    compute side                      link
    ------------                      ----
    t = link.submit(src, dst, after=ev) ──► FIFO ──► [wait `after`] ─► dst.copy_(src) ─► ticket set
    ...other work overlaps...
    t.wait()   # blocks only on this copy

- :class:`CudaLink`: a dedicated copy stream, ``non_blocking`` copies from pinned memory
  and one event per copy; ``wait`` orders the current compute stream after the event
  (no host synchronisation).
- :class:`EmulatedLink`: the CPU twin of a copy engine: a daemon thread drains a FIFO,
  really copies, and completes each copy no earlier than
  ``start + latency + nbytes / bandwidth`` with ``start = max(submit, previous finish)``.
- :class:`ImmediateLink`: synchronous copy, for CPU runs without emulated transfers.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch


class Ticket(ABC):
    """Handle on one submitted copy."""

    nbytes: int

    @abstractmethod
    def done(self) -> bool:
        """True once the copy has landed (never blocks)."""

    @abstractmethod
    def wait(self) -> float:
        """Make the caller's work follow the copy; return the seconds the host spent blocked."""


class CompletedTicket(Ticket):
    """A copy that has already landed (synchronous copies, experts loaded at start-up)."""

    def __init__(self, nbytes: int = 0):
        self.nbytes = nbytes

    def done(self) -> bool:
        return True

    def wait(self) -> float:
        return 0.0


@dataclass
class LinkStats:
    """Counters of one link. ``bytes_copied``/``copies`` count submitted copies (all landed
    once ``synchronize`` returns); ``busy_seconds`` is time the copy engine spent copying;
    ``stall_seconds`` is device time compute spent waiting for copies, where the device is
    asynchronous (CUDA: measured with events around each stream wait). On synchronous links
    the host is what waits, and the expert cache counts that as ``copy_wait_s``."""

    bytes_copied: int = 0
    copies: int = 0
    busy_seconds: float = 0.0
    stall_seconds: float = 0.0


class TransferLink(ABC):
    """Moves flat host buffers into flat device buffers, in submission (FIFO) order."""

    def __init__(self) -> None:
        self._stats = LinkStats()
        self._closed = False
        # Optional: called as observer(tag, nbytes, submitted_s, start_s, finish_s) once a copy has
        # landed (perf_counter seconds), for per-window traces. Host-timed links only (cpu, emulated).
        self.observer: Callable[[Any, int, float, float, float], None] | None = None

    @abstractmethod
    def submit(self, src_flat: torch.Tensor, dst_flat: torch.Tensor, *, after: Any = None, tag: Any = None) -> Ticket:
        """Queue ``dst_flat.copy_(src_flat)``; ``after`` is work the copy must follow
        (a ``torch.cuda.Event`` on CUDA; anything with ``wait()`` on the emulated link);
        ``tag`` names the copy for the observer (e.g. the expert)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until every submitted copy has landed."""

    def use_marker(self) -> Any:
        """What a slot's next copy must follow once the compute reading it is done, for links whose
        time is not the host's (passed back as ``after=``); None: the host's order is enough."""
        return None

    def close(self) -> None:
        self._closed = True

    @property
    def stats(self) -> LinkStats:
        return self._stats

    @property
    def bytes_copied(self) -> int:
        return self.stats.bytes_copied

    @property
    def copies(self) -> int:
        return self.stats.copies

    @property
    def busy_seconds(self) -> float:
        return self.stats.busy_seconds


    def _check_submit(self, src_flat: torch.Tensor, dst_flat: torch.Tensor) -> int:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        if src_flat.numel() != dst_flat.numel() or src_flat.dtype != dst_flat.dtype:
            raise ValueError(
                f"copy needs matching buffers, got src {tuple(src_flat.shape)} {src_flat.dtype} "
                f"and dst {tuple(dst_flat.shape)} {dst_flat.dtype}"
            )
        nbytes = src_flat.numel() * src_flat.element_size()
        self._stats.bytes_copied += nbytes
        self._stats.copies += 1
        return nbytes

    def __enter__(self) -> "TransferLink":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- immediate
class ImmediateLink(TransferLink):
    """Copies synchronously inside ``submit``; every ticket is already done."""

    def submit(self, src_flat: torch.Tensor, dst_flat: torch.Tensor, *, after: Any = None, tag: Any = None) -> Ticket:
        nbytes = self._check_submit(src_flat, dst_flat)
        if after is not None and hasattr(after, "wait"):
            after.wait()
        t0 = time.perf_counter()
        dst_flat.copy_(src_flat)
        t1 = time.perf_counter()
        self._stats.busy_seconds += t1 - t0
        if self.observer is not None:
            self.observer(tag, nbytes, t0, t0, t1)
        return CompletedTicket(nbytes)

    def synchronize(self) -> None:
        pass


# --------------------------------------------------------------------------- emulated
class _ThreadTicket(Ticket):
    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._event = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> float:
        t0 = time.perf_counter()
        self._event.wait()
        blocked = time.perf_counter() - t0
        if self._error is not None:
            raise RuntimeError("emulated copy failed") from self._error
        return blocked


@dataclass
class _Job:
    src: torch.Tensor
    dst: torch.Tensor
    after: Any
    ticket: _ThreadTicket
    submitted: float
    tag: Any = None


MAX_WAKE_LAG_S = 2e-3  # the emulated link's sleep compensation never exceeds this
SWITCH_INTERVAL_S = 2e-4  # the interpreter's GIL switch interval while an emulated link runs


class _ShortSwitchInterval:
    """The GIL switch interval held at SWITCH_INTERVAL_S while any emulated link is open, and the
    process's own value restored when the last one closes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved = 0.0

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, SWITCH_INTERVAL_S))
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                sys.setswitchinterval(self._saved)


SHORT_SWITCH = _ShortSwitchInterval()


class EmulatedLink(TransferLink):
    """One emulated copy engine: serialized copies, each lasting ``latency + nbytes/bandwidth``."""

    def __init__(self, bandwidth_bytes_per_s: float, latency_s: float = 0.0, *,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        super().__init__()
        self._clock, self._sleep = clock, sleep  # injectable: tests drive the link on a virtual clock
        if bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {bandwidth_bytes_per_s}")
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        self.bandwidth = float(bandwidth_bytes_per_s)
        self.latency = float(latency_s)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._prev_finish = 0.0  # perf_counter time the previous copy landed
        # how late time.sleep wakes this thread (it waits for the GIL behind the decode loop): an
        # average, slept off in advance, so a copy lasts its modelled time rather than ~10 % more
        self._wake_lag = 0.0
        # a waking thread gets the GIL once the decode loop yields it, at the latest after the switch
        # interval (5 ms by default, longer than a tiny model's expert load): keep it short
        SHORT_SWITCH.acquire()  # released by close()
        self._thread = threading.Thread(target=self._drain, name="emulated-h2d", daemon=True)
        self._thread.start()

    def transfer_seconds(self, nbytes: int) -> float:
        """Modelled duration of one copy of ``nbytes``."""
        return self.latency + nbytes / self.bandwidth

    def retune(self, bandwidth_bytes_per_s: float, latency_s: float) -> None:
        """New link parameters for the copies submitted from now on (the queue is drained first)."""
        if bandwidth_bytes_per_s <= 0 or latency_s < 0:
            raise ValueError(f"bad link parameters: {bandwidth_bytes_per_s} B/s, {latency_s} s")
        self.synchronize()
        self.bandwidth, self.latency = float(bandwidth_bytes_per_s), float(latency_s)

    def submit(self, src_flat: torch.Tensor, dst_flat: torch.Tensor, *, after: Any = None, tag: Any = None) -> Ticket:
        with self._lock:
            nbytes = self._check_submit(src_flat, dst_flat)
        ticket = _ThreadTicket(nbytes)
        self._queue.put(_Job(src_flat, dst_flat, after, ticket, self._clock(), tag))
        return ticket

    def _drain(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                self._queue.task_done()
                return
            try:
                start = max(job.submitted, self._prev_finish)
                if job.after is not None and hasattr(job.after, "wait"):
                    job.after.wait()  # the slot's last use: the copy cannot start before it ends
                    start = max(start, self._clock())
                deadline = start + self.transfer_seconds(job.ticket.nbytes)
                job.dst.copy_(job.src)
                self._wait_until(deadline)
                finish = max(deadline, self._clock())
                self._prev_finish = finish
                with self._lock:
                    self._stats.busy_seconds += finish - start
                if self.observer is not None:
                    self.observer(job.tag, job.ticket.nbytes, job.submitted, start, finish)
            except BaseException as err:  # surfaced to the waiter, the thread keeps serving
                job.ticket._error = err
            finally:
                job.ticket._event.set()
                self._queue.task_done()

    def _wait_until(self, deadline: float) -> None:
        """Sleep to `deadline`, aiming each sleep one average wake-up lag early (no spinning: a
        spinning thread holds the GIL the decode loop needs)."""
        while (wait := deadline - self._wake_lag - self._clock()) > 0:
            target = self._clock() + wait
            self._sleep(wait)
            late = self._clock() - target
            self._wake_lag = min(MAX_WAKE_LAG_S, max(0.0, self._wake_lag + 0.2 * (late - self._wake_lag)))

    def synchronize(self) -> None:
        self._queue.join()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()
            SHORT_SWITCH.release()


# --------------------------------------------------------------------------- cuda
class _CudaTicket(Ticket):
    def __init__(self, nbytes: int, start: "torch.cuda.Event", end: "torch.cuda.Event", device: torch.device):
        self.nbytes = nbytes
        self.start = start
        self.end = end
        self._device = device
        self.on_stall = None  # set by CudaLink: collects (before, after) event pairs

    def done(self) -> bool:
        return self.end.query()

    def wait(self) -> float:
        # Device-side dependency only: the compute stream waits, the host does not. The stall is
        # measured on the device: events just before and just after the wait on the compute stream.
        if self.end.query():
            return 0.0
        stream = torch.cuda.current_stream(self._device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(self.end)
        after.record(stream)
        if self.on_stall is not None:
            self.on_stall(before, after)
        return 0.0


class CudaLink(TransferLink):
    """A dedicated CUDA copy stream; one start/end event pair per copy."""

    def __init__(self, device: torch.device | str | int = "cuda"):
        super().__init__()
        if not torch.cuda.is_available():
            raise RuntimeError("CudaLink needs a CUDA device; use the 'emulated' or 'cpu' link on this machine")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaLink needs a cuda device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(device=self.device)
        self._unharvested: list[_CudaTicket] = []
        self._stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def submit(self, src_flat: torch.Tensor, dst_flat: torch.Tensor, *, after: Any = None, tag: Any = None) -> Ticket:
        nbytes = self._check_submit(src_flat, dst_flat)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)  # slot's last use (compute) -> this overwrite
            start.record(self.stream)
            dst_flat.copy_(src_flat, non_blocking=True)
            end.record(self.stream)
        ticket = _CudaTicket(nbytes, start, end, self.device)
        ticket.on_stall = lambda a, b: self._stalls.append((a, b))
        self._unharvested.append(ticket)
        if len(self._unharvested) > 256:
            self._harvest()
        return ticket

    def _harvest(self) -> None:
        """Fold the timings of landed copies into ``busy_seconds`` (never blocks)."""
        pending = []
        for t in self._unharvested:
            if t.end.query():
                self._stats.busy_seconds += t.start.elapsed_time(t.end) / 1e3
            else:
                pending.append(t)
        self._unharvested = pending
        waiting = []
        for before, after in self._stalls:
            if after.query():
                self._stats.stall_seconds += before.elapsed_time(after) / 1e3
            else:
                waiting.append((before, after))
        self._stalls = waiting

    @property
    def stats(self) -> LinkStats:
        self._harvest()
        return self._stats

    def synchronize(self) -> None:
        self.stream.synchronize()
        self._harvest()

    def close(self) -> None:
        if not self._closed:
            self.synchronize()
            self._closed = True


# --------------------------------------------------------------------------- factory
LINK_KINDS = ("cpu", "emulated", "cuda")


def make_link(kind: str, **params: Any) -> TransferLink:
    """Build the link of a hardware profile: ``cpu`` | ``emulated`` | ``cuda``."""
    if kind == "cpu":
        return ImmediateLink(**params)
    if kind == "emulated":
        return EmulatedLink(**params)
    if kind == "cuda":
        return CudaLink(**params)
    raise ValueError(f"unknown transfer link kind {kind!r}; expected one of {LINK_KINDS}")
