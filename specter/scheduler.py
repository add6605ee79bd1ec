"""The one request scheduler: requests join and leave the batched decoders between windows.

    add (any thread) ──► waiting ──► admitted between windows while fewer than `max_batch` requests
    decode ──► step(): one speculative window (or one autoregressive step) for every active request
    ──► each request's newly committed tokens (the growth of `Request.tokens`) go to its `emit`
    callback ──► finished (length or a stop token) or cancelled requests leave at once

`specter.api.Engine.generate` / `stream` call `step()` in the calling thread; `specter serve` calls it
on its engine thread (specter/serve/loop.py adds the thread, the queue bound, the drain and the
supervision). Only the thread that steps touches the decoders, so nothing in specter/speculative
needs a lock; `cv` guards what other threads touch (the waiting queue, the cancels, the job lists).

A decoder's sampling settings are the same for all its rows, so requests with different settings go
to different decoders over the same runtime (and expert cache), stepped in turn as
`engine.generate_microbatched` steps its microbatches. At most MAX_DECODERS decoders exist at once.
Admission never blocks on the head of the queue: a request whose settings have a decoder takes the
next free row even while an earlier request waits for a decoder of its own. That earlier request's
wait is bounded: the decoder with the fewest tokens left closes to newcomers (they wait behind it
in queue order) and is retired once its requests finish, which frees a place for the new settings.

Failures stay with the request that caused them. A request that cannot enter a decoder ends alone
with "error". A window that fails ends a decoder's only request; a decoder shared by several
requests is discarded and each of them resumes in a decoder of its own (its prompt plus the tokens
it has sent, its generator seeded `seed + sent`), so the failing request ends and its neighbours
finish. Greedy output is unchanged by a resumption.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specter.config_error import ConfigError
from specter.speculative.batch_state import Request
from specter.speculative.batched import BatchLoop
from specter.speculative.sampling import SamplingParams, make_generator

MAX_DECODERS = 4  # distinct sampling settings decoding at once (each its own rows and draft state)


def batch_loop(method: Any, params: SamplingParams) -> BatchLoop:
    """A request loop over `method`'s model with `params`: the speculative engine for specter (and the
    methods built on it), batched autoregressive decoding for target_only and offload_ar."""
    from specter.assembly.methods import OffloadAR, TargetOnly
    from specter.speculative.batched import BatchedAutoregressive

    if method.engine is not None:
        return method.make_engine(params)  # the spec's engine; the request's own sampling replaces the spec's
    if isinstance(method, OffloadAR):
        rt = method.rt
        return BatchedAutoregressive(rt.model, params, moe=rt.moe, num_experts=rt.om.num_experts)
    if isinstance(method, TargetOnly):
        return BatchedAutoregressive(method.model, params)
    raise ConfigError(f"method {method.name!r} has no batched request loop to serve from; "
                      "serve specter, target_only or offload_ar")


def batches(method: Any) -> bool:
    """`method` has a batched request loop (`batch_loop` builds one), without building it."""
    from specter.assembly.methods import OffloadAR, TargetOnly

    return method.engine is not None or isinstance(method, (OffloadAR, TargetOnly))


@dataclass(eq=False)  # identity: two requests with the same prompt and settings are different jobs
class Job:
    """One request as the scheduler sees it."""

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
    error: str | None = None  # why it ended with "error" (one line)
    emitted: list[int] = field(default_factory=list)  # the tokens sent, for a resumption after a failure
    offset: int = 0  # tokens sent before `req` began (non-zero once resumed)
    solo: bool = False  # decoded in a decoder of its own (after its shared decoder failed)
    windows: int = 0  # windows its decoder stepped while it decoded

    @property
    def key(self) -> Any:
        """The decoder this job decodes in: one per sampling setting, or its own when solo."""
        return (self.params, id(self)) if self.solo else self.params


class Scheduler:
    """Decoders per sampling setting and the jobs in them (see the module docstring).

    `metrics` (optional) is told of queue waits, first tokens, finished requests and each window's
    I/O (specter/serve/metrics.py ServeMetrics); `log` (optional) gets one line per request failure."""

    def __init__(self, method: Any, max_batch: int, metrics: Any = None,
                 log: Callable[[str], None] | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.method, self.max_batch, self.metrics = method, max_batch, metrics
        self.log = log or (lambda message: None)
        self.device = method.device
        self.cv = threading.Condition()
        self.waiting: deque[Job] = deque()  # added, not yet in a decoder
        self._cancels: list[Job] = []
        self._decoders: dict[Any, BatchLoop] = {}  # by Job.key
        self._jobs: dict[Any, list[Job]] = {}  # the jobs in each decoder (queued or active)
        self._closing: set[Any] = set()  # decoders that admit no more jobs: retired once idle
        self.windows = 0
        self.peak = 0  # the most jobs decoding at once
        self._link_bytes = self._link_now()
        self._hits_misses = self._cache_now()

    # ------------------------------------------------------------------------------ any thread
    def add(self, job: Job) -> None:
        with self.cv:
            self.waiting.append(job)
            self.cv.notify()

    def cancel(self, job: Job) -> None:
        """The caller is gone: the job's rows leave at the next window boundary; nothing more is emitted."""
        with self.cv:
            job.cancelled = True
            self._cancels.append(job)
            self.cv.notify()

    def decoding(self) -> int:
        return sum(len(jobs) for jobs in self._jobs.values())

    def busy(self) -> bool:
        """Something to do: waiting jobs, cancels or decoding jobs (call under `cv` from another thread)."""
        return bool(self.waiting or self._cancels or self.decoding())

    # ------------------------------------------------------------------------------ the stepping thread
    def step(self) -> None:
        """One round: cancels leave, waiting jobs enter, every decoder with work runs one window."""
        with self.cv:
            cancels, self._cancels = self._cancels, []
            for job in cancels:
                if job in self.waiting:  # never admitted: it just leaves the queue
                    self.waiting.remove(job)
                    job.finish = "cancelled"
            admitted = self._take_admissible()
        for job in cancels:
            self._drop(job, "cancelled")
        for job in admitted:
            self._enter(job)
        self.peak = max(self.peak, self.decoding())
        self._step_all()

    def fail_all(self, reason: str) -> None:
        """End every waiting and decoding job with `reason` (the stepping thread has stopped)."""
        with self.cv:
            jobs = [j for js in self._jobs.values() for j in js] + list(self.waiting)
            self.waiting.clear()
            self._jobs.clear()
            self._decoders.clear()
            self._closing.clear()
            self.cv.notify_all()
        for job in jobs:
            if job.finish is None:
                self._finish_job(job, reason)

    def abandon(self) -> None:
        """Free every row at once, emitting nothing (the caller stopped listening)."""
        for key, loop in list(self._decoders.items()):
            for job in self._jobs.get(key, []):
                job.cancelled = True
                if job.req is not None:
                    loop.cancel(job.req)
        with self.cv:
            self.waiting.clear()
            self._jobs.clear()
            self._decoders.clear()
            self._closing.clear()

    # ------------------------------------------------------------------------------ admission
    def _take_admissible(self) -> list[Job]:
        """Waiting jobs that fit beside the decoding ones, in queue order (called under the lock);
        cancelled ones are dropped. A job that cannot have its decoder yet stays in the queue, in
        place, and the jobs behind it may still enter running decoders (see the module docstring)."""
        for key in [k for k in self._closing if not self._jobs.get(k)]:  # closed and idle: retire it
            self._decoders.pop(key, None)
            self._jobs.pop(key, None)
            self._closing.discard(key)
        out, kept = [], deque()
        room = self.max_batch - self.decoding()
        while self.waiting and room > 0:
            job = self.waiting.popleft()
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
        self.waiting.extendleft(reversed(kept))  # ahead of the unvisited ones, in their order
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
        except Exception as err:  # noqa: BLE001 - this request's failure, not the scheduler's
            job.error = one_line(err)
            self.log(f"a request could not start: {job.error}")
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

    # ------------------------------------------------------------------------------ windows
    def _step_all(self) -> None:
        for key, loop in list(self._decoders.items()):
            if not (loop.queue or loop.active):
                if loop.submitted and not self._jobs.get(key):
                    loop.begin_run()  # idle: drop the finished requests and per-run logs (bounded memory)
                continue
            try:
                loop.step()
            except Exception as err:  # noqa: BLE001 - one failed window ends its request, not the scheduler
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
            self.log(f"a window failed: {one_line(err)}; its request ends with an error")
            for job in jobs:
                job.error = one_line(err)
                self._finish_job(job, "error")
            return
        self.log(f"a window shared by {len(jobs)} requests failed: {one_line(err)}; each resumes in a "
                 "decoder of its own")
        with self.cv:
            for job in reversed(jobs):  # ahead of the waiting ones, in their order
                job.solo, job.req = True, None
                self.waiting.appendleft(job)
            self.cv.notify_all()

    def _publish(self, key: Any, loop: BatchLoop) -> None:
        """Emit each job's newly committed tokens; retire jobs that reached their length or a stop token."""
        for job in list(self._jobs.get(key, [])):
            req = job.req
            if req is None:
                continue
            job.windows += 1
            if not req.tokens:
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
        with self.cv:
            jobs = self._jobs.get(job.key, [])
            if job in jobs:
                jobs.remove(job)
            self.cv.notify_all()
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

    # ------------------------------------------------------------------------------ accounting
    def _link_now(self) -> int:
        rt = self.method.rt
        return int(rt.link.bytes_copied) if rt is not None else 0

    def _cache_now(self) -> tuple[int, int]:
        rt = self.method.rt
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


def one_line(err: BaseException) -> str:
    """`Type: message` on one line (a log line per failure, never a traceback)."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
