"""Step timing that is honest on asynchronous devices.

On the CPU a step ends when its Python call returns; on CUDA the kernels may still be running,
so a host clock would time only the launches. `StepTimer` records a CUDA event per step there
and reads the durations back only when asked (at a planner boundary, which syncs anyway).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class StepTimer:
    """Durations of consecutive steps: `start()`, then `lap()` after each step, `harvest()` to read.

    ``now``: a time source of its own (seconds; e.g. a modelled device's clock) instead of the host's
    clock or CUDA events."""

    def __init__(self, device: torch.device, now: Callable[[], float] | None = None):
        self.now = now
        self.cuda = now is None and torch.device(device).type == "cuda"
        self._marks: list = []
        self._done: list[float] = []

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return self.now() if self.now is not None else time.perf_counter()

    def start(self) -> None:
        self._marks = [self._mark()]
        self._done = []

    def lap(self) -> None:
        self._marks.append(self._mark())

    def harvest(self) -> list[float]:
        """Seconds per step finished since the last harvest (waits for the last CUDA event)."""
        marks = self._marks
        if len(marks) < 2:
            return []
        if self.cuda:
            marks[-1].synchronize()
            laps = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        else:
            laps = [b - a for a, b in zip(marks, marks[1:])]
        self._marks = [marks[-1]]
        return laps
