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
import urllib.error
import urllib.request

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")
from hypothesis import HealthCheck, settings  # noqa: E402


MODEL = "tiny_dsv2"
EXAMPLES = int(os.environ.get("SPECTER_SCHEMA_EXAMPLES", "8"))
import schemathesis.specs.openapi.checks  # noqa: E402,F401 - registers the OpenAPI checks

# all of them (schemathesis run --checks all) but positive_data_acceptance: a schema-valid body may still be a
# documented 400, since JSON Schema cannot say that prompt tokens + max_tokens must fit the model's context,
# that a prompt must tokenize to something, or that an unsupported field is refused only at a value that asks
# for something (docs/serving.md); every such 400 names its field, as the other checks and tests hold
CHECKS = [c for c in schemathesis.checks.CHECKS.get_all() if c.__name__ != "positive_data_acceptance"]


@pytest.fixture(scope="module")
def live(tiny_live_server):
    return tiny_live_server


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
            # every schemathesis check: no 5xx, status codes, content types and headers as documented, 405
            # with Allow for other methods, invalid data refused; a hang fails at the 30 s timeout
            response = case.call_and_validate(checks=CHECKS, timeout=30)
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


def test_the_schema_says_what_the_routes_answer(live):
    with urllib.request.urlopen(live.url + "/openapi.json", timeout=10) as resp:
        doc = json.loads(resp.read())
    for path, methods in doc["paths"].items():
        for operation in methods.values():
            codes = set(operation["responses"])
            assert "422" not in codes and {"200", "404", "405", "500", "503"} <= codes, (path, codes)
            for code in codes - {"200"}:
                assert operation["responses"][code]["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/Error"}
    assert {"400", "413"} <= set(doc["paths"]["/v1/completions"]["post"]["responses"])
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "HTTPValidationError" not in doc["components"]["schemas"]


@pytest.mark.parametrize("path,allowed", [("/health", "GET"), ("/metrics", "GET"), ("/v1/models", "GET"),
                                          ("/v1/completions", "POST")])
def test_a_method_the_path_does_not_take_is_405_with_allow(live, path, allowed):
    for method in ("TRACE", "DELETE"):
        req = urllib.request.Request(live.url + path, method=method)
        try:
            urllib.request.urlopen(req, timeout=10)
            pytest.fail(f"{method} {path} was answered")
        except urllib.error.HTTPError as err:
            assert err.code == 405 and err.headers.get("Allow") == allowed, (method, path, dict(err.headers))
            assert json.loads(err.read())["error"]["message"]
