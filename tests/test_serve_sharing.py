"""How requests with different sampling settings share the serving loop (specter/serve/loop.py).

The decoders are replaced by a fake that commits one token per row per window, so the tests read
the scheduler's decisions in windows, not seconds: a request whose settings already have a decoder
never waits behind one that needs a decoder of its own, and that one's wait is bounded by the
least-loaded decoder's requests even while others keep arriving for it."""

from __future__ import annotations

import threading
import time

import torch

import specter.scheduler as loop_module
from specter.serve.loop import MAX_DECODERS, Job, ServingLoop
from specter.speculative.batch_state import Request
from specter.api import sampling_params


class OneTokenPerWindow:
    """A BatchLoop stand-in: each step commits one token (its row count) to every active request."""

    def __init__(self):
        self.queue, self.active, self.submitted = [], [], []

    def submit(self, prompt, max_new_tokens, generator=None):
        req = Request(len(self.submitted), int(prompt.numel()), max_new_tokens, generator)
        self.queue.append(req)
        self.submitted.append(req)
        return req

    def step(self):
        self.active += self.queue
        self.queue = []
        for req in self.active:
            req.tokens.append(7)
        done = [r for r in self.active if r.done]
        self.active = [r for r in self.active if not r.done]
        return done

    def cancel(self, req):
        self.queue = [r for r in self.queue if r is not req]
        self.active = [r for r in self.active if r is not req]
        return True

    def begin_run(self):
        self.submitted = []


class FakeMethod:
    device = torch.device("cpu")
    rt = None  # no offloading runtime: no link bytes or cache counts to account


def _loop(monkeypatch, max_batch: int = 16) -> tuple[ServingLoop, dict[str, int]]:
    monkeypatch.setattr(loop_module, "batch_loop", lambda method, params: OneTokenPerWindow())
    loop = ServingLoop(FakeMethod(), max_batch=max_batch, max_queue=64)
    return loop, {}


def _job(loop: ServingLoop, finished: dict[str, int], name: str, temperature: float, tokens: int,
         done: threading.Event | None = None) -> Job:
    def emit(ids, reason):
        if reason is not None:
            finished[name] = loop.windows  # windows stepped (all decoders) when it finished
            if done is not None:
                done.set()

    return Job([1, 2, 3], tokens, sampling_params(temperature, 1.0), emit)  # as the routes build it


def _wait(finished: dict[str, int], names: list[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(n in finished for n in names):
        assert time.monotonic() < deadline, f"not finished: {[n for n in names if n not in finished]}"
        time.sleep(0.01)


def test_a_request_with_a_running_decoder_does_not_wait_behind_one_needing_a_new_decoder(monkeypatch):
    """Today's failure: a 4-token request at a running setting waited while a fifth setting queued ahead."""
    loop, finished = _loop(monkeypatch)
    assert MAX_DECODERS == 4
    for i, t in enumerate((0.1, 0.2, 0.3)):
        loop.submit(_job(loop, finished, f"long{i}", t, 400))
    loop.submit(_job(loop, finished, "short_d", 0.4, 60))
    loop.submit(_job(loop, finished, "fifth", 0.5, 4))  # no decoder free for its setting
    loop.submit(_job(loop, finished, "same_as_long0", 0.1, 4))  # its decoder is running
    loop.start()
    try:
        _wait(finished, ["same_as_long0", "fifth"])
    finally:
        loop.close()
    assert finished["same_as_long0"] <= 4 * 8, finished  # a few windows of each decoder, not short_d's 60
    assert finished["same_as_long0"] < finished["short_d"] < finished["fifth"], finished
    assert "long0" not in finished or finished["fifth"] < finished["long0"]


def test_a_new_setting_waits_for_the_least_loaded_decoder_only_even_under_a_stream_for_it(monkeypatch):
    """The wait is bounded: the decoder with the fewest tokens left admits no newcomers until the
    request needing a decoder has one, so a steady stream for that decoder cannot starve it."""
    loop, finished = _loop(monkeypatch)
    for i, t in enumerate((0.1, 0.2, 0.3)):
        loop.submit(_job(loop, finished, f"long{i}", t, 2000))
    loop.submit(_job(loop, finished, "d0", 0.4, 20))
    loop.submit(_job(loop, finished, "fifth", 0.5, 4))
    loop.start()
    try:
        for i in range(1, 40):  # more requests for the least-loaded decoder's setting keep arriving
            loop.submit(_job(loop, finished, f"d{i}", 0.4, 20))
            time.sleep(0.005)
        _wait(finished, ["fifth"])
    finally:
        loop.close()
    assert finished["fifth"] < finished.get("long0", 10**9), finished
    assert finished["fifth"] <= 4 * (20 + 4 + 8), finished  # d0's 20 windows, its own 4, slack for admission


def test_requests_below_the_greedy_threshold_share_the_greedy_decoder(monkeypatch):
    loop, finished = _loop(monkeypatch)
    jobs = [_job(loop, finished, f"g{i}", t, 3) for i, t in enumerate((0.0, 1e-6, 1e-38, 5e-324))]
    assert len({j.key for j in jobs}) == 1
    for job in jobs:
        loop.submit(job)
    loop.start()
    try:
        _wait(finished, [f"g{i}" for i in range(4)])
    finally:
        loop.close()
