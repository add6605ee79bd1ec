"""The serving loop: one engine thread steps the request scheduler; requests join and leave between windows.

    submit (any thread) ──► bounded wait queue ──► specter/scheduler.py Scheduler: admitted between
    windows while fewer than `max_batch` requests decode, one window per step, tokens to each
    request's `emit` ──► finished, cancelled or failed requests leave at once

The scheduler (admission, decoders per sampling setting, stop detection, failure handling) is the one
`specter.load`'s `generate` and `stream` step too; this module adds what a server needs around it: the
thread, the bound on waiting requests, the drain, and supervision. Should the thread ever stop, every
request ends with "error", `alive` turns False (/health answers 503) and `on_death` tells the server
to exit.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from specter.scheduler import MAX_DECODERS, Job, Scheduler, one_line

__all__ = ["MAX_DECODERS", "Job", "QueueFull", "ServingLoop"]


class QueueFull(RuntimeError):
    """The wait queue is full (or the server is draining): retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class ServingLoop:
    """The engine thread around one Scheduler (see the module docstring)."""

    def __init__(self, method: Any, max_batch: int, max_queue: int = 64, metrics: Any = None,
                 idle_wait_s: float = 0.05):
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch}, {max_queue}")
        self.method, self.max_batch, self.max_queue = method, max_batch, max_queue
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self.scheduler = Scheduler(method, max_batch, metrics, log=_log)
        self._cv = self.scheduler.cv
        self._draining = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self.failure: str | None = None  # why the engine thread stopped (None while it runs)
        self.on_death: Callable[[], None] | None = None  # called (engine thread) if the thread stops on a failure

    # ------------------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="specter-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The engine thread is running (or not started yet) and has not stopped on a failure."""
        return self.failure is None and (self._thread is None or self._thread.is_alive())

    @property
    def windows(self) -> int:
        """Windows stepped so far, every decoder together."""
        return self.scheduler.windows

    def submit(self, job: Job) -> None:
        """Queue `job`; QueueFull when the wait queue holds `max_queue` jobs, the loop is draining or
        the engine has stopped."""
        with self._cv:
            if not self.alive:
                raise QueueFull(f"the engine has stopped ({self.failure or 'not running'})", retry_after=60)
            if self._draining:
                raise QueueFull("the server is shutting down", retry_after=5)
            if len(self.scheduler.waiting) + self.scheduler.decoding() >= self.max_batch + self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} waiting, {self.max_batch} decoding)")
            self.scheduler.add(job)

    def cancel(self, job: Job) -> None:
        """The client is gone: the job's rows leave at the next window boundary; nothing more is emitted."""
        self.scheduler.cancel(job)

    def depth(self) -> tuple[int, int]:
        """(waiting, decoding) requests."""
        with self._cv:
            return len(self.scheduler.waiting), self.scheduler.decoding()

    def drain(self, timeout_s: float | None = None) -> bool:
        """Refuse new requests, finish every admitted and queued one, stop the thread; True if it finished."""
        with self._cv:
            self._draining = True
            self._cv.notify()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        sched = self.scheduler
        with self._cv:
            while (sched.waiting or sched.decoding()) and self.alive:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cv.wait(0.05 if left is None else min(0.05, left))
            done = not (sched.waiting or sched.decoding())
        self.close()
        return done

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as err:  # noqa: BLE001 - supervision: every request ends, the server learns of it
            self.failure = one_line(err)
            _log(f"the engine stopped: {self.failure}; every request in flight ends with an error")
            self.scheduler.fail_all("error")
            if self.on_death is not None:
                self.on_death()
            return
        self.scheduler.fail_all("error")

    def _serve(self) -> None:
        torch.set_grad_enabled(False)
        sched = self.scheduler
        while True:
            with self._cv:
                while not (self._stop or sched.busy()):
                    self._cv.wait(self.idle_wait_s)
                if self._stop:
                    break
            sched.step()
            self._publish_depth()

    def _publish_depth(self) -> None:
        if self.metrics is not None:
            waiting, decoding = self.depth()
            self.metrics.depth(waiting, decoding)


def _log(message: str) -> None:
    print(f"specter serve: {message}", file=sys.stderr, flush=True)
