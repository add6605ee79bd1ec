"""The serving loop: one engine thread drives the batched decoders; requests join and leave between windows.

    submit (any thread) ──► bounded wait queue ──► admitted between windows while fewer than
    `max_batch` requests decode ──► loop.step(): one speculative window (or one autoregressive step)
    for every active request ──► each request's newly committed tokens (the growth of `Request.tokens`)
    go to its `emit` callback ──► finished (length or EOS) or cancelled requests leave at once

Only this thread touches the decoders, so nothing in specter/speculative needs a lock. A decoder's
sampling settings are the same for all its rows, so requests with different settings go to
different decoders over the same runtime (and expert cache), stepped in turn as
`engine.generate_microbatched` steps its microbatches. At most MAX_DECODERS decoders exist at once.
Admission never blocks on the head of the queue: a request whose settings have a decoder takes the
next free row even while an earlier request waits for a decoder of its own. That earlier request's
wait is bounded: the decoder with the fewest tokens left closes to newcomers (they wait behind it
in queue order) and is retired once its requests finish, which frees a place for the new settings.

Failures stay with the request that caused them. A request that cannot enter a decoder ends alone
with "error". A window that fails ends a decoder's only request; a decoder shared by several
requests is discarded and each of them resumes in a decoder of its own (its prompt plus the tokens
it has sent), so the failing request ends and its neighbours finish. The thread itself is
supervised: should it ever stop, every request ends with "error", `alive` turns False (/health
answers 503) and `on_death` tells the server to exit.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specter.api import batch_loop
from specter.speculative.batch_state import Request
from specter.speculative.batched import BatchLoop
from specter.speculative.sampling import SamplingParams, make_generator

MAX_DECODERS = 4  # distinct sampling settings decoding at once (each its own rows and draft state)


class QueueFull(RuntimeError):
    """The wait queue is full (or the server is draining): retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


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
    emitted: list[int] = field(default_factory=list)  # the tokens sent, for a resumption after a failure
    offset: int = 0  # tokens sent before `req` began (non-zero once resumed)
    solo: bool = False  # decoded in a decoder of its own (after its shared decoder failed)

    @property
    def key(self) -> Any:
        """The decoder this job decodes in: one per sampling setting, or its own when solo."""
        return (self.params, id(self)) if self.solo else self.params


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
        self._decoders: dict[Any, BatchLoop] = {}  # by Job.key
        self._jobs: dict[Any, list[Job]] = {}  # the jobs in each decoder (queued or active)
        self._closing: set[Any] = set()  # decoders that admit no more jobs: retired once idle
        self._draining = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self.failure: str | None = None  # why the engine thread stopped (None while it runs)
        self.on_death: Callable[[], None] | None = None  # called (engine thread) if the thread stops on a failure
        self.windows = 0
        self._link_bytes = self._link_now()
        self._hits_misses = self._cache_now()

    # ------------------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="specter-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The engine thread is running (or not started yet) and has not stopped on a failure."""
        return self.failure is None and (self._thread is None or self._thread.is_alive())

    def submit(self, job: Job) -> None:
        """Queue `job`; QueueFull when the wait queue holds `max_queue` jobs, the loop is draining or
        the engine has stopped."""
        with self._cv:
            if not self.alive:
                raise QueueFull(f"the engine has stopped ({self.failure or 'not running'})", retry_after=60)
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
            while (self._waiting or self._decoding()) and self.alive:
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
        try:
            self._serve()
        except BaseException as err:  # noqa: BLE001 - supervision: every request ends, the server learns of it
            self.failure = _one_line(err)
            _log(f"the engine stopped: {self.failure}; every request in flight ends with an error")
            self._fail_all("error")
            if self.on_death is not None:
                self.on_death()
            return
        self._fail_all("error")

    def _serve(self) -> None:
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

    def _take_admissible(self) -> list[Job]:
        """Waiting jobs that fit beside the decoding ones, in queue order (called under the lock);
        cancelled ones are dropped. A job that cannot have its decoder yet stays in the queue, in
        place, and the jobs behind it may still enter running decoders (see the module docstring)."""
        for key in [k for k in self._closing if not self._jobs.get(k)]:  # closed and idle: retire it
            self._decoders.pop(key, None)
            self._jobs.pop(key, None)
            self._closing.discard(key)
        out, kept = [], deque()
        room = self.max_batch - self._decoding()
        while self._waiting and room > 0:
            job = self._waiting.popleft()
            if job.cancelled:
                self._finish(job, "cancelled")
                continue
            if job.key in self._closing or (job.key not in self._jobs and not self._room_for()):
                kept.append(job)  # waits for its decoder; those behind it are not held up
                continue
            self._jobs.setdefault(job.key, []).append(job)
            out.append(job)
            room -= 1
        if any(job.key not in self._jobs for job in kept) and not self._closing:
            self._close_one()
        self._waiting.extendleft(reversed(kept))  # ahead of the unvisited ones, in their order
        return out

    def _room_for(self) -> bool:
        """A decoder for a new key fits: fewer than MAX_DECODERS, or an idle one can go."""
        if len(self._jobs.keys() | self._decoders.keys()) < MAX_DECODERS:  # admitted keys build theirs in _enter
            return True
        idle = [k for k, jobs in self._jobs.items() if not jobs]
        for k in idle:
            self._decoders.pop(k, None)
            del self._jobs[k]
            self._closing.discard(k)
        return bool(idle)

    def _close_one(self) -> None:
        """Close the decoder with the fewest tokens left to newcomers, so a job whose settings have
        no decoder waits for that decoder's requests only, never for the queue to run dry."""
        def left(key: Any) -> int:
            return sum(j.max_tokens - j.sent for j in self._jobs.get(key, []))

        if self._jobs:
            self._closing.add(min(self._jobs, key=left))

    def _enter(self, job: Job) -> None:
        """Submit `job` to its decoder; a job that cannot enter ends alone with "error"."""
        try:
            loop = self._decoders.get(job.key)
            if loop is None:
                loop = self._decoders[job.key] = batch_loop(self.method, job.params)
            # a resumed job continues from the tokens it has sent (greedy output is unchanged by it)
            generator = make_generator(self.device, job.seed + job.sent)
            prompt = torch.tensor(job.prompt + job.emitted, device=self.device)  # [P]
            job.offset = job.sent
            job.req = loop.submit(prompt, job.max_tokens - job.sent, generator)
        except Exception as err:  # noqa: BLE001 - this request's failure, not the server's
            _log(f"a request could not start: {_one_line(err)}")
            job.req = None
            self._retire(job, "error")
            if not self._jobs.get(job.key) and job.key in self._jobs:
                self._decoders.pop(job.key, None)
                del self._jobs[job.key]
                self._closing.discard(job.key)
            return
        if self.metrics is not None:
            self.metrics.queue_wait(time.perf_counter() - job.arrived_s)

    def _drop(self, job: Job, reason: str) -> None:
        """Take `job` out of its decoder between windows (its rows leave the batch now)."""
        jobs = self._jobs.get(job.key, [])
        if job not in jobs:
            return  # still waiting (dropped at admission) or already finished
        if job.req is not None and job.key in self._decoders:
            self._decoders[job.key].cancel(job.req)
        self._retire(job, reason)

    def _step_all(self) -> None:
        for key, loop in list(self._decoders.items()):
            if not (loop.queue or loop.active):
                if loop.submitted and not self._jobs.get(key):
                    loop.begin_run()  # idle: drop the finished requests and per-run logs (bounded memory)
                continue
            try:
                loop.step()
            except Exception as err:  # noqa: BLE001 - one failed window ends its request, not the server
                self._window_failed(key, err)
                continue
            self.windows += 1
            self._publish(key, loop)
            self._account_io()

    def _window_failed(self, key: Any, err: Exception) -> None:
        """Discard the decoder; its only request ends with "error", or each of several resumes alone."""
        jobs = [j for j in self._jobs.pop(key, []) if not j.cancelled]
        del self._decoders[key]
        self._closing.discard(key)
        if len(jobs) == 1 or (jobs and jobs[0].solo):
            _log(f"a window failed: {_one_line(err)}; its request ends with an error")
            for job in jobs:
                self._finish_job(job, "error")
            return
        _log(f"a window shared by {len(jobs)} requests failed: {_one_line(err)}; each resumes in a decoder "
             "of its own")
        with self._cv:
            for job in reversed(jobs):  # ahead of the waiting ones, in their order
                job.solo, job.req = True, None
                self._waiting.appendleft(job)
            self._cv.notify_all()

    def _publish(self, key: Any, loop: BatchLoop) -> None:
        """Emit each job's newly committed tokens; retire jobs that reached their length or a stop token."""
        for job in list(self._jobs.get(key, [])):
            req = job.req
            if req is None or not req.tokens:
                continue
            new = req.tokens[job.sent - job.offset:job.max_tokens - job.offset]
            stop = next((i for i, t in enumerate(new) if t in job.stop_ids), None)
            if stop is not None:
                new = new[:stop]
            if new:
                if job.sent == 0 and self.metrics is not None:  # arrival to first token, queueing included
                    self.metrics.first_token(time.perf_counter() - job.arrived_s)
                job.sent += len(new)
                job.emitted.extend(new)
                job.emit(new, None)
            if stop is not None:
                loop.cancel(req)  # no-op once the request finished in this window
                self._retire(job, "stop")
            elif job.sent >= job.max_tokens:
                self._retire(job, "length")

    def _retire(self, job: Job, reason: str) -> None:
        with self._cv:
            jobs = self._jobs.get(job.key, [])
            if job in jobs:
                jobs.remove(job)
            self._cv.notify_all()
        self._finish_job(job, reason)

    def _finish_job(self, job: Job, reason: str) -> None:
        """Account a job that left its decoder and send its finish reason."""
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
            self._jobs.clear()
            self._decoders.clear()
            self._closing.clear()
            self._cv.notify_all()
        for job in jobs:
            if job.finish is None:
                self._finish_job(job, reason)

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


def _one_line(err: BaseException) -> str:
    """`Type: message` on one line (a server log line per failure, never a traceback)."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _log(message: str) -> None:
    print(f"specter serve: {message}", file=sys.stderr, flush=True)
