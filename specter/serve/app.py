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
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specter.serve.loop import ServingLoop
from specter.serve.metrics import ServeMetrics
from specter.serve.routes import CHECK_S, Routes, chat_prompt
from specter.serve.schema import ApiError, ChatBody, ChatMessage, CompletionBody, encodable, error_body

__all__ = ["CHECK_S", "MAX_BODY_BYTES", "ApiError", "BodyLimit", "ChatBody", "ChatMessage", "CompletionBody",
           "chat_prompt", "create_app", "encodable", "error_body"]


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
def create_app(engine: Any, loop: ServingLoop, metrics: ServeMetrics, drain_timeout_s: float = 600.0) -> FastAPI:
    """The app over `engine` (a `specter.api.Engine`, or the `Served` it wraps) decoded by `loop`."""
    routes = Routes(engine, loop, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        yield
        await asyncio.to_thread(loop.drain, drain_timeout_s)  # SIGTERM: uvicorn stops accepting, we finish

    app = FastAPI(title="Specter", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES, metrics=metrics)
    app.add_exception_handler(ApiError, routes.on_api_error)
    app.add_exception_handler(RequestValidationError, routes.on_invalid)
    app.add_exception_handler(StarletteHTTPException, routes.on_http_error)
    app.add_exception_handler(Exception, routes.on_unexpected)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat_completions)
    app.get("/v1/models")(routes.models)
    app.get("/health")(routes.health)
    app.get("/metrics")(routes.prometheus)
    return app
