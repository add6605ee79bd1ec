"""One range for temperature and top_p, the same at every entry point (run.py's config, the Python
API and specter generate, the HTTP edge), and every value inside it samples: below GREEDY_BELOW
decoding is greedy, a top_p below fp32's smallest number keeps the most probable token. Hypothesis
draws floats with subnormals, infinities and NaN; the live server gives no 5xx for any of them."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from specter.assembly.config import ConfigError, _sampling
from specter.api import GREEDY_BELOW, sampling_params
from specter.speculative.sampling import SamplingParams, draft_next, logits_to_probs, speculative_verify

floats = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True, width=64)
REPORTED = (1e-38, 1e-39, 1e-45, 5e-324, 1e-300)  # temperatures that crashed a request


def _accepts(fn) -> bool:
    try:
        fn()
    except (ValueError, ConfigError):
        return False
    return True


def _edge_accepts(temperature: float, top_p: float) -> bool:
    pytest.importorskip("pydantic")
    from pydantic import ValidationError

    from specter.serve.schema import CompletionBody

    try:
        CompletionBody(model="m", prompt="x", temperature=temperature, top_p=top_p)
    except ValidationError:
        return False
    return True


@settings(max_examples=400, deadline=None, database=None)
@given(temperature=floats, top_p=floats)
@example(temperature=1e-38, top_p=1.0)
@example(temperature=0.7, top_p=1e-300)
@example(temperature=5e-324, top_p=5e-324)
def test_every_entry_point_takes_the_same_range(temperature, top_p):
    inside = math.isfinite(temperature) and temperature >= 0 and math.isfinite(top_p) and 0 < top_p <= 1
    assert _accepts(lambda: sampling_params(temperature, top_p)) == inside  # specter generate, specter.load
    cfg = OmegaConf.create({"temperature": temperature, "top_p": top_p, "top_k": 0})
    assert _accepts(lambda: _sampling(cfg)) == inside  # run.py's config
    assert _edge_accepts(temperature, top_p) == inside  # specter serve


@settings(max_examples=300, deadline=None, database=None)
@given(temperature=st.floats(min_value=0, max_value=1e308, allow_subnormal=True),
       top_p=st.floats(min_value=0, max_value=1, exclude_min=True, allow_subnormal=True),
       top_k=st.integers(0, 40), scale=st.sampled_from([1.0, 30.0, 1e4]))
@example(temperature=1e-38, top_p=1.0, top_k=0, scale=30.0)
@example(temperature=GREEDY_BELOW, top_p=1e-300, top_k=0, scale=1e4)
@example(temperature=1e300, top_p=1.0, top_k=0, scale=1.0)
def test_every_value_in_range_gives_a_distribution_and_a_token(temperature, top_p, top_k, scale):
    params = sampling_params(temperature, top_p, top_k)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 32, generator=gen) * scale  # [T, V]
    probs = logits_to_probs(logits, params)  # [T, V]
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.sum(-1), torch.ones(3), atol=1e-4)
    tokens, q = draft_next(logits, params, gen)  # [T]
    assert ((tokens >= 0) & (tokens < 32)).all()
    if not params.greedy:
        p = logits_to_probs(torch.randn(4, 32, generator=gen) * scale, params)  # [K+1, V]
        n, token = speculative_verify(tokens, q, p, gen)
        assert 0 <= n <= 3 and 0 <= token < 32


@pytest.mark.parametrize("temperature", REPORTED + (GREEDY_BELOW / 2,))
def test_a_temperature_below_the_threshold_is_greedy_and_shares_the_greedy_settings(temperature):
    params = sampling_params(temperature, 0.9, 5)
    assert params.greedy and params == SamplingParams()
    logits = torch.randn(2, 50)
    assert torch.equal(logits_to_probs(logits, params).argmax(-1), logits.argmax(-1))


def test_at_the_threshold_decoding_samples():
    assert not sampling_params(GREEDY_BELOW, 1.0).greedy


# ---------------------------------------------------------------------------------- the live server
@pytest.fixture(scope="module")
def live(tiny_live_server):
    return tiny_live_server


def _complete(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_the_server_samples_or_refuses_every_float_and_never_fails(live):
    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(temperature=floats, top_p=floats)
    @example(temperature=1e-38, top_p=1.0)
    @example(temperature=1e-45, top_p=1.0)
    @example(temperature=5e-324, top_p=1.0)
    @example(temperature=1e-300, top_p=1.0)
    @example(temperature=0.8, top_p=1e-300)
    def call(temperature, top_p):
        # Python's JSON writer spells NaN and Infinity as the server's reader takes them
        body = json.dumps({"model": "tiny_dsv2", "prompt": "def f(x):", "max_tokens": 2, "ignore_eos": True,
                           "temperature": temperature, "top_p": top_p, "seed": 1}).encode()
        status, reply = _complete(live.url, body)
        inside = math.isfinite(temperature) and temperature >= 0 and math.isfinite(top_p) and 0 < top_p <= 1
        assert status == (200 if inside else 400), (temperature, top_p, status, reply)
        if inside:
            assert reply["usage"]["completion_tokens"] == 2
        else:
            assert reply["error"]["param"] in ("temperature", "top_p"), reply

    call()
    assert live.loop.alive
