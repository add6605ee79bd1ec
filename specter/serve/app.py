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
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specter.serve.limits import BODY_TIMEOUT_S, MAX_BODY_BYTES, BodyLimit, Shutdown
from specter.serve.loop import ServingLoop
from specter.serve.metrics import ServeMetrics
from specter.serve.openapi import truthful_openapi
from specter.serve.routes import CHECK_S, Routes, chat_prompt
from specter.serve.schema import ApiError, ChatBody, ChatMessage, CompletionBody, encodable, error_body

__all__ = ["CHECK_S", "MAX_BODY_BYTES", "ApiError", "BodyLimit", "ChatBody", "ChatMessage", "CompletionBody",
           "chat_prompt", "create_app", "encodable", "error_body"]


# ---------------------------------------------------------------------------------- the app
def create_app(engine: Any, loop: ServingLoop, metrics: ServeMetrics, drain_timeout_s: float = 600.0,
               shutdown: Shutdown | None = None, body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
    """The app over `engine` (a `specter.api.Engine`, or the `Served` it wraps) decoded by `loop`;
    `shutdown` is the server's (specter/serve/server.py), so the drain shares one timeout with it."""
    routes = Routes(engine, loop, metrics)
    shutdown = shutdown or Shutdown(drain_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        yield
        # SIGTERM: uvicorn stopped accepting and waited for in-flight requests; what is left of the one
        # drain timeout finishes the engine's queue
        await asyncio.to_thread(loop.drain, shutdown.left_s())

    app = FastAPI(title="Specter", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES, metrics=metrics, timeout_s=body_timeout_s, shutdown=shutdown)
    app.add_exception_handler(ApiError, routes.on_api_error)
    app.add_exception_handler(RequestValidationError, routes.on_invalid)
    app.add_exception_handler(StarletteHTTPException, routes.on_http_error)
    app.add_exception_handler(Exception, routes.on_unexpected)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat_completions)
    app.get("/v1/models")(routes.models)
    app.get("/health")(routes.health)
    app.get("/metrics")(routes.prometheus)
    app.openapi = lambda: truthful_openapi(app)  # the responses the routes really give (serve/openapi.py)
    return app
