"""The HTTP layer: OpenAI-compatible completions and chat completions over a `ServingLoop`.

    POST /v1/completions, /v1/chat/completions   JSON, or server-sent events with "stream": true
    GET  /v1/models, /health, /metrics            (Prometheus text format)

Every refusal is an OpenAI-style error body ``{"error": {"message", "type", "param", "code"}}``:
400 for a malformed body or an impossible setting, 404 for an unknown model, 413 for a body over
MAX_BODY_BYTES, 503 with Retry-After for a full queue or a stopped engine; an unexpected failure
is a 500 with one line, never a traceback. Requests are checked here against the bounds run.py
uses (a seed in [0, 2**31), finite temperature and top_p, text that encodes as UTF-8), so no
value a client can send reaches the engine thread unchecked.
Extensions (as vLLM names them): ``ignore_eos`` decodes past EOS, ``return_token_ids`` adds each
choice's token ids.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from specter.assembly.config import SEED_LIMIT
from specter.serve.build import Served
from specter.serve.loop import Job, QueueFull, ServingLoop
from specter.serve.metrics import CONTENT_TYPE, ServeMetrics
from specter.serve.text import TextStream
from specter.speculative.sampling import SamplingParams


CHECK_S = 0.5  # how often a request's connection is checked while it decodes


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---------------------------------------------------------------------------------- request bodies
class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields of the OpenAI API this server does not use

    model: str
    max_tokens: int | None = None
    # NaN and ±Infinity are refused here (Python's JSON reader accepts them), as run.py refuses them
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)  # the per-record seeds' range (assembly/config.py)
    stream: bool = False
    n: int = 1
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False


def encodable(text: str) -> str:
    """`text` that encodes as UTF-8: a lone surrogate ("\\ud800" in JSON) is refused, not tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"the text is not valid Unicode (a lone surrogate at character {err.start})") from None
    return text


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int]

    @field_validator("prompt")
    @classmethod
    def _encodes(cls, v):
        for text in [v] if isinstance(v, str) else v:
            if isinstance(text, str):
                encodable(text)
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _encodes(cls, v):
        if isinstance(v, str):
            encodable(v)
        return v

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text parts are supported
            parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content) or not all(isinstance(t, str) for t in parts):
                raise ApiError(400, "only text content parts are supported", "messages")
            try:
                return encodable("".join(parts))
            except ValueError as err:
                raise ApiError(400, f"messages: {err}", "messages") from None
        return self.content or ""


class ChatBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


# ---------------------------------------------------------------------------------- body size
MAX_BODY_BYTES = 4 * 2**20  # far above any prompt a context of 32k tokens holds, as text or as token ids
DRAIN_BYTES = 64 * 2**20  # an oversized body is read (and dropped) up to here before the 413


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413, counted as it arrives
    (Content-Length or chunked) and never held in memory, parsed or tokenized."""

    def __init__(self, app: Any, limit: int, metrics: ServeMetrics):
        self.app, self.limit, self.metrics = app, limit, metrics

    async def _refuse(self, send: Any) -> None:
        self.metrics.request(413)
        body = json.dumps(error_body(f"the request body exceeds {self.limit} bytes", "invalid_request_error",
                                     code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body arrived
                return
            size += len(message.get("body", b""))
            if size <= self.limit:
                chunks.append(message.get("body", b""))
            elif size > DRAIN_BYTES:  # read no further: answer and close
                return await self._refuse(send)
            if not message.get("more_body"):
                break
        if size > self.limit:  # the rest was read and dropped, so the client sees the 413, not a reset
            return await self._refuse(send)
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later reads: disconnect notices

        await self.app(scope, replay, send)


# ---------------------------------------------------------------------------------- the app
def chat_prompt(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    """The tokenizer's chat template, or a plain "role: text" transcript ending in "assistant:"."""
    turns = [{"role": m.role, "content": m.text()} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    text = "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"
    return tokenizer(text, add_special_tokens=False).input_ids


def create_app(served: Served, loop: ServingLoop, metrics: ServeMetrics, drain_timeout_s: float = 600.0) -> FastAPI:
    tokenizer, model_name = served.tokenizer, served.name
    cfg = served.cfg
    default = SamplingParams(float(cfg.temperature), float(cfg.top_p), int(cfg.top_k))
    eos = {t for t in [getattr(tokenizer, "eos_token_id", None)] if t is not None}
    seeds = iter(range(int(cfg.seed), 2**62))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        yield
        await asyncio.to_thread(loop.drain, drain_timeout_s)  # SIGTERM: uvicorn stops accepting, we finish

    app = FastAPI(title="Specter", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES, metrics=metrics)

    def fail(err: ApiError) -> JSONResponse:
        metrics.request(err.status)
        return JSONResponse(error_body(err.message, err.kind, err.param, err.code), status_code=err.status,
                            headers=err.headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        return fail(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        ctype = request.headers.get("content-type", "")
        if ctype.split(";")[0].strip().lower() != "application/json":  # FastAPI reads no other body as JSON
            return fail(ApiError(400, f"the request body must be JSON sent with Content-Type: application/json "
                                      f"(got {ctype or 'no Content-Type'!r})", code="unsupported_content_type"))
        first = err.errors()[0] if err.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        what = first.get("msg", "invalid request body")
        if first.get("type") == "json_invalid":
            return fail(ApiError(400, "the request body is not valid JSON"))
        return fail(ApiError(400, f"{'.'.join(loc) or 'body'}: {what}", ".".join(loc) or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        if err.status_code == 400 and "parsing the body" in str(err.detail):  # e.g. bytes that are not UTF-8
            return fail(ApiError(400, "the request body cannot be read as JSON (it must be UTF-8 JSON text)"))
        return fail(ApiError(err.status_code, str(err.detail), kind=kind))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        return fail(ApiError(500, f"internal error: {type(err).__name__}: {err}".splitlines()[0], kind="server_error"))

    # -- checks ------------------------------------------------------------------------------
    def check(body: _Sampling, prompt: list[int], max_tokens: int | None, default_max: int) -> tuple[int, SamplingParams]:
        if body.model != model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                           "model", "model_not_found")
        if body.n != 1:
            raise ApiError(400, "only n=1 is supported", "n")
        if body.stop:
            raise ApiError(400, "stop sequences are not supported; the request ends at EOS or max_tokens", "stop")
        ctx = served.context_length
        if not prompt:
            raise ApiError(400, "the prompt has no tokens", "prompt")
        if len(prompt) >= ctx:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; this model's context is {ctx} tokens",
                           "prompt", "context_length_exceeded")
        n = default_max if max_tokens is None else max_tokens
        if n < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {n}", "max_tokens")
        if len(prompt) + n > ctx:
            raise ApiError(400, f"max_tokens={n} with a {len(prompt)}-token prompt exceeds this model's context "
                                f"of {ctx} tokens", "max_tokens", "context_length_exceeded")
        temperature = default.temperature if body.temperature is None else body.temperature
        top_p = default.top_p if body.top_p is None else body.top_p
        try:
            params = SamplingParams(temperature, top_p, default.top_k if temperature > 0 else 0)
        except ValueError as err:
            raise ApiError(400, str(err), "temperature" if "temperature" in str(err) else "top_p") from None
        return n, params

    def tokens_of(body: CompletionBody) -> list[int]:
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise ApiError(400, "one prompt per request is supported", "prompt")
            p = p[0]
        if isinstance(p, str):
            try:
                return tokenizer(p, add_special_tokens=False).input_ids
            except (TypeError, ValueError) as err:
                raise ApiError(400, f"the prompt cannot be tokenized: {err}".splitlines()[0], "prompt") from None
        vocab = len(tokenizer)
        if any(t < 0 or t >= vocab for t in p):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(p)

    # -- one generation ----------------------------------------------------------------------
    def submit(body: _Sampling, prompt: list[int], n: int, params: SamplingParams) -> tuple[Job, asyncio.Queue]:
        """Queue the job (503 when the queue is full); its tokens arrive on the returned queue."""
        events: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()

        def emit(ids: list[int], reason: str | None) -> None:  # engine thread
            try:
                aloop.call_soon_threadsafe(events.put_nowait, (ids, reason))
            except RuntimeError:  # the event loop is gone (server stopped)
                pass

        seed = body.seed if body.seed is not None else next(seeds)
        job = Job(prompt, n, params, emit, seed=seed, stop_ids=frozenset() if body.ignore_eos else frozenset(eos))
        try:
            loop.submit(job)
        except QueueFull as err:
            raise ApiError(503, str(err), kind="server_error", code="queue_full",
                           headers={"Retry-After": str(err.retry_after)}) from None
        metrics.prompt(len(prompt))
        return job, events

    async def pull(job: Job, events: asyncio.Queue, request: Request) -> tuple[list[int], str | None] | None:
        """The job's next (tokens, finish reason); None when the client has gone. The connection is
        checked at least every `CHECK_S`, also while tokens keep coming (a non-streaming client
        that leaves must not keep its request decoding to the end)."""
        state = request.state  # the time of the next check lives as long as the request, across calls
        if not hasattr(state, "check_at"):
            state.check_at = time.monotonic() + CHECK_S
        while True:
            try:
                got = await asyncio.wait_for(events.get(), timeout=max(0.0, state.check_at - time.monotonic()))
            except TimeoutError:
                got = None
            if time.monotonic() >= state.check_at:
                if await request.is_disconnected():
                    return None
                state.check_at = time.monotonic() + CHECK_S
            if got is not None:
                return got

    def abandon(job: Job) -> None:
        """Synchronous on purpose: it runs in a cancelled task's `finally`, where no await completes."""
        if job.finish is None:
            loop.cancel(job)

    def finish_reason(reason: str) -> str:
        if reason == "error":
            raise ApiError(500, "the engine failed while decoding this request", kind="server_error")
        return "stop" if reason == "stop" else "length"

    def usage(prompt: list[int], n: int) -> dict[str, int]:
        return {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}

    async def respond(body: _Sampling, prompt: list[int], n: int, params: SamplingParams, request: Request,
                      chat: bool) -> Response:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        job, queue = submit(body, prompt, n, params)
        if not body.stream:
            ids, reason = [], "length"
            try:
                while True:
                    got = await pull(job, queue, request)
                    if got is None:
                        return Response(status_code=499)  # nobody is listening
                    ids.extend(got[0])
                    if got[1] is not None:
                        reason = got[1]
                        break
            finally:
                abandon(job)
            text = tokenizer.decode(ids, skip_special_tokens=True)
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(reason), "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            if body.return_token_ids:
                choice["token_ids"] = ids
            metrics.request(200)
            return JSONResponse({"id": rid, "object": kind, "created": created, "model": model_name,
                                 "choices": [choice], "usage": usage(prompt, len(ids))})
        metrics.request(200)

        def chunk(ids: list[int], text: str, reason: str | None, role: bool = False) -> str:
            c: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text or not role:
                    delta["content"] = text
                c["delta"] = delta
            else:
                c["text"] = text
            if body.return_token_ids:
                c["token_ids"] = ids
            obj = {"id": rid, "object": f"{kind}.chunk" if chat else kind, "created": created, "model": model_name,
                   "choices": [c]}
            return f"data: {json.dumps(obj)}\n\n"

        async def events() -> AsyncIterator[str]:
            text = TextStream(tokenizer)
            try:
                if chat:
                    yield chunk([], "", None, role=True)
                while True:
                    got = await pull(job, queue, request)
                    if got is None:
                        return
                    ids, reason = got
                    if reason == "error":
                        yield f"data: {json.dumps(error_body('the engine failed while decoding', 'server_error'))}\n\n"
                        return
                    delta = text.push(ids, final=reason is not None)
                    if ids or delta:
                        yield chunk(ids, delta, None)
                    if reason is not None:
                        yield chunk([], "", finish_reason(reason))
                        yield "data: [DONE]\n\n"
                        return
            finally:
                abandon(job)  # a disconnect: the job's rows leave the batch at the next window

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- endpoints ---------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        prompt = await asyncio.to_thread(tokens_of, body)  # a long prompt never holds up /health
        n, params = check(body, prompt, body.max_tokens, 16)  # the OpenAI API's default max_tokens
        return await respond(body, prompt, n, params, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        prompt = await asyncio.to_thread(chat_prompt, tokenizer, body.messages)
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        default_max = max(1, min(int(cfg.max_new_tokens), served.context_length - len(prompt)))
        n, params = check(body, prompt, limit, default_max)
        return await respond(body, prompt, n, params, request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "specter",
                                             "max_model_len": served.context_length}]}

    @app.get("/health")
    async def health():
        """The engine thread's liveness, not only the HTTP layer's: 503 once the engine has stopped."""
        waiting, decoding = loop.depth()
        body = {"status": "ok", "model": model_name, "method": served.method.name, "waiting": waiting,
                "decoding": decoding, "max_batch": loop.max_batch}
        if not loop.alive:
            body.update(status="engine stopped", error=loop.failure)
            return JSONResponse(body, status_code=503)
        return body

    @app.get("/metrics")
    async def prometheus():
        waiting, decoding = loop.depth()
        metrics.depth(waiting, decoding)
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    return app
