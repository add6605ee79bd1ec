"""CUDA graphs of the static one-token step: capture, replay, equality to the eager compact step.

Two forms, on each tiny architecture (random weights, fp32):
  - the eager `StaticStep.step` captured by hand into a `torch.cuda.CUDAGraph` (it reads nothing
    back to the host, so it is capturable) and replayed with the next token and position written
    into its static inputs;
  - `use_static_step(compact, compile=True)`, which on CUDA compiles with CUDA graphs: no step
    may be skipped by the graph runtime, and every replay must equal the eager step.
"""

from __future__ import annotations

import pytest
import torch

from specter.models.compact import build_compact
from specter.models.compact.static import use_static_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
TINY = ["tiny_qwen", "tiny_dsv2", "tiny_phi"]
ATOL = 1e-4  # fp32 on the GPU (TF32 off below)


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _model(name: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from specter.models.tiny import make_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(name), dtype=torch.float32, experts_implementation="eager")
    return model.eval().cuda()


def _ids(model, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, model.config.vocab_size, (1, n), generator=g).cuda()  # [1, n]


@pytest.mark.parametrize("name", TINY)
@torch.inference_mode()
def test_eager_static_step_captures_and_replays(name):
    model = _model(name)
    ref, static = build_compact(model), use_static_step(build_compact(model), compile=False)
    step, ids = static.static, _ids(model, 14)
    ref_cache, cache = ref.new_cache(32), static.new_cache(32)
    ref.forward(ids[:, :4], ref_cache)
    static.forward(ids[:, :4], cache)
    positions, spans, cos, sin = step._tables(cache.capacity)
    token = ids[:, 4:5].clone()  # [1, 1] static input
    pos = positions[cache.length].clone()  # [1] static input
    span = spans[cache.length]  # on CUDA the whole buffer (static), masked past pos
    assert span.shape[0] == cache.capacity
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream (writes position 4; rewritten below)
        for _ in range(2):
            step.step(token, pos, span, cache.keys, cache.values, cos, sin)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = step.step(token, pos, span, cache.keys, cache.values, cos, sin)  # [1, V]
    for i in range(4, 14):
        token.copy_(ids[:, i:i + 1])
        pos.fill_(cache.length)
        graph.replay()
        cache.advance(1)
        want = ref.forward(ids[:, i:i + 1], ref_cache)[0]  # [1, V]
        torch.testing.assert_close(logits, want, atol=ATOL, rtol=1e-4, msg=lambda m: f"position {i}: {m}")


@pytest.mark.parametrize("name", TINY)
@torch.inference_mode()
def test_compiled_static_step_replays_cuda_graphs(name):
    from torch._dynamo.utils import counters

    model = _model(name)
    ref, static = build_compact(model), use_static_step(build_compact(model), compile=True)
    ids = _ids(model, 14)
    ref_cache, cache = ref.new_cache(32), static.new_cache(32)
    ref.forward(ids[:, :4], ref_cache)
    static.forward(ids[:, :4], cache)
    counters.clear()
    for i in range(4, 14):
        got = static.forward(ids[:, i:i + 1], cache)[0].clone()  # a replay's output is overwritten by the next
        want = ref.forward(ids[:, i:i + 1], ref_cache)[0]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4, msg=lambda m: f"position {i}: {m}")
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
