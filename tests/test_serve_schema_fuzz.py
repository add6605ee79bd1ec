"""The HTTP API fuzzed from its own OpenAPI schema (schemathesis) against a live `specter serve` on
loopback: valid and invalid bodies for every operation get no 5xx and no hang, and a normal request
still succeeds afterwards.

Bounded: a few examples per operation (SPECTER_SCHEMA_EXAMPLES, default 8), a 30 s limit per call, a
64-token context so no request decodes long. Every body names the served model, so requests reach
the engine instead of stopping at the 404 for an unknown model.
"""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")
from hypothesis import HealthCheck, settings  # noqa: E402

from specter.serve.build import load  # noqa: E402
from specter.serve.server import ThreadedServer  # noqa: E402

MODEL = "tiny_dsv2"
SERVED = [f"model={MODEL}", "memory=low", "hardware=emulated", "hardware.bandwidth_gbps=20", "hardware.latency_us=5",
          "method=specter", "method.quant=rtn", "K=4", "model.context_length=64", "prefix_tokens=8",
          "max_new_tokens=16", "warmup_tokens=4"]
EXAMPLES = int(os.environ.get("SPECTER_SCHEMA_EXAMPLES", "8"))


@pytest.fixture(scope="module")
def live():
    served = load(SERVED)
    try:
        with ThreadedServer(served, max_queue=4, drain_timeout_s=10) as srv:
            yield srv
    finally:
        served.close()


def test_no_request_from_the_schema_gets_a_5xx_or_hangs(live):
    from hypothesis import given

    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/health"}
    calls = 0
    for operation in operations:
        strategy = operation.as_strategy(generation_mode=GenerationMode.POSITIVE) | \
            operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)  # valid bodies and invalid ones

        @given(case=strategy)
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def call(case):
            nonlocal calls
            if isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL
            response = case.call(timeout=30)  # a hang fails here
            calls += 1
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
            assert live.loop.alive

        call()
    assert calls >= len(operations)


def test_the_server_is_healthy_after_the_fuzz(live):
    with urllib.request.urlopen(live.url + "/health", timeout=10) as resp:
        assert json.loads(resp.read())["status"] == "ok"
    body = json.dumps({"model": MODEL, "prompt": "def f(x):", "max_tokens": 4, "ignore_eos": True}).encode()
    req = urllib.request.Request(live.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert json.loads(resp.read())["usage"]["completion_tokens"] == 4
