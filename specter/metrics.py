"""Commit clock and per-record latency metrics.

TPOT follows the paper: (last commit − first commit) / (N − 1) over N generated tokens. With
speculative decoding the first commit already holds several tokens, which biases that figure low,
so `tpot_fair` divides the same span by the tokens committed *after* the first commit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class CommitClock:
    """Wall-clock stamps of every commit (one or more tokens become final at once)."""

    start_s: float = 0.0
    stamps: list[float] = field(default_factory=list)  # perf_counter at each commit
    counts: list[int] = field(default_factory=list)  # tokens made final by that commit
    excluded_s: float = 0.0  # untimed work inside the run (e.g. an oracle's probe), taken out of every later stamp

    def start(self) -> None:
        self.start_s = time.perf_counter()
        self.stamps.clear()
        self.counts.clear()
        self.excluded_s = 0.0

    def exclude(self, seconds: float) -> None:
        """Remove `seconds` of untimed work from the clock."""
        self.excluded_s += seconds

    def commit(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.stamps.append(time.perf_counter() - self.excluded_s)
            self.counts.append(num_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.counts)

    def latency(self) -> dict[str, float | None]:
        """ttft_ms, e2e_ms, tpot_ms (paper) and tpot_fair_ms; None where undefined."""
        n = self.num_tokens
        if not self.stamps:
            return {"ttft_ms": None, "e2e_ms": None, "tpot_ms": None, "tpot_fair_ms": None}
        first, last = self.stamps[0], self.stamps[-1]
        span_ms = (last - first) * 1e3
        after_first = n - self.counts[0]
        return {
            "ttft_ms": (first - self.start_s) * 1e3,
            "e2e_ms": (last - self.start_s) * 1e3,
            "tpot_ms": span_ms / (n - 1) if n > 1 else None,
            "tpot_fair_ms": span_ms / after_first if after_first > 0 else None,
        }
