"""`specter serve` driven by the `openai` client on a loopback port: greedy outputs equal target_only's,
streaming and not; 32 concurrent streams each equal their own B = 1 output; a client that leaves
mid-stream frees its rows without disturbing the others; bad input gets OpenAI-style 4xx bodies."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from specter.api import build_served as load  # noqa: E402
from specter.api import compose_checked  # noqa: E402
from specter.assembly.methods import build_method  # noqa: E402
from specter.serve.app import ChatMessage, chat_prompt  # noqa: E402
from specter.serve.loop import Job, QueueFull, ServingLoop  # noqa: E402
from specter.serve.server import ThreadedServer  # noqa: E402
from specter.speculative.sampling import SamplingParams  # noqa: E402

MODEL = "tiny_dsv2"
COMMON = [f"model={MODEL}", "memory=low", "hardware=emulated", "hardware.bandwidth_gbps=20", "hardware.latency_us=5",
          "warmup_tokens=4"]
SPECTER = [*COMMON, "method=specter", "method.quant=rtn", "K=4"]
TARGET = [*COMMON, "method=target_only"]
EXTRA = {"ignore_eos": True, "return_token_ids": True}  # exact lengths; the ids the server committed


@pytest.fixture(scope="module")
def specter_server():
    served = load(SPECTER)
    try:
        with ThreadedServer(served, max_queue=8) as srv:
            yield srv, served
    finally:
        served.close()


@pytest.fixture(scope="module")
def client(specter_server):
    srv, _ = specter_server
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(specter_server):
    """target_only's greedy tokens for a prompt (the B = 1 output every request must equal)."""
    _, served = specter_server
    cfg = compose_checked(TARGET)
    method = build_method(cfg, served.checkpoint)
    cache: dict[tuple, list[int]] = {}

    def get(ids: list[int], n: int) -> list[int]:
        key = (tuple(ids), n)
        if key not in cache:
            cache[key] = method.generate(torch.tensor([ids]), n, torch.Generator().manual_seed(0)).tokens
        return cache[key]

    yield get
    method.close()


def _ids(served, text: str) -> list[int]:
    return served.tokenizer(text, add_special_tokens=False).input_ids


def _random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 1000, (int(length),), generator=g).tolist()
            for length in torch.randint(1, 24, (n,), generator=g)]


# ---------------------------------------------------------------------------------- equality with target_only
def test_completions_equal_target_only(specter_server, client, reference):
    _, served = specter_server
    for text in ("def fib(n):", "The quick brown fox", "import numpy as np\n"):
        want = reference(_ids(served, text), 20)
        out = client.completions.create(model=MODEL, prompt=text, max_tokens=20, temperature=0, extra_body=EXTRA)
        choice = out.choices[0]
        assert choice.model_extra["token_ids"] == want
        assert choice.text == served.tokenizer.decode(want, skip_special_tokens=True)
        assert choice.finish_reason == "length"
        assert out.usage.completion_tokens == 20 and out.usage.prompt_tokens == len(_ids(served, text))
        pieces, ids, reasons = [], [], []
        for chunk in client.completions.create(model=MODEL, prompt=text, max_tokens=20, temperature=0, stream=True,
                                               extra_body=EXTRA):
            pieces.append(chunk.choices[0].text)
            ids.extend(chunk.choices[0].model_extra["token_ids"])
            reasons.append(chunk.choices[0].finish_reason)
        assert ids == want and "".join(pieces) == choice.text
        assert reasons[-1] == "length" and set(reasons[:-1]) == {None}


def test_chat_equals_target_only(specter_server, client, reference):
    _, served = specter_server
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "add two numbers"}]
    want = reference(chat_prompt(served.tokenizer, [ChatMessage(**m) for m in messages]), 16)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, extra_body=EXTRA)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == served.tokenizer.decode(want, skip_special_tokens=True)
    assert out.choices[0].model_extra["token_ids"] == want
    text, ids = "", []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16,
                                                stream=True, extra_body=EXTRA):
        text += chunk.choices[0].delta.content or ""
        ids.extend(chunk.choices[0].model_extra.get("token_ids") or [])
    assert ids == want and text == out.choices[0].message.content


def test_32_concurrent_streams_each_equal_b1(specter_server, client, reference):
    """More requests than the tier's batch: the rest queue and join as rows free up (continuous batching)."""
    srv, served = specter_server
    prompts = _random_prompts(32, seed=1)
    lengths = [4 + (7 * i) % 21 for i in range(32)]  # 4..24 new tokens, mixed
    wants = [reference(p, n) for p, n in zip(prompts, lengths)]
    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], srv.loop.depth()[1])
            time.sleep(0.002)

    def one(i: int) -> list[int]:
        ids = []
        for chunk in client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=lengths[i], stream=True,
                                               extra_body=EXTRA):
            ids.extend(chunk.choices[0].model_extra["token_ids"])
        return ids

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(32) as pool:
            got = list(pool.map(one, range(32)))
    finally:
        stop.set()
        watcher.join()
    for i, (g, w) in enumerate(zip(got, wants)):
        assert g == w, f"request {i}: {g} != {w}"
    assert 1 < peak[0] <= served.max_batch  # decoded together, never beyond the budget's batch


def test_disconnect_mid_stream_frees_rows_and_spares_others(specter_server, client, reference):
    srv, served = specter_server
    long_prompt = _random_prompts(1, seed=5)[0]
    n_long = served.context_length - len(long_prompt)  # far longer than the test waits
    others = _random_prompts(4, seed=6)
    wants = [reference(p, 24) for p in others]
    got: list[list[int] | None] = [None] * len(others)

    def other(i: int) -> None:
        ids = []
        for chunk in client.completions.create(model=MODEL, prompt=others[i], max_tokens=24, stream=True,
                                               extra_body=EXTRA):
            ids.extend(chunk.choices[0].model_extra["token_ids"])
        got[i] = ids

    stream = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=n_long, stream=True,
                                       extra_body=EXTRA)
    threads = [threading.Thread(target=other, args=(i,)) for i in range(len(others))]
    for t in threads:
        t.start()
    received = 0
    for chunk in stream:
        received += len(chunk.choices[0].model_extra["token_ids"])
        if received >= 8:
            break
    stream.close()  # the client leaves mid-stream
    for t in threads:
        t.join(timeout=60)
    assert got == wants
    deadline = time.monotonic() + 10
    while srv.loop.depth() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.loop.depth() == (0, 0)  # the abandoned request's rows left the batch
    metrics = urllib.request.urlopen(srv.url + "/metrics").read().decode()
    assert 'reason="cancelled"' in metrics


def test_sampled_requests_follow_their_seed(specter_server, client):
    """A seeded sampled request is reproducible, and runs beside greedy ones (its own decoder)."""
    kw = dict(model=MODEL, prompt="def add(a, b):", max_tokens=12, temperature=0.8, top_p=0.9, extra_body=EXTRA)
    with ThreadPoolExecutor(3) as pool:
        a, b, g = pool.map(lambda k: client.completions.create(**k),
                           [{**kw, "seed": 7}, {**kw, "seed": 7}, {**kw, "temperature": 0}])
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
    assert len(g.choices[0].model_extra["token_ids"]) == 12


# ---------------------------------------------------------------------------------- bad input and faults
def _post(url: str, body: bytes | dict, path: str = "/v1/completions") -> tuple[int, object, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, resp.headers, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers, json.loads(err.read())


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": [5] * 4096, "max_tokens": 4}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "hi", "n": 2}, 400, "n"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
])
def test_bad_input_gets_openai_error_body(specter_server, body, status, param):
    srv, _ = specter_server
    code, _, err = _post(srv.url, body)
    assert code == status
    assert set(err) == {"error"} and err["error"]["message"] and err["error"]["type"]
    assert err["error"]["param"] == param
    assert "Traceback" not in err["error"]["message"]


def test_bad_input_through_the_client(specter_server, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    code, _, err = _post(specter_server[0].url, {"model": MODEL, "messages": []}, "/v1/chat/completions")
    assert code == 400 and err["error"]["param"] == "messages"


def test_full_queue_is_503_with_retry_after(specter_server, client):
    srv, served = specter_server
    loop = srv.loop
    saved = loop.max_batch, loop.max_queue
    loop.max_batch, loop.max_queue = 1, 0  # one row, no waiting room
    try:
        stream = client.completions.create(model=MODEL, prompt="x", max_tokens=served.context_length - 4,
                                           stream=True, extra_body=EXTRA)
        next(iter(stream))  # decoding: the one row is taken
        code, headers, err = _post(srv.url, {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert code == 503 and int(headers["Retry-After"]) >= 1
        assert err["error"]["code"] == "queue_full"
        stream.close()
    finally:
        loop.max_batch, loop.max_queue = saved
    deadline = time.monotonic() + 10
    while loop.depth() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].finish_reason


def test_models_health_metrics(specter_server, client):
    srv, served = specter_server
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = json.loads(urllib.request.urlopen(srv.url + "/health").read())
    assert health["status"] == "ok" and health["method"] == "specter" and health["max_batch"] == served.max_batch
    text = urllib.request.urlopen(srv.url + "/metrics").read().decode()
    for name in ("specter_requests_total", "specter_generation_tokens_total", "specter_tpot_seconds_bucket",
                 "specter_ttft_seconds_bucket", "specter_acceptance_ratio", "specter_h2d_bytes_total",
                 "specter_expert_cache_hit_rate", "specter_queue_waiting", "specter_queue_decoding"):
        assert name in text, name
    tokens = [line for line in text.splitlines() if line.startswith("specter_generation_tokens_total")]
    assert float(tokens[0].rsplit(" ", 1)[1]) > 0


def test_tier_batch_is_the_memory_plans_number(specter_server):
    from specter.assembly.sizing import refusal

    _, served = specter_server
    B = served.max_batch
    assert refusal(served.method, B) is None  # fits the low tier's budget
    assert B == 32 or refusal(served.method, B + 1) is not None  # and one more would not (or the cap)


# ---------------------------------------------------------------------------------- the loop without HTTP
def test_queue_bound_refuses_beyond_batch_plus_queue(specter_server):
    _, served = specter_server
    loop = ServingLoop(served.method, max_batch=2, max_queue=1)  # not started: nothing is admitted
    jobs = [Job([1, 2], 4, SamplingParams(), lambda ids, reason: None) for _ in range(4)]
    for job in jobs[:3]:
        loop.submit(job)
    with pytest.raises(QueueFull):
        loop.submit(jobs[3])


def test_batch_loop_cancel_between_steps(specter_server, reference):
    """BatchLoop.cancel: a cancelled active request leaves at once, the others finish with their own tokens."""
    _, served = specter_server
    engine = served.method.make_engine()
    prompts = _random_prompts(3, seed=9)
    reqs = [engine.submit(torch.tensor(p), 16) for p in prompts]
    engine.step()
    engine.step()
    assert engine.cancel(reqs[1]) and reqs[1] not in engine.active
    late = engine.submit(torch.tensor(prompts[1]), 16)
    assert engine.cancel(late) and not engine.queue  # a queued request never runs
    engine.run()
    assert reqs[0].tokens[:16] == reference(prompts[0], 16) and reqs[2].tokens[:16] == reference(prompts[2], 16)
    assert not engine.cancel(reqs[0])  # finished: nothing to cancel
    assert len(reqs[1].tokens) < 16 and late.tokens == []


# ---------------------------------------------------------------------------------- target_only serves too
def test_target_only_serves_the_same_tokens(specter_server, reference):
    _, spec = specter_server
    served = load(TARGET)
    try:
        with ThreadedServer(served) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
            prompts = _random_prompts(6, seed=3)
            with ThreadPoolExecutor(6) as pool:
                outs = list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=12,
                                                                         extra_body=EXTRA), prompts))
            for p, out in zip(prompts, outs):
                assert out.choices[0].model_extra["token_ids"] == reference(p, 12)
    finally:
        served.close()


# ---------------------------------------------------------------------------------- the command
def test_serve_command_binds_loopback_and_sigterm_drains(specter_server):
    """`specter serve` in its own process: SIGTERM lets an in-flight stream finish, then the process exits 0."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "specter.cli", "serve", *SPECTER, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
                time.sleep(0.2)
        n = specter_server[1].context_length - 8
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = client.completions.create(model=MODEL, prompt=[3, 4, 5], max_tokens=n, stream=True, extra_body=EXTRA)
        ids, reasons = [], []
        for chunk in stream:
            if not ids:
                proc.send_signal(signal.SIGTERM)  # mid-stream
            ids.extend(chunk.choices[0].model_extra["token_ids"])
            reasons.append(chunk.choices[0].finish_reason)
        assert len(ids) == n and reasons[-1] == "length"  # drained, not cut off
        assert proc.wait(timeout=60) == 0
        out = proc.stdout.read()
        assert f"http://127.0.0.1:{port}/v1" in out and "Traceback" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_engine_never_imports_the_http_layer():
    """The decoders and the harness know nothing of serving: no import of specter.serve, fastapi or uvicorn.
    The Python API (specter/api.py) drives the engine as `specter generate` does, through serve's method
    loading and request loop, but never the HTTP layer."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "specter"
    http = ("specter.serve.app", "specter.serve.server", "specter.serve.metrics", "fastapi", "uvicorn", "starlette")
    for path in root.rglob("*.py"):
        if path.is_relative_to(root / "serve") or path.name == "cli.py" and path.parent == root:
            continue
        banned = http if path == root / "api.py" else ("specter.serve", "specter.cli", *http)
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith(banned), f"{path} imports {name}"
