"""No single request can stall `specter serve` or end another's stream.

Values run.py refuses are refused at the HTTP edge (400, never the engine thread); a request of one
token decodes; a failure inside one request's window ends that request only (its neighbours resume
and finish with their own tokens); an engine thread that stops anyway turns /health to 503 and makes
the server exit; a huge body is refused before it is parsed; a non-streaming client that leaves
stops its decoding."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from specter.api import build_served as load  # noqa: E402
from specter.models.loading import load_full_model  # noqa: E402
from specter.serve.app import MAX_BODY_BYTES, create_app  # noqa: E402
from specter.serve.loop import Job, QueueFull, ServingLoop  # noqa: E402
from specter.serve.metrics import ServeMetrics  # noqa: E402
from specter.serve.server import ThreadedServer  # noqa: E402
from specter.speculative.autoregressive import generate_autoregressive  # noqa: E402
from specter.speculative.engine import SpeculativeEngine  # noqa: E402
from specter.speculative.sampling import SamplingParams  # noqa: E402

MODEL = "tiny_dsv2"
SPECTER = [f"model={MODEL}", "memory=low", "hardware=emulated", "hardware.bandwidth_gbps=20",
           "hardware.latency_us=5", "warmup_tokens=4", "method=specter", "method.quant=rtn", "K=4"]


@pytest.fixture(scope="module")
def server():
    served = load(SPECTER)
    try:
        with ThreadedServer(served, max_queue=8) as srv:
            yield srv, served
    finally:
        served.close()


@pytest.fixture(scope="module")
def reference(server):
    _, served = server
    model = load_full_model(served.checkpoint, torch.float32, torch.device("cpu"))
    return lambda ids, n: generate_autoregressive(model, torch.tensor([ids]), n, SamplingParams())


def _post(url: str, body: bytes | dict, path: str = "/v1/completions", timeout: float = 60) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _stream(url: str, body: dict) -> tuple[list[int], list[str]]:
    """(token ids, every `data:` payload) of a streamed completion."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    ids, payloads = [], []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            payloads.append(line[6:])
            if line[6:] != "[DONE]":
                chunk = json.loads(line[6:])
                ids.extend(chunk.get("choices", [{}])[0].get("token_ids") or [])
    return ids, payloads


def _healthy(url: str) -> None:
    code, body = _post(url, {"model": MODEL, "prompt": "def f(x):", "max_tokens": 3, "ignore_eos": True})
    assert code == 200 and body["usage"]["completion_tokens"] == 3, body
    with urllib.request.urlopen(url + "/health", timeout=5) as resp:
        assert json.loads(resp.read())["status"] == "ok"


# ---------------------------------------------------------------------------------- the edge
@pytest.mark.parametrize("raw,param", [
    (b'{"model": "M", "prompt": "hi", "seed": 1180591620717411303424}', "seed"),  # 2**70: killed the engine
    (b'{"model": "M", "prompt": "hi", "seed": 2147483648}', "seed"),  # 2**31
    (b'{"model": "M", "prompt": "hi", "seed": -1}', "seed"),
    (b'{"model": "M", "prompt": "hi", "temperature": NaN}', "temperature"),  # was a 500
    (b'{"model": "M", "prompt": "hi", "temperature": Infinity}', "temperature"),  # was accepted and sampled
    (b'{"model": "M", "prompt": "hi", "top_p": NaN}', "top_p"),
    (b'{"model": "M", "prompt": "hi", "top_p": -Infinity}', "top_p"),
    (b'{"model": "M", "prompt": "a\\ud800b"}', "prompt"),  # a lone surrogate: was a 500 TypeError
    (b'{"model": "M", "prompt": ["a\\udfffb"]}', "prompt"),
])
def test_values_run_py_refuses_are_400_at_the_edge(server, raw, param):
    srv, _ = server
    code, err = _post(srv.url, raw.replace(b'"M"', f'"{MODEL}"'.encode()))
    assert code == 400, err
    assert err["error"]["param"].startswith(param) and err["error"]["type"] == "invalid_request_error"
    _healthy(srv.url)  # and the engine still serves


@pytest.mark.parametrize("content", ["x\ud800", [{"type": "text", "text": "x\udc00y"}]])
def test_chat_text_that_does_not_encode_is_400(server, content):
    srv, _ = server
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]}).encode()
    code, err = _post(srv.url, raw, "/v1/chat/completions")
    assert code == 400 and err["error"]["param"].startswith("messages"), err
    _healthy(srv.url)


# ---------------------------------------------------------------------------------- one-token requests
def test_max_tokens_1_in_every_endpoint(server, reference):
    srv, served = server
    ids = served.tokenizer("def fib(n):", add_special_tokens=False).input_ids
    code, body = _post(srv.url, {"model": MODEL, "prompt": ids, "max_tokens": 1, "ignore_eos": True,
                                 "return_token_ids": True})
    assert code == 200, body
    assert body["choices"][0]["token_ids"] == reference(ids, 1)
    code, body = _post(srv.url, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                 "ignore_eos": True}, "/v1/chat/completions")
    assert code == 200 and body["usage"]["completion_tokens"] == 1, body
    got, payloads = _stream(srv.url, {"model": MODEL, "prompt": ids, "max_tokens": 1, "ignore_eos": True,
                                      "return_token_ids": True})
    assert got == reference(ids, 1) and payloads[-1] == "[DONE]"


def test_one_token_neighbours_leave_a_stream_untouched(server, reference):
    """The failure of the issue: a max_tokens=1 request sharing the stream's decoder ended that stream."""
    srv, served = server
    long = [7, 8, 9, 10, 11]
    n = 40
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(out=_stream(srv.url, {
        "model": MODEL, "prompt": long, "max_tokens": n, "ignore_eos": True, "return_token_ids": True})))
    t.start()
    time.sleep(0.3)
    for i in range(4):
        code, body = _post(srv.url, {"model": MODEL, "prompt": [20 + i, 30], "max_tokens": 1, "ignore_eos": True})
        assert code == 200, body
    t.join(timeout=120)
    ids, payloads = result["out"]
    assert ids == reference(long, n) and payloads[-1] == "[DONE]"


# ---------------------------------------------------------------------------------- isolation
POISON = [999, 998, 997]


@pytest.fixture
def poisoned(monkeypatch):
    """A window fails whenever a request whose prompt starts with POISON is in it."""
    inner = SpeculativeEngine._iterate

    def iterate(self):
        if any(r.prompt[:3] == POISON for r in self.active):
            raise RuntimeError("poisoned window")
        return inner(self)

    monkeypatch.setattr(SpeculativeEngine, "_iterate", iterate)


def test_a_failing_request_never_ends_a_neighbours_stream(server, reference, poisoned):
    srv, _ = server
    prompts = [[5, 6, 7, 8], [40, 41], [300, 301, 302]]
    n = 30
    outs: list = [None] * len(prompts)

    def run(i):
        outs[i] = _stream(srv.url, {"model": MODEL, "prompt": prompts[i], "max_tokens": n, "ignore_eos": True,
                                    "return_token_ids": True})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    time.sleep(0.3)  # the streams are decoding together
    code, err = _post(srv.url, {"model": MODEL, "prompt": [*POISON, 1], "max_tokens": 8, "ignore_eos": True})
    assert code == 500 and err["error"]["type"] == "server_error"
    for t in threads:
        t.join(timeout=120)
    for prompt, (ids, payloads) in zip(prompts, outs):
        assert payloads[-1] == "[DONE]" and ids == reference(prompt, n)
    assert srv.loop.alive
    _healthy(srv.url)


def test_a_request_that_cannot_enter_ends_alone(server, monkeypatch):
    """A failure while a job enters its decoder (here: its generator) ends that job, not the thread."""
    srv, _ = server
    import specter.scheduler as loop_mod

    inner = loop_mod.make_generator

    def make_generator(device, seed):
        if seed == 12345:
            raise ValueError("Overflow when unpacking long long")
        return inner(device, seed)

    monkeypatch.setattr(loop_mod, "make_generator", make_generator)
    code, err = _post(srv.url, {"model": MODEL, "prompt": "hi", "max_tokens": 4, "seed": 12345})
    assert code == 500 and "engine failed" in err["error"]["message"]
    assert srv.loop.alive
    _healthy(srv.url)


# ---------------------------------------------------------------------------------- supervision
def test_a_stopped_engine_fails_its_requests_and_health_and_ends_the_server(server, monkeypatch):
    from fastapi.testclient import TestClient

    _, served = server
    metrics = ServeMetrics(served.name, served.method.name)
    loop = ServingLoop(served.method, 2, 4, metrics)
    died = threading.Event()
    loop.on_death = died.set

    def broken() -> None:
        raise SystemError("the engine broke")

    monkeypatch.setattr(loop.scheduler, "step", broken)
    ended: list = []
    loop.start()
    loop.submit(Job([1, 2, 3], 4, SamplingParams(), lambda ids, reason: ended.append(reason)))
    assert died.wait(10) and ended == ["error"]
    assert not loop.alive and "the engine broke" in loop.failure
    with pytest.raises(QueueFull, match="stopped"):
        loop.submit(Job([1], 1, SamplingParams(), lambda ids, reason: None))
    assert loop.drain(5)  # returns at once: nothing is left to wait for
    client = TestClient(create_app(served, loop, metrics))  # no lifespan: the loop is not restarted
    resp = client.get("/health")
    assert resp.status_code == 503 and resp.json()["status"] == "engine stopped"


def test_threaded_server_exits_when_its_engine_stops(server, monkeypatch):
    _, served = server
    srv = ThreadedServer(served, max_queue=2)
    with srv:
        monkeypatch.setattr(srv.loop.scheduler, "step", lambda: (_ for _ in ()).throw(SystemError("broken")))
        code, err = _post(srv.url, {"model": MODEL, "prompt": "hi", "max_tokens": 4}, timeout=30)
        assert code in (500, 503), err
        srv.thread.join(timeout=30)
        assert not srv.thread.is_alive()  # the server exited instead of answering "ok" with no engine


# ---------------------------------------------------------------------------------- bodies and clients
def test_a_huge_body_is_413_and_never_holds_up_health(server):
    srv, _ = server
    big = json.dumps({"model": MODEL, "prompt": "x" * (MAX_BODY_BYTES + 10)}).encode()
    code, err = _post(srv.url, big)
    assert code == 413 and err["error"]["code"] == "request_too_large"
    # just under the limit: tokenized off the event loop, so /health answers meanwhile
    almost = json.dumps({"model": MODEL, "prompt": "lorem ipsum " * (MAX_BODY_BYTES // 16)}).encode()
    t = threading.Thread(target=_post, args=(srv.url, almost))
    t.start()
    time.sleep(0.2)
    start = time.monotonic()
    with urllib.request.urlopen(srv.url + "/health", timeout=30) as resp:
        assert resp.status == 200
    assert time.monotonic() - start < 2.0
    t.join(timeout=120)
    _healthy(srv.url)


def _cancelled(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("specter_requests_finished_total") and 'reason="cancelled"' in line)


def test_a_non_streaming_client_that_leaves_stops_its_decoding(server):
    srv, served = server
    before = _cancelled(srv.url)
    body = json.dumps({"model": MODEL, "prompt": [3, 4, 5], "max_tokens": served.context_length - 8,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 10
        while srv.loop.depth()[1] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
    deadline = time.monotonic() + 60
    while srv.loop.depth() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _cancelled(srv.url) == before + 1  # cancelled, not decoded to its length
    _healthy(srv.url)


# ---------------------------------------------------------------------------------- protocol-level 400s
def _raw(port: int, data: bytes) -> tuple[int, str, dict]:
    """(status, content-type, JSON body) of a raw HTTP exchange."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers.get("content-type", ""), json.loads(body)


def _post_raw(body: bytes, content_type: str | None) -> bytes:
    ctype = f"Content-Type: {content_type}\r\n" if content_type else ""
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{ctype}Content-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


@pytest.mark.parametrize("data,expect", [
    (b"GARBAGE\r\n\r\n", "not valid HTTP"),  # uvicorn's own 400: was plain text
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", "not valid HTTP"),  # plain text
    (_post_raw(b'{"model": "tiny_dsv2", "prompt": "hi"}', "text/plain"), "Content-Type: application/json"),
    (_post_raw(b'{"model": "tiny_dsv2", "prompt": "hi"}', None), "Content-Type: application/json"),
    (_post_raw(b'{"model": "tiny_dsv2", "prompt": ', "application/json"), "not valid JSON"),
    (_post_raw(b'{"model": "\xff"}', "application/json"), "UTF-8"),
])
def test_protocol_level_400s_have_the_json_error_shape(server, data, expect):
    srv, _ = server
    status, ctype, body = _raw(srv.port, data)
    assert status == 400 and ctype.startswith("application/json"), (status, ctype, body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and expect in body["error"]["message"]
    _healthy(srv.url)
