"""The HTTP layer's limits on what one connection may hold: a body's size (413), and the time a client may
take to send its headers and its body (specter/serve/server.py sets the header and idle timeouts)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from specter.serve.metrics import ServeMetrics
from specter.serve.schema import error_body


# ---------------------------------------------------------------------------------- limits
MAX_BODY_BYTES = 4 * 2**20  # far above any prompt a context of 32k tokens holds, as text or as token ids
DRAIN_BYTES = 64 * 2**20  # an oversized body is read (and dropped) up to here before the 413
BODY_TIMEOUT_S = 30.0  # a whole body (4 MiB at most) arrives well within this on any working link


class Shutdown:
    """The server's shutdown, shared by its HTTP protocol, the body reader and the app's lifespan:
    when it began (SIGTERM, Ctrl-C), how much of the drain timeout is left, and the event on which
    whatever waits for a client gives up."""

    def __init__(self, drain_timeout_s: float):
        self.drain_timeout_s = drain_timeout_s
        self.began: float | None = None
        self._event: asyncio.Event | None = None  # made on the server's event loop, at first use

    def event(self) -> asyncio.Event:
        if self._event is None:
            self._event = asyncio.Event()
        return self._event

    def begin(self) -> None:  # on the server's event loop
        if self.began is None:
            self.began = time.monotonic()
        self.event().set()

    def left_s(self) -> float:
        """Seconds of the drain timeout still to spend (all of it before the shutdown begins)."""
        spent = 0.0 if self.began is None else time.monotonic() - self.began
        return max(0.0, self.drain_timeout_s - spent)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413, counted as it arrives
    (Content-Length or chunked) and never held in memory, parsed or tokenized. A body that has not
    arrived whole `timeout_s` after its headers is answered 408, and one still arriving when the
    server starts to shut down 503: either way the connection closes, so a client that sends a body
    slowly, or half of one and then nothing, holds neither a connection nor the shutdown."""

    def __init__(self, app: Any, limit: int, metrics: ServeMetrics, timeout_s: float = BODY_TIMEOUT_S,
                 shutdown: Shutdown | None = None):
        self.app, self.limit, self.metrics, self.timeout_s = app, limit, metrics, timeout_s
        self.shutdown = shutdown or Shutdown(0.0)

    async def _refuse(self, send: Any, status: int, message: str, code: str, kind: str = "invalid_request_error",
                      headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        self.metrics.request(status)
        body = json.dumps(error_body(message, kind, code=code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close"), *headers]})
        await send({"type": "http.response.body", "body": body})

    async def _next(self, receive: Any, deadline: float) -> dict | str:
        """The next ASGI message, or "late" past the deadline, or "stopping" once the server shuts down."""
        stopping = self.shutdown.event()
        if stopping.is_set():
            return "stopping"
        get, stop = asyncio.ensure_future(receive()), asyncio.ensure_future(stopping.wait())
        try:
            done, _ = await asyncio.wait({get, stop}, timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if get in done:
            return get.result()
        get.cancel()
        return "stopping" if stop in done else "late"

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        deadline = time.monotonic() + self.timeout_s
        chunks, size = [], 0
        while True:
            message = await self._next(receive, deadline)
            if message == "late":
                return await self._refuse(send, 408, f"the request body did not arrive within {self.timeout_s:g} s "
                                                     "of its headers", "request_timeout")
            if message == "stopping":
                return await self._refuse(send, 503, "the server is shutting down", "shutting_down", "server_error",
                                          ((b"retry-after", b"5"),))
            if message["type"] != "http.request":  # the client left before its body arrived
                return
            size += len(message.get("body", b""))
            if size <= self.limit:
                chunks.append(message.get("body", b""))
            elif size > DRAIN_BYTES:  # read no further: answer and close
                return await self._refuse(send, 413, f"the request body exceeds {self.limit} bytes",
                                          "request_too_large")
            if not message.get("more_body"):
                break
        if size > self.limit:  # the rest was read and dropped, so the client sees the 413, not a reset
            return await self._refuse(send, 413, f"the request body exceeds {self.limit} bytes", "request_too_large")
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later reads: disconnect notices

        await self.app(scope, replay, send)
