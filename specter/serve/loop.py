"""The serving loop: one engine thread drives the batched decoders; requests join and leave between windows.

    submit (any thread) ──► bounded wait queue ──► admitted between windows while fewer than
    `max_batch` requests decode ──► loop.step(): one speculative window (or one autoregressive step)
    for every active request ──► each request's newly committed tokens (the growth of `Request.tokens`)
    go to its `emit` callback ──► finished (length or EOS) or cancelled requests leave at once

Only this thread touches the decoders, so nothing in specter/speculative needs a lock. A decoder's
sampling settings are the same for all its rows, so requests with different settings go to
different decoders over the same runtime (and expert cache), stepped in turn as
`engine.generate_microbatched` steps its microbatches.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specter.harness.config import ConfigError
from specter.speculative.batch_state import Request
from specter.speculative.batched import BatchedAutoregressive, BatchLoop
from specter.speculative.sampling import SamplingParams, make_generator

MAX_DECODERS = 4  # distinct sampling settings decoding at once (each its own rows and draft state)


class QueueFull(RuntimeError):
    """The wait queue is full (or the server is draining): retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


def batch_loop(method: Any, params: SamplingParams) -> BatchLoop:
    """A request loop over `method`'s model with `params`: the speculative engine for specter (and the
    methods built on it), batched autoregressive decoding for target_only and offload_ar."""
    from specter.harness.methods import OffloadAR, TargetOnly

    if hasattr(method, "make_engine"):
        return method.make_engine(params)  # the spec's engine; the request's own sampling replaces the spec's
    if isinstance(method, OffloadAR):
        rt = method.rt
        return BatchedAutoregressive(rt.model, params, moe=rt.moe, num_experts=rt.om.num_experts)
    if isinstance(method, TargetOnly):
        return BatchedAutoregressive(method.model, params)
    raise ConfigError(f"method {method.name!r} has no batched request loop to serve from; "
                      "serve specter, target_only or offload_ar")


@dataclass(eq=False)  # identity: two requests with the same prompt and settings are different jobs
class Job:
    """One client request as the loop sees it."""

    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    emit: Callable[[list[int], str | None], None]  # (new tokens, finish reason or None); must not block
    seed: int = 0
    stop_ids: frozenset[int] = frozenset()  # tokens that end the request (EOS); not emitted
    arrived_s: float = field(default_factory=time.perf_counter)
    req: Request | None = None
    sent: int = 0  # tokens emitted so far
    cancelled: bool = False
    finish: str | None = None  # "length" | "stop" | "cancelled" | "error"


class ServingLoop:
    """The engine thread and its queues (see the module docstring)."""

    def __init__(self, method: Any, max_batch: int, max_queue: int = 64, metrics: Any = None,
                 idle_wait_s: float = 0.05):
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch}, {max_queue}")
        self.method, self.max_batch, self.max_queue = method, max_batch, max_queue
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self.device = method.device
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()  # submitted, not yet in a decoder
        self._cancels: list[Job] = []
        self._decoders: dict[SamplingParams, BatchLoop] = {}
        self._jobs: dict[SamplingParams, list[Job]] = {}  # the jobs in each decoder (queued or active)
        self._draining = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self.windows = 0
        self._link_bytes = self._link_now()
        self._hits_misses = self._cache_now()

    # ------------------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="specter-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job`; QueueFull when the wait queue holds `max_queue` jobs or the loop is draining."""
        with self._cv:
            if self._draining:
                raise QueueFull("the server is shutting down", retry_after=5)
            if len(self._waiting) + self._decoding() >= self.max_batch + self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} waiting, {self.max_batch} decoding)")
            self._waiting.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: the job's rows leave at the next window boundary; nothing more is emitted."""
        with self._cv:
            job.cancelled = True
            self._cancels.append(job)
            self._cv.notify()

    def depth(self) -> tuple[int, int]:
        """(waiting, decoding) requests."""
        with self._cv:
            return len(self._waiting), self._decoding()

    def drain(self, timeout_s: float | None = None) -> bool:
        """Refuse new requests, finish every admitted and queued one, stop the thread; True if it finished."""
        with self._cv:
            self._draining = True
            self._cv.notify()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while self._waiting or self._decoding():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cv.wait(0.05 if left is None else min(0.05, left))
            done = not (self._waiting or self._decoding())
        self.close()
        return done

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def _decoding(self) -> int:
        return sum(len(jobs) for jobs in self._jobs.values())

    # ------------------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not (self._stop or self._waiting or self._cancels or self._decoding()):
                    self._cv.wait(self.idle_wait_s)
                if self._stop:
                    break
                cancels, self._cancels = self._cancels, []
                for job in cancels:
                    if job in self._waiting:  # never admitted: it just leaves the queue
                        self._waiting.remove(job)
                        job.finish = "cancelled"
                admitted = self._take_admissible()
            for job in cancels:
                self._drop(job, "cancelled")
            for job in admitted:
                self._enter(job)
            self._step_all()
            self._publish_depth()
        self._fail_all("error")

    def _take_admissible(self) -> list[Job]:
        """Waiting jobs that fit beside the decoding ones (called under the lock); cancelled ones are dropped."""
        out = []
        room = self.max_batch - self._decoding()
        while self._waiting and room > 0:
            job = self._waiting.popleft()
            if job.cancelled:
                self._finish(job, "cancelled")
                continue
            if job.params not in self._decoders and not self._room_for(job.params):
                self._waiting.appendleft(job)  # its settings wait for a decoder to go idle
                break
            self._jobs.setdefault(job.params, []).append(job)
            out.append(job)
            room -= 1
        return out

    def _room_for(self, params: SamplingParams) -> bool:
        """A decoder for new settings fits: fewer than MAX_DECODERS, or an idle one can go."""
        if len(self._decoders) < MAX_DECODERS:
            return True
        idle = [p for p, jobs in self._jobs.items() if not jobs]
        for p in idle:
            del self._decoders[p], self._jobs[p]
        return bool(idle)

    def _enter(self, job: Job) -> None:
        loop = self._decoders.get(job.params)
        if loop is None:
            loop = self._decoders[job.params] = batch_loop(self.method, job.params)
        generator = make_generator(self.device, job.seed)
        prompt = torch.tensor(job.prompt, device=self.device)  # [P]
        job.req = loop.submit(prompt, job.max_tokens, generator)
        if self.metrics is not None:
            self.metrics.queue_wait(time.perf_counter() - job.arrived_s)

    def _drop(self, job: Job, reason: str) -> None:
        """Take `job` out of its decoder between windows (its rows leave the batch now)."""
        jobs = self._jobs.get(job.params, [])
        if job not in jobs:
            return  # still waiting (dropped at admission) or already finished
        if job.req is not None:
            self._decoders[job.params].cancel(job.req)
        self._retire(job, reason)

    def _step_all(self) -> None:
        for params, loop in list(self._decoders.items()):
            if not (loop.queue or loop.active):
                if loop.submitted and not self._jobs.get(params):
                    loop.begin_run()  # idle: drop the finished requests and per-run logs (bounded memory)
                continue
            try:
                loop.step()
            except Exception:  # noqa: BLE001 - one failed window ends its requests, not the server
                traceback.print_exc(file=sys.stderr)
                for job in list(self._jobs.get(params, [])):
                    self._retire(job, "error")
                del self._decoders[params], self._jobs[params]
                continue
            self.windows += 1
            self._publish(params, loop)
            self._account_io()

    def _publish(self, params: SamplingParams, loop: BatchLoop) -> None:
        """Emit each job's newly committed tokens; retire jobs that reached their length or a stop token."""
        for job in list(self._jobs.get(params, [])):
            req = job.req
            if req is None or not req.tokens:
                continue
            new = req.tokens[job.sent:job.max_tokens]
            stop = next((i for i, t in enumerate(new) if t in job.stop_ids), None)
            if stop is not None:
                new = new[:stop]
            if new:
                if job.sent == 0 and self.metrics is not None:  # arrival to first token, queueing included
                    self.metrics.first_token(time.perf_counter() - job.arrived_s)
                job.sent += len(new)
                job.emit(new, None)
            if stop is not None:
                loop.cancel(req)  # no-op once the request finished in this window
                self._retire(job, "stop")
            elif job.sent >= job.max_tokens:
                self._retire(job, "length")

    def _retire(self, job: Job, reason: str) -> None:
        with self._cv:
            jobs = self._jobs.get(job.params, [])
            if job in jobs:
                jobs.remove(job)
            self._cv.notify_all()
        if self.metrics is not None and job.req is not None:
            self.metrics.finished(job.req, job.sent, reason)
        self._finish(job, reason)

    def _finish(self, job: Job, reason: str) -> None:
        job.finish = reason
        if not job.cancelled:
            job.emit([], reason)

    def _fail_all(self, reason: str) -> None:
        with self._cv:
            jobs = [j for js in self._jobs.values() for j in js] + list(self._waiting)
            self._waiting.clear()
        for job in jobs:
            self._retire(job, reason)

    # ------------------------------------------------------------------------------ accounting
    def _link_now(self) -> int:
        rt = getattr(self.method, "rt", None)
        return int(rt.link.bytes_copied) if rt is not None else 0

    def _cache_now(self) -> tuple[int, int]:
        rt = getattr(self.method, "rt", None)
        if rt is None:
            return 0, 0
        c = rt.cache.snapshot_counters()
        return int(c["demand_hits"]), int(c["demand_misses"])

    def _account_io(self) -> None:
        if self.metrics is None:
            return
        now, (hits, misses) = self._link_now(), self._cache_now()
        h0, m0 = self._hits_misses
        self.metrics.window(now - self._link_bytes, max(0, hits - h0), max(0, misses - m0))
        self._link_bytes, self._hits_misses = now, (hits, misses)

    def _publish_depth(self) -> None:
        if self.metrics is not None:
            waiting, decoding = self.depth()
            self.metrics.depth(waiting, decoding)
