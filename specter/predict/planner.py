"""Layer-aware prefetch planner: when to snapshot the ELB and which experts to load (policy only).

One draft window of K steps is cut into chunks by boundaries b_1 < b_2 < ... (a boundary is the
number of draft steps done, not a token index)::

    steps     0 ........ b_1 ........ b_2 ..... b_3 ................ K | verification
    phase     | cold start | overlap    | overlap | final cleanup    |
    H2D                    | batch @b_1 | batch @b_2 | batch @b_3    |

- Cold start: no predictive transfer before b_1 = max(1, int(cold_start_frac * K)).
- At each b_i the ELB's top-M plan yields the incremental batch (experts newly selected, not
  resident, not already in flight) and the next boundary is sized so the next chunk's draft
  compute covers the batch's H2D time:
  ``b_{i+1} = b_i + max(1, ceil(batch_bytes / bandwidth / draft_step))``.
- Final cleanup once every layer's M slots are claimed by this window's predictions, or once
  b_{i+1} would reach K: no further plans in the window (later ELB evidence is discarded).

A selected expert claims one of its layer's M slots until verification (it must stay resident,
so later boundaries can only fill the slots still unclaimed). Bandwidth and draft step time
are exponential moving averages of observed samples. Movement (copies, eviction) lives in
``specter.offload``; this module only decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Mapping

Phase = Literal["cold_start", "overlap", "final_cleanup"]
POLICIES = ("adaptive", "none", "early", "late", "oracle")


@dataclass(frozen=True)
class PlannerConfig:
    cold_start_frac: float = 0.2  # b_1 = max(1, int(cold_start_frac * K))
    bandwidth_init: float = 12e9  # bytes/s, H2D estimate before the first observed copy
    draft_step_init: float = 1e-3  # seconds per draft step before the first observation
    ema: float = 0.25  # weight of a new sample: new = (1 - ema) * old + ema * sample

    def __post_init__(self) -> None:
        if not 0.0 <= self.cold_start_frac <= 1.0:
            raise ValueError(f"cold_start_frac must be in [0, 1], got {self.cold_start_frac}")
        if self.bandwidth_init <= 0 or self.draft_step_init <= 0:
            raise ValueError("bandwidth_init and draft_step_init must be > 0")
        if not 0.0 < self.ema <= 1.0:
            raise ValueError(f"ema must be in (0, 1], got {self.ema}")


@dataclass(frozen=True)
class Decision:
    """What to do at a boundary: experts to load now, where the next boundary is, the next chunk's phase."""

    batch: list[tuple[int, int]]  # (layer, expert), layers ascending, each layer in ranking order
    next_boundary: int | None  # None: no further plan this window
    phase: Phase


@dataclass(frozen=True)
class Chunk:
    """One chunk of a window's trace: draft steps [start, end) and the batch submitted at start."""

    phase: Phase
    start: int
    end: int
    batch: int  # experts submitted at `start`


class PrefetchPlanner:
    """The adaptive three-phase planner; the other ablation policies subclass it (see make_policy)."""

    name = "adaptive"

    def __init__(self, config: PlannerConfig, K: int, expert_bytes: int):
        if expert_bytes < 0:
            raise ValueError(f"expert_bytes must be >= 0, got {expert_bytes}")
        self.config = config
        self.expert_bytes = expert_bytes
        self.bandwidth = config.bandwidth_init  # bytes/s
        self.draft_step = config.draft_step_init  # s
        self.K = K
        self.begin_window(K)

    # -- window life cycle -------------------------------------------------------------------
    def begin_window(self, K: int | None = None) -> int | None:
        """Start a draft window of ``K`` steps (default: the previous K); returns b_1 (None: no plan)."""
        if K is not None:
            if K < 1:
                raise ValueError(f"K must be >= 1, got {K}")
            self.K = K
        self._claimed: dict[int, set[int]] = {}
        self._next = self.schedule_first()
        self.first_boundary = self._next
        self.trace: list[Chunk] = [Chunk("cold_start", 0, self.K if self._next is None else self._next, 0)]
        return self._next

    @property
    def next_boundary(self) -> int | None:
        """The draft step count at which ``on_boundary`` is due next (None: none this window)."""
        return self._next

    @property
    def phase(self) -> Phase:
        """Phase of the chunk being drafted now."""
        return self.trace[-1].phase

    @property
    def claimed(self) -> dict[int, frozenset[int]]:
        """Per layer, the experts this window's plans keep resident for verification."""
        return {layer: frozenset(experts) for layer, experts in self._claimed.items()}

    def on_boundary(
        self,
        step: int,
        plan: Mapping[int, list[int]],
        resident: Mapping[int, set[int]],
        inflight_or_planned: Mapping[int, set[int]],
        capacity: Mapping[int, int],
    ) -> Decision:
        """Turn the ELB snapshot ``plan`` (layer -> top-M experts) taken after ``step`` draft steps into a batch."""
        if self._next is None or step != self._next:
            raise ValueError(f"no boundary at step {step} (next boundary: {self._next})")
        batch = self._incremental_batch(plan, resident, inflight_or_planned, capacity)
        slots_full = all(len(self._claimed.get(layer, ())) >= m for layer, m in capacity.items())
        nxt = None if slots_full else self.schedule_next(step, len(batch) * self.expert_bytes)
        phase: Phase = "final_cleanup" if nxt is None else "overlap"
        self._next = nxt
        self.trace.append(Chunk(phase, step, self.K if nxt is None else nxt, len(batch)))
        return Decision(batch, nxt, phase)

    def _incremental_batch(
        self,
        plan: Mapping[int, list[int]],
        resident: Mapping[int, set[int]],
        inflight_or_planned: Mapping[int, set[int]],
        capacity: Mapping[int, int],
    ) -> list[tuple[int, int]]:
        batch: list[tuple[int, int]] = []
        for layer in sorted(plan):
            m = capacity[layer]
            claimed = self._claimed.setdefault(layer, set())
            present = set(resident.get(layer, ())) | set(inflight_or_planned.get(layer, ()))
            for expert in plan[layer]:
                if len(claimed) >= m:
                    break  # every slot of the layer already holds a prediction of this window
                if expert in claimed:
                    continue
                claimed.add(expert)
                if expert not in present:
                    batch.append((layer, expert))
        return batch

    # -- policy: the two public extension points (the ablation policies and baselines override them)
    def schedule_first(self) -> int | None:
        """b_1 of a window of ``self.K`` steps (None: no plan this window)."""
        return max(1, int(self.config.cold_start_frac * self.K))

    def schedule_next(self, step: int, batch_bytes: int) -> int | None:
        """Next boundary so that the next chunk's draft compute ~ this batch's H2D time."""
        steps = batch_bytes / (self.bandwidth * self.draft_step)
        # Float noise (e.g. 3.0000000004) must not add a whole draft step.
        chunk = max(1, math.ceil(steps - 1e-9))
        nxt = step + chunk
        return None if nxt >= self.K else nxt

    # -- estimates ---------------------------------------------------------------------------
    def snapshot(self) -> tuple[float, float]:
        """The learned estimates ``(bandwidth, draft_step)``, for `restore`."""
        return self.bandwidth, self.draft_step

    def restore(self, estimates: tuple[float, float]) -> None:
        """Put back estimates taken by `snapshot` (a record's documented starting state)."""
        self.bandwidth, self.draft_step = estimates

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        """Fold one measured H2D copy into the bandwidth estimate."""
        if nbytes > 0 and seconds > 0:
            a = self.config.ema
            self.bandwidth = (1 - a) * self.bandwidth + a * (nbytes / seconds)

    def observe_draft_step(self, seconds: float) -> None:
        """Fold one measured draft step time into the estimate."""
        if seconds > 0:
            a = self.config.ema
            self.draft_step = (1 - a) * self.draft_step + a * seconds


class NoPrefetchPlanner(PrefetchPlanner):
    """Never prefetch: verification loads every miss on demand."""

    name = "none"

    def schedule_first(self) -> int | None:
        return None


class EarlyPlanner(PrefetchPlanner):
    """One plan after the first draft step, then stop."""

    name = "early"

    def schedule_first(self) -> int | None:
        return 1

    def schedule_next(self, step: int, batch_bytes: int) -> int | None:
        return None


class LatePlanner(PrefetchPlanner):
    """One plan after the last draft step, just before verification (nothing left to overlap)."""

    name = "late"

    def schedule_first(self) -> int | None:
        return self.K

    def schedule_next(self, step: int, batch_bytes: int) -> int | None:
        return None


class OraclePlanner(EarlyPlanner):
    """Schedule of ``early``; the engine passes the true verification sets as the plan."""

    name = "oracle"


_POLICY_CLASSES: dict[str, type[PrefetchPlanner]] = {
    cls.name: cls for cls in (PrefetchPlanner, NoPrefetchPlanner, EarlyPlanner, LatePlanner, OraclePlanner)
}


def make_policy(name: str, K: int, expert_bytes: int, config: PlannerConfig | None = None) -> PrefetchPlanner:
    """The planner of ablation policy ``name`` (one of POLICIES); all share one interface."""
    if name not in _POLICY_CLASSES:
        raise ValueError(f"unknown prefetch policy {name!r}; choose from {POLICIES}")
    return _POLICY_CLASSES[name](config or PlannerConfig(), K, expert_bytes)
