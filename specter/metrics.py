"""Commit clock and per-record latency metrics.

TPOT follows the paper: (last commit − first commit) / (N − 1) over N generated tokens. In the
paper's artifact the first commit could hold several tokens, which biased that figure low; here
every method's first commit is the prefill's single token, so the paper's formula is already the
fair one and there is no second TPOT column.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
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
    hits, misses = int(c["demand_hits"]), int(c["demand_misses"])
    return {
        "h2d_bytes": int(c["h2d_bytes"]),
        "demand_hits": hits,
        "demand_misses": misses,
        "hit_rate": hit_rate(hits, misses),
        "copy_wait_ms": wait_s * 1e3,
        "overlap_fraction": max(0.0, 1 - wait_s / link_busy_s) if link_busy_s else None,
    }


def hit_rate(hits: int, misses: int) -> float | None:
    """Demand hit rate of the device expert cache: hits / demanded expert loads (None: nothing demanded)."""
    demanded = hits + misses
    return hits / demanded if demanded else None


def independent_working_set(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts of one MoE layer when `tokens` tokens each route to `top_k` of
    `num_experts` experts independently and uniformly: E·(1 − (1 − k/E)^n). (One token's k experts
    are distinct, so an expert escapes a token with probability exactly 1 − k/E.)"""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def step_windows(first: int, end: int, size: int) -> list[list[int]]:
    """Route-log windows `first`..`end`-1 (one target step each) grouped into windows of `size`
    consecutive steps; the last group holds what is left."""
    size = max(1, int(size))
    return [list(range(i, min(i + size, end))) for i in range(first, end, size)]


def window_routing(log, windows: Sequence[Sequence[int]], layers: Sequence[int], num_experts: int,
                   top_k: int) -> dict[str, float | None]:
    """The routing regime of a run, from the routes the target really took (`moe.RouteLog`).

    `windows`: groups of route-log window indices, each group one window (a verification pass, or
    consecutive autoregressive steps). Per (window, MoE layer): the distinct experts routed to, and
    that over `independent_working_set` of the tokens the window routed through the layer.

    window_experts: the mean distinct experts over windows and layers;
    window_experts_vs_independent: the mean of the per-window ratio (1: as diverse as independent
    routing; below 1: tokens of a window share experts). None where no window routed a token.
    """
    sizes: list[int] = []
    ratios: list[float] = []
    for group in windows:
        for layer in layers:
            n = sum(log.tokens[w].get(layer, 0) for w in group)
            if n <= 0:
                continue
            distinct = len(set().union(*(log.windows[w].get(layer, ()) for w in group)))
            sizes.append(distinct)
            ratios.append(distinct / independent_working_set(num_experts, top_k, n))
    return {"window_experts": sum(sizes) / len(sizes) if sizes else None,
            "window_experts_vs_independent": sum(ratios) / len(ratios) if ratios else None}
