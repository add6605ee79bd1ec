"""Prometheus metrics of a server (one registry per server, so several can live in one process)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401  (re-exported for the app)

# TPOT of tiny models on a CPU is well under a millisecond; real models on a GPU tens of ms
TPOT_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServeMetrics:
    """What /metrics reports: requests, tokens, latency histograms, acceptance, expert I/O, queue depth."""

    def __init__(self, model: str, method: str):
        self.registry = r = CollectorRegistry()
        self.labels = {"model": model, "method": method}
        names = list(self.labels)
        self.requests = Counter("specter_requests", "Requests received, by HTTP status class", [*names, "status"],
                                registry=r)
        self.finishes = Counter("specter_requests_finished", "Requests that left the engine, by finish reason",
                                [*names, "reason"], registry=r)
        self.prompt_tokens = Counter("specter_prompt_tokens", "Prompt tokens prefilled", names, registry=r)
        self.generated = Counter("specter_generation_tokens", "Tokens generated (committed and sent)", names,
                                 registry=r)
        self.windows = Counter("specter_engine_windows", "Engine iterations (speculative windows or decode steps)",
                               names, registry=r)
        self.drafted = Counter("specter_draft_tokens", "Draft tokens verified", names, registry=r)
        self.accepted = Counter("specter_accepted_tokens", "Draft tokens accepted", names, registry=r)
        self.h2d = Counter("specter_h2d_bytes", "Expert bytes copied host to device", names, registry=r)
        self.hits = Counter("specter_expert_cache_hits", "Expert demand hits in the device cache", names, registry=r)
        self.misses = Counter("specter_expert_cache_misses", "Expert demand misses (loads on demand)", names,
                              registry=r)
        self.acceptance = Gauge("specter_acceptance_ratio", "Accepted / drafted tokens since start", names,
                                registry=r)
        self.hit_rate = Gauge("specter_expert_cache_hit_rate", "Demand hits / demand lookups since start", names,
                              registry=r)
        self.waiting = Gauge("specter_queue_waiting", "Requests waiting for a batch row", names, registry=r)
        self.decoding = Gauge("specter_queue_decoding", "Requests decoding in the batch", names, registry=r)
        self.tpot = Histogram("specter_tpot_seconds", "Time per output token of finished requests", names,
                              buckets=TPOT_BUCKETS_S, registry=r)
        self.ttft = Histogram("specter_ttft_seconds", "Arrival to first token (queueing included)", names,
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.wait = Histogram("specter_queue_wait_seconds", "Arrival to admission into the batch", names,
                              buckets=TTFT_BUCKETS_S, registry=r)
        self._totals = {"drafted": 0, "accepted": 0, "hits": 0, "lookups": 0}

    def _l(self, metric, **extra: str):
        return metric.labels(**self.labels, **extra)

    # -- HTTP side
    def request(self, status: int) -> None:
        self._l(self.requests, status=f"{status // 100}xx").inc()

    def prompt(self, n: int) -> None:
        self._l(self.prompt_tokens).inc(n)

    def first_token(self, seconds: float) -> None:
        self._l(self.ttft).observe(seconds)

    # -- engine side
    def queue_wait(self, seconds: float) -> None:
        self._l(self.wait).observe(seconds)

    def window(self, h2d_bytes: int, hits: int, misses: int) -> None:
        self._l(self.windows).inc()
        self._l(self.h2d).inc(h2d_bytes)
        self._l(self.hits).inc(hits)
        self._l(self.misses).inc(misses)
        t = self._totals
        t["hits"] += hits
        t["lookups"] += hits + misses
        if t["lookups"]:
            self._l(self.hit_rate).set(t["hits"] / t["lookups"])

    def finished(self, req: Any, sent: int, reason: str) -> None:
        self._l(self.finishes, reason=reason).inc()
        self._l(self.generated).inc(sent)
        tpot = req.clock.latency()["tpot_ms"]
        if tpot is not None:
            self._l(self.tpot).observe(tpot / 1e3)
        drafted, accepted = sum(req.drafted), sum(req.accepted)
        self._l(self.drafted).inc(drafted)
        self._l(self.accepted).inc(accepted)
        t = self._totals
        t["drafted"] += drafted
        t["accepted"] += accepted
        if t["drafted"]:
            self._l(self.acceptance).set(t["accepted"] / t["drafted"])

    def depth(self, waiting: int, decoding: int) -> None:
        self._l(self.waiting).set(waiting)
        self._l(self.decoding).set(decoding)

    def text(self) -> bytes:
        return generate_latest(self.registry)
