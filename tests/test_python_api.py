"""The Python API (specter/api.py): docs/python_api.md's example runs as written, its greedy tokens
equal target_only's, and bad input raises the project's one-line errors before anything decodes."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch
from conftest import REPO

import specter

DOC = REPO / "docs" / "python_api.md"


def doc_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks, "docs/python_api.md has no python example"
    assert len(blocks[0].strip().splitlines()) <= 10, "the example is meant to be ten lines"
    return blocks[0]


def target_only_tokens(prompts: list[str], n: int) -> list[list[int]]:
    """target_only's greedy tokens, built outside the API, cut at EOS as the API cuts them."""
    from transformers import AutoTokenizer

    from specter.api import compose_checked
    from specter.assembly.methods import build_method
    from specter.assembly.runtime import model_checkpoint

    cfg = compose_checked(["model=tiny_dsv2", "memory=low", "method=target_only"])
    ck = model_checkpoint(cfg)
    tok = AutoTokenizer.from_pretrained(ck)
    method = build_method(cfg, ck)
    out = []
    try:
        for p in prompts:
            ids = tok(p, add_special_tokens=False).input_ids
            tokens = method.generate(torch.tensor([ids]), n, torch.Generator().manual_seed(0)).tokens
            eos = tokens.index(tok.eos_token_id) if tok.eos_token_id in tokens else len(tokens)
            out.append(list(tokens[:eos]))
    finally:
        method.close()
    return out


@pytest.fixture(scope="module")
def example(tiny_checkpoint):
    tiny_checkpoint("tiny_dsv2")
    scope: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(doc_example(), str(DOC), "exec"), scope)  # noqa: S102 - the documented example, as written
    return scope, printed.getvalue()


def test_the_documented_example_runs_and_equals_target_only(example):
    scope, printed = example
    outs = scope["outs"]
    assert [o.prompt for o in outs] == ["def fib(n):", "class Stack:"]
    assert [o.tokens for o in outs] == target_only_tokens([o.prompt for o in outs], 24)
    for out in outs:
        assert out.finish_reason in ("length", "stop") and repr(out.text) in printed
        s = out.stats
        assert s.tokens == len(out.tokens) and s.batch == 2
        assert s.tpot_ms > 0 and s.acceptance_alpha is not None and s.tokens_per_window > 1
        assert s.h2d_bytes > 0 and s.expert_loads > 0 and 0 <= s.hit_rate <= 1
    result = scope["stream"].result
    assert result is not None and result.text and result.text in printed
    assert "specter: " in printed and "tokens/window" in printed


def test_a_closed_engine_refuses(example):
    llm = example[0]["llm"]
    with pytest.raises(specter.EngineClosed, match="closed"):
        llm.generate(["x"])


@pytest.mark.parametrize("settings,message", [
    ({"model": "nope"}, "model/nope"),
    ({"method": "nope"}, "method/nope"),
    ({"K": 0}, "K must be"),
    ({"typo": 1}, "typo"),
    ({"model": 3}, "model must be"),
    ({"max_batch": 0}, "max_batch"),
    ({"temperature": float("nan")}, "finite"),
    ({"hardware": object()}, "not a configuration value"),
])
def test_load_refuses_bad_settings(settings, message):
    with pytest.raises(specter.ConfigError, match=message):
        specter.load(**{"model": "tiny_dsv2", "memory": "low", **settings})


def test_generate_refuses_bad_requests(tiny_checkpoint):
    tiny_checkpoint("tiny_dsv2")
    with specter.load(model="tiny_dsv2", memory="low", method="target_only", warm=False) as llm:
        for kwargs, message in [({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": float("inf")}, "finite"),
                                ({"top_p": 0}, "top_p"), ({"seed": 2**40}, "seed"), ({"seed": -1}, "seed"),
                                ({"max_new_tokens": 10**6}, "context"), ({"ignore_eos": "yes"}, "ignore_eos")]:
            with pytest.raises(specter.ConfigError, match=message):
                llm.generate(["def f():"], **kwargs)
        for prompts, message in [([], "at least one"), (["a\ud800b"], "Unicode"), ([""], "no tokens"),
                                 ([3], "not a string")]:
            with pytest.raises(specter.ConfigError, match=message):
                llm.generate(prompts)
        with pytest.raises(specter.ConfigError, match="one prompt"):
            llm.stream(["a", "b"])
        one = llm.generate("def f(x):", max_new_tokens=3, ignore_eos=True)  # a string is one prompt
        assert len(one) == 1 and len(one[0].tokens) == 3 and one[0].stats.h2d_bytes is None
        stream = llm.stream("def f(x):", max_new_tokens=12, ignore_eos=True)
        first = next(iter(stream))
        assert first and stream.result is None  # text arrives while the request decodes, not at its end
        rest = "".join(stream)
        assert stream.result.text == first + rest and len(stream.result.tokens) == 12


def test_a_failing_prompt_raises_alone_and_its_neighbours_decode_through_the_one_scheduler(tiny_checkpoint,
                                                                                            monkeypatch):
    """generate steps the scheduler `specter serve` steps: a window shared with a failing prompt is retried
    for each prompt alone, so the failure names its prompt and the prompt before it still completes with the
    tokens a clean run gives; the engine decodes on afterwards."""
    from specter.api import DecodeError
    from specter.speculative.engine import SpeculativeEngine

    tiny_checkpoint("tiny_dsv2")
    prompts = ["def fib(n):", "poison pill here", "class Stack:"]
    with specter.load(model="tiny_dsv2", memory="low", method="specter", K=3, warm=False) as llm:
        clean = llm.generate([prompts[0], prompts[2]], max_new_tokens=10, ignore_eos=True)
        bad = llm.tokenizer(prompts[1], add_special_tokens=False).input_ids
        inner = SpeculativeEngine._iterate

        def iterate(self):
            if any(list(r.prompt[:len(bad)]) == bad for r in self.active):
                raise RuntimeError("poisoned window")
            return inner(self)

        monkeypatch.setattr(SpeculativeEngine, "_iterate", iterate)
        seen = []
        with pytest.raises(DecodeError, match="prompt 1 failed while decoding: RuntimeError: poisoned"):
            for done in llm._decode(llm._job(prompts, 10, None, None, None, True)):
                if done is not None:
                    seen.append(done)
        assert [d.prompt for d in seen] == [prompts[0]] and seen[0].tokens == clean[0].tokens
        again = llm.generate([prompts[0], prompts[2]], max_new_tokens=10, ignore_eos=True)
        assert [o.tokens for o in again] == [o.tokens for o in clean]
