"""Requests shorter than a window: max_new_tokens = 1 (finished by the prefill alone) and K >= the
tokens left, at B = 1 and B > 1, in the speculative engine, batched autoregressive decoding and
`python run.py`. The window length K_b = min(K, remaining - 1) is never negative; a request done by
its prefill leaves the batch before the next window."""

from __future__ import annotations

import pytest
import torch
from conftest import cli_in_process, compose

from specter.assembly.methods import build_method
from specter.models.loading import load_full_model
from specter.speculative.autoregressive import generate_autoregressive
from specter.speculative.batched import BatchedAutoregressive
from specter.speculative.sampling import SamplingParams

NAME = "tiny_dsv2"
GREEDY = SamplingParams()


def _cfg(*extra: str):
    return compose([f"model={NAME}", "memory=low", "method=specter", "method.quant=rtn", "hardware=emulated",
                    "hardware.bandwidth_gbps=20", "hardware.latency_us=5", *extra])


def _prompts(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 1000, (1, int(length)), generator=g) for length in torch.randint(2, 12, (n,), generator=g)]


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    ck = tiny_checkpoint(NAME)
    model = load_full_model(ck, torch.float32, torch.device("cpu"))
    method = build_method(_cfg("K=6"), ck)
    yield ck, model, method
    method.close()


def _reference(model, prompt: torch.Tensor, n: int) -> list[int]:
    return generate_autoregressive(model, prompt, n, GREEDY)


@pytest.mark.parametrize("limits", [[1], [2], [3], [1, 1, 1], [1, 2, 7, 3], [5, 1]])
def test_speculative_engine_with_k_at_or_above_what_is_left(setup, limits):
    """K = 6 against 1..7 tokens: B = 1 and mixed batches, each equal to its greedy continuation."""
    _, model, method = setup
    prompts = _prompts(len(limits))
    engine = method.make_engine()
    method.reset()
    run = engine.generate_batch(prompts, limits)
    for prompt, n, req in zip(prompts, limits, run.requests):
        assert req.tokens == _reference(model, prompt, n), (limits, n)
        assert all(0 <= k for k in req.drafted) and sum(req.drafted) <= max(0, n - 1)
    assert engine.kv.batch_size == 0


def test_a_one_token_request_joins_a_running_batch(setup):
    """A request of one token submitted between windows of a running request: neither is disturbed."""
    _, model, method = setup
    long, short = _prompts(2)
    engine = method.make_engine()
    method.reset()
    engine.begin_run()
    a = engine.submit(long, 12)
    engine.step()
    b = engine.submit(short, 1)
    while engine.queue or engine.active:
        engine.step()
    assert a.tokens == _reference(model, long, 12) and b.tokens == _reference(model, short, 1)


@pytest.mark.parametrize("limits", [[1], [1, 1], [1, 4]])
def test_batched_autoregressive_one_token(setup, limits):
    _, model, _ = setup
    prompts = _prompts(len(limits))
    loop = BatchedAutoregressive(model, GREEDY)
    run = loop.generate_batch(prompts, limits)
    assert [r.tokens for r in run.requests] == [_reference(model, p, n) for p, n in zip(prompts, limits)]


@pytest.mark.parametrize("method", ["specter", "target_only", "offload_ar"])
def test_run_py_with_max_new_tokens_1(method, tmp_path, capsys, tiny_checkpoint):
    from conftest import FIXTURES

    tiny_checkpoint(NAME)
    rc, out, err = cli_in_process([f"model={NAME}", f"method={method}", "memory=low", "dataset=gsm8k",
                                   "num_prompts=1", "max_new_tokens=1", "warmup_tokens=0", "progress=false",
                                   "hardware=emulated", "hardware.bandwidth_gbps=20", "hardware.latency_us=5",
                                   f"assets_dir={FIXTURES / 'datasets'}", f"output_dir={tmp_path / 'o'}",
                                   *(["method.quant=rtn"] if method == "specter" else [])], capsys)
    assert rc == 0, err[-2000:]
    assert "Traceback" not in err
    assert (tmp_path / "o" / "records.csv").read_text().count("\n") == 2  # the header and one record
