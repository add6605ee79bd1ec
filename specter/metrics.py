"""Commit clock and per-record latency metrics.

TPOT follows the paper: (last commit − first commit) / (N − 1) over N generated tokens. In the
paper's artifact the first commit could hold several tokens, which biased that figure low; here
every method's first commit is the prefill's single token, so the paper's formula is already the
fair one and there is no second TPOT column.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


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
        """ttft_ms, e2e_ms, tpot_ms (the paper's definition); None where undefined."""
        n = self.num_tokens
        if not self.stamps:
            return {"ttft_ms": None, "e2e_ms": None, "tpot_ms": None}
        first, last = self.stamps[0], self.stamps[-1]
        return {
            "ttft_ms": (first - self.start_s) * 1e3,
            "e2e_ms": (last - self.start_s) * 1e3,
            "tpot_ms": (last - first) * 1e3 / (n - 1) if n > 1 else None,
        }


def io_stats(cache, link_busy_s: float | None = None) -> dict[str, Any]:
    """Expert I/O columns of a record, from the cache's counters and the link's (one place for all methods).

    copy_wait_ms: time compute waited for expert copies — host-blocked time on the CPU and
    emulated links, device stall time (CUDA events) on the CUDA link. overlap_fraction: the share
    of link busy time that did not stall compute, 1 − wait / busy.
    """
    c = cache.snapshot_counters()
    wait_s = c["copy_wait_s"] + cache.link.stats.stall_seconds
    return {
        "h2d_bytes": int(c["h2d_bytes"]),
        "demand_hits": int(c["demand_hits"]),
        "demand_misses": int(c["demand_misses"]),
        "copy_wait_ms": wait_s * 1e3,
        "overlap_fraction": max(0.0, 1 - wait_s / link_busy_s) if link_busy_s else None,
    }
