"""The HTTP layer's handlers: each route and error handler of the app, over one loaded engine and the
`ServingLoop` that decodes its requests (specter/serve/app.py wires them into a FastAPI app)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specter.api import TextStream, sampling_params
from specter.serve.loop import Job, QueueFull, ServingLoop
from specter.serve.metrics import CONTENT_TYPE, ServeMetrics
from specter.serve.schema import (ApiError, ChatBody, ChatMessage, CompletionBody, SamplingBody, error_body,
                                  unhonoured)
from specter.speculative.sampling import SamplingParams

CHECK_S = 0.5  # how often a request's connection is checked while it decodes


def chat_prompt(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    """The tokenizer's chat template, or a plain "role: text" transcript ending in "assistant:"."""
    turns = [{"role": m.role, "content": m.text()} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    text = "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"
    return tokenizer(text, add_special_tokens=False).input_ids


def finish_reason(reason: str) -> str:
    if reason == "error":
        raise ApiError(500, "the engine failed while decoding this request", kind="server_error")
    return "stop" if reason == "stop" else "length"


def usage(prompt: list[int], n: int) -> dict[str, int]:
    return {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}


@dataclass(frozen=True)
class Reply:
    """What every body or chunk of one response repeats: its id, object type, creation time and model."""

    chat: bool
    model: str
    token_ids: bool  # the request's return_token_ids
    id: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str, token_ids: bool) -> Reply:
        return cls(chat, model, token_ids, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()))

    @property
    def kind(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def whole(self, ids: list[int], text: str, reason: str, prompt: list[int]) -> dict[str, Any]:
        """The non-streaming body."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(reason), "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
        if self.token_ids:
            choice["token_ids"] = ids
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage(prompt, len(ids))}

    def chunk(self, ids: list[int], text: str, reason: str | None, role: bool = False) -> str:
        """One server-sent event; a chat stream's first one carries only the role."""
        c: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text or not role:
                delta["content"] = text
            c["delta"] = delta
        else:
            c["text"] = text
        if self.token_ids:
            c["token_ids"] = ids
        obj = {"id": self.id, "object": f"{self.kind}.chunk" if self.chat else self.kind, "created": self.created,
               "model": self.model, "choices": [c]}
        return f"data: {json.dumps(obj)}\n\n"


class Routes:
    """The app's handlers around one loaded engine (a `specter.api.Engine`, or the `Served` it wraps: the
    same name, tokenizer, cfg, context_length and method), its serving loop and its metrics."""

    def __init__(self, engine: Any, loop: ServingLoop, metrics: ServeMetrics):
        self.engine, self.loop, self.metrics = engine, loop, metrics
        self.tokenizer, self.model_name = engine.tokenizer, engine.name
        cfg = engine.cfg
        # the configured values: a request without temperature or top_p takes them (sampling_params decides)
        self.temperature, self.top_p, self.top_k = float(cfg.temperature), float(cfg.top_p), int(cfg.top_k)
        self.eos = {t for t in [getattr(self.tokenizer, "eos_token_id", None)] if t is not None}
        self.seeds = iter(range(int(cfg.seed), 2**62))  # a request without a seed takes the next one

    # -- errors ------------------------------------------------------------------------------
    def fail(self, err: ApiError) -> JSONResponse:
        self.metrics.request(err.status)
        return JSONResponse(error_body(err.message, err.kind, err.param, err.code), status_code=err.status,
                            headers=err.headers)

    async def on_api_error(self, request: Request, err: ApiError):
        return self.fail(err)

    async def on_invalid(self, request: Request, err: RequestValidationError):
        ctype = request.headers.get("content-type", "")
        if ctype.split(";")[0].strip().lower() != "application/json":  # FastAPI reads no other body as JSON
            return self.fail(ApiError(400, f"the request body must be JSON sent with Content-Type: application/json "
                                           f"(got {ctype or 'no Content-Type'!r})", code="unsupported_content_type"))
        first = err.errors()[0] if err.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        what = first.get("msg", "invalid request body")
        if first.get("type") == "json_invalid":
            return self.fail(ApiError(400, "the request body is not valid JSON"))
        return self.fail(ApiError(400, f"{'.'.join(loc) or 'body'}: {what}", ".".join(loc) or None))

    async def on_http_error(self, request: Request, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        if err.status_code == 400 and "parsing the body" in str(err.detail):  # e.g. bytes that are not UTF-8
            return self.fail(ApiError(400, "the request body cannot be read as JSON (it must be UTF-8 JSON text)"))
        # the exception's headers too: a 405 carries Allow, which RFC 9110 requires
        return self.fail(ApiError(err.status_code, str(err.detail), kind=kind, headers=dict(err.headers or {})))

    async def on_unexpected(self, request: Request, err: Exception):
        return self.fail(ApiError(500, f"internal error: {type(err).__name__}: {err}".splitlines()[0],
                                  kind="server_error"))

    # -- checks ------------------------------------------------------------------------------
    def check(self, body: SamplingBody, prompt: list[int], max_tokens: int | None,
              default_max: int) -> tuple[int, SamplingParams]:
        """(tokens to decode, sampling) of a request, or the ApiError that refuses it."""
        if body.model != self.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")
        refused = unhonoured(body)  # one rule for the OpenAI fields this server does not honour (schema.py)
        if refused is not None:
            raise refused
        ctx = self.engine.context_length
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
        temperature = self.temperature if body.temperature is None else body.temperature
        top_p = self.top_p if body.top_p is None else body.top_p
        try:
            params = sampling_params(temperature, top_p, self.top_k)  # one range (specter/api.py)
        except ValueError as err:
            raise ApiError(400, str(err), "temperature" if "temperature" in str(err) else "top_p") from None
        return n, params

    def tokens_of(self, body: CompletionBody) -> list[int]:
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise ApiError(400, "one prompt per request is supported", "prompt")
            p = p[0]
        if isinstance(p, str):
            try:
                return self.tokenizer(p, add_special_tokens=False).input_ids
            except (TypeError, ValueError) as err:
                raise ApiError(400, f"the prompt cannot be tokenized: {err}".splitlines()[0], "prompt") from None
        vocab = len(self.tokenizer)
        if any(t < 0 or t >= vocab for t in p):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(p)

    # -- one generation ----------------------------------------------------------------------
    def submit(self, body: SamplingBody, prompt: list[int], n: int,
               params: SamplingParams) -> tuple[Job, asyncio.Queue]:
        """Queue the job (503 when the queue is full); its tokens arrive on the returned queue."""
        events: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()

        def emit(ids: list[int], reason: str | None) -> None:  # engine thread
            try:
                aloop.call_soon_threadsafe(events.put_nowait, (ids, reason))
            except RuntimeError:  # the event loop is gone (server stopped)
                pass

        seed = body.seed if body.seed is not None else next(self.seeds)
        job = Job(prompt, n, params, emit, seed=seed, stop_ids=frozenset() if body.ignore_eos else frozenset(self.eos))
        try:
            self.loop.submit(job)
        except QueueFull as err:
            raise ApiError(503, str(err), kind="server_error", code="queue_full",
                           headers={"Retry-After": str(err.retry_after)}) from None
        self.metrics.prompt(len(prompt))
        return job, events

    @staticmethod
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

    def abandon(self, job: Job) -> None:
        """Synchronous on purpose: it runs in a cancelled task's `finally`, where no await completes."""
        if job.finish is None:
            self.loop.cancel(job)

    async def respond(self, body: SamplingBody, prompt: list[int], n: int, params: SamplingParams, request: Request,
                      chat: bool) -> Response:
        reply = Reply.new(chat, self.model_name, body.return_token_ids)
        job, queue = self.submit(body, prompt, n, params)
        if not body.stream:
            return await self.whole(reply, job, queue, request, prompt)
        self.metrics.request(200)
        return StreamingResponse(self.events(reply, job, queue, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def whole(self, reply: Reply, job: Job, queue: asyncio.Queue, request: Request,
                    prompt: list[int]) -> Response:
        """The whole output in one body, once the job has finished (499 when the client left first)."""
        ids, reason = [], "length"
        try:
            while True:
                got = await self.pull(job, queue, request)
                if got is None:
                    return Response(status_code=499)  # nobody is listening
                ids.extend(got[0])
                if got[1] is not None:
                    reason = got[1]
                    break
        finally:
            self.abandon(job)
        body = reply.whole(ids, self.tokenizer.decode(ids, skip_special_tokens=True), reason, prompt)
        self.metrics.request(200)
        return JSONResponse(body)

    async def events(self, reply: Reply, job: Job, queue: asyncio.Queue, request: Request) -> AsyncIterator[str]:
        """The output as server-sent events: text as each window commits, then the finish reason and [DONE]."""
        text = TextStream(self.tokenizer)
        try:
            if reply.chat:
                yield reply.chunk([], "", None, role=True)
            while True:
                got = await self.pull(job, queue, request)
                if got is None:
                    return
                ids, reason = got
                if reason == "error":
                    yield f"data: {json.dumps(error_body('the engine failed while decoding', 'server_error'))}\n\n"
                    return
                delta = text.push(ids, final=reason is not None)
                if ids or delta:
                    yield reply.chunk(ids, delta, None)
                if reason is not None:
                    yield reply.chunk([], "", finish_reason(reason))
                    yield "data: [DONE]\n\n"
                    return
        finally:
            self.abandon(job)  # a disconnect: the job's rows leave the batch at the next window

    # -- endpoints ---------------------------------------------------------------------------
    async def completions(self, body: CompletionBody, request: Request):
        prompt = await asyncio.to_thread(self.tokens_of, body)  # a long prompt never holds up /health
        n, params = self.check(body, prompt, body.max_tokens, 16)  # the OpenAI API's default max_tokens
        return await self.respond(body, prompt, n, params, request, chat=False)

    async def chat_completions(self, body: ChatBody, request: Request):
        prompt = await asyncio.to_thread(chat_prompt, self.tokenizer, body.messages)
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        default_max = max(1, min(int(self.engine.cfg.max_new_tokens), self.engine.context_length - len(prompt)))
        n, params = self.check(body, prompt, limit, default_max)
        return await self.respond(body, prompt, n, params, request, chat=True)

    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                             "owned_by": "specter", "max_model_len": self.engine.context_length}]}

    async def health(self):
        """The engine thread's liveness, not only the HTTP layer's: 503 once the engine has stopped."""
        waiting, decoding = self.loop.depth()
        body = {"status": "ok", "model": self.model_name, "method": self.engine.method.name, "waiting": waiting,
                "decoding": decoding, "max_batch": self.loop.max_batch}
        if not self.loop.alive:
            body.update(status="engine stopped", error=self.loop.failure)
            return JSONResponse(body, status_code=503)
        return body

    async def prometheus(self):
        waiting, decoding = self.loop.depth()
        self.metrics.depth(waiting, decoding)
        return Response(self.metrics.text(), media_type=CONTENT_TYPE)
