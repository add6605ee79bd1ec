"""One rule for the OpenAI request fields, held field by field to the openai client's own request types:
every field is honoured (declared on the body), a label (accepted, changes no output), or refused with a
400 naming it unless its value asks for nothing; a field the endpoint does not have is refused too."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from openai.types import completion_create_params as completion_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_params  # noqa: E402

from specter.serve.schema import (  # noqa: E402
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    LABELS,
    NEUTRAL,
    ChatBody,
    CompletionBody,
    unhonoured,
)

ASKS_SOMETHING = {  # a value of each field that asks for what the server does not do
    "n": 2, "best_of": 3, "echo": True, "frequency_penalty": 0.5, "presence_penalty": -0.5, "logit_bias": {"5": 10},
    "logprobs": 5, "top_logprobs": 3, "suffix": "end", "stop": ["\n"], "stream_options": {"include_usage": True},
    "tools": [{"type": "function", "function": {"name": "f"}}], "functions": [{"name": "f"}], "tool_choice": "auto",
    "function_call": "auto", "response_format": {"type": "json_object"}, "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"}, "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "high", "verbosity": "low", "web_search_options": {}, "moderation": {"model": "m"},
    "parallel_tool_calls": "yes"}


def _openai_fields(module) -> set[str]:
    return set(module.CompletionCreateParamsBase.__annotations__) | {"stream"}


def _declared(body) -> set[str]:
    return set(body.model_fields)


@pytest.mark.parametrize("fields,module", [(COMPLETION_FIELDS, completion_params), (CHAT_FIELDS, chat_params)],
                         ids=["completions", "chat"])
def test_the_table_is_the_openai_clients_field_list(fields, module):
    # a field the openai client gains fails here until the table says what the server does with it
    assert fields == _openai_fields(module)


@pytest.mark.parametrize("body,module", [(CompletionBody, completion_params), (ChatBody, chat_params)],
                         ids=["completions", "chat"])
def test_every_field_is_honoured_a_label_or_refused_by_name(body, module):
    base = {"model": "m", "prompt": "x"} if body is CompletionBody else {"model": "m", "messages": [
        {"role": "user", "content": "x"}]}
    for name in sorted(_openai_fields(module) - _declared(body)):
        if name in LABELS:
            assert unhonoured(body(**base, **{name: "label"})) is None, name
            continue
        assert name in ASKS_SOMETHING, f"{name}: say what a non-neutral value is"
        assert unhonoured(body(**base, **{name: None})) is None, name  # null asks for nothing
        for neutral in NEUTRAL.get(name, ()):
            assert unhonoured(body(**base, **{name: neutral})) is None, (name, neutral)
        err = unhonoured(body(**base, **{name: ASKS_SOMETHING[name]}))
        assert err is not None and (err.status, err.param, err.code) == (400, name, "unsupported_field"), name
        assert name in err.message


def test_a_boolean_is_not_the_number_it_equals():
    assert unhonoured(CompletionBody(model="m", prompt="x", n=True)).param == "n"
    assert unhonoured(CompletionBody(model="m", prompt="x", echo=0)).param == "echo"


def test_a_field_of_neither_api_is_refused_by_name():
    err = unhonoured(CompletionBody(model="m", prompt="x", top_k=3))
    assert (err.param, err.code) == ("top_k", "unknown_field")
    err = unhonoured(CompletionBody(model="m", prompt="x", messages=[]))  # a chat field on /v1/completions
    assert (err.param, err.code) == ("messages", "unknown_field")
    assert unhonoured(CompletionBody(model="m", prompt="x", ignore_eos=True, return_token_ids=True)) is None


# ---------------------------------------------------------------------------------- the live server
@pytest.fixture(scope="module")
def live(tiny_live_server):
    return tiny_live_server


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_the_server_refuses_what_it_does_not_honour_and_takes_the_rest(live):
    name = "tiny_dsv2"  # the served model's name
    completion = {"model": name, "prompt": "def f(x):", "max_tokens": 2}
    status, reply = _post(live.url, "/v1/completions", {**completion, "logprobs": 5})
    assert status == 400 and reply["error"]["param"] == "logprobs" and reply["error"]["code"] == "unsupported_field"
    status, reply = _post(live.url, "/v1/completions", {**completion, "best_of": 2})
    assert status == 400 and reply["error"]["param"] == "best_of"
    status, reply = _post(live.url, "/v1/completions", {**completion, "user": "u1", "logprobs": None, "n": 1,
                                                        "presence_penalty": 0, "stop": []})
    assert status == 200 and reply["choices"][0]["logprobs"] is None, reply
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, reply = _post(live.url, "/v1/chat/completions", {**chat, "tools": [{"type": "function",
                                                                                  "function": {"name": "f"}}]})
    assert status == 400 and reply["error"]["param"] == "tools"
    status, reply = _post(live.url, "/v1/chat/completions", {**chat, "metadata": {"k": "v"}, "store": False})
    assert status == 200, reply
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=name, prompt="hi", max_tokens=2, logprobs=2)
