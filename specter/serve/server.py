"""Running the app: uvicorn in the foreground (`specter serve`, SIGTERM drains), or in a thread on a
loopback socket of the caller's (tests and the load benchmark)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from specter.serve.app import create_app, error_body
from specter.serve.limits import BODY_TIMEOUT_S, Shutdown
from specter.serve.loop import ServingLoop
from specter.serve.metrics import ServeMetrics

if TYPE_CHECKING:
    from specter.api import Engine


HEADER_TIMEOUT_S = 10.0  # a client has this long after connecting (or after its last response) to send its headers
KEEP_ALIVE_S = 5  # an idle keep-alive connection closes after this (uvicorn's timeout_keep_alive)
MAX_CONNECTIONS = 256  # open connections; one more is answered 503 at once and closed


class JsonErrorProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type] - h11's or httptools' protocol
    """uvicorn's HTTP protocol with the server's connection limits, every refusal in the app's JSON error shape:
    its own 400 (a request it cannot parse: a garbled request line, a bad Content-Length); 408 when the
    headers of a request have not arrived `header_timeout_s` after the connection opened or its last
    response ended (uvicorn's keep-alive timer stops at the first byte, so a client dripping a header
    would otherwise hold the connection for ever); 503 for a connection beyond `max_connections`."""

    header_timeout_s = HEADER_TIMEOUT_S
    max_connections = MAX_CONNECTIONS
    _header_timer: asyncio.TimerHandle | None = None

    def _refuse(self, status: bytes, message: str, kind: str, code: str, extra: bytes = b"") -> None:
        body = json.dumps(error_body(message, kind, code=code)).encode()
        self.transport.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\nconnection: close\r\n" + extra + b"\r\n" + body)
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self._refuse(b"400 Bad Request", f"the request is not valid HTTP/1.1 ({msg.rstrip('.')})",
                     "invalid_request_error", "invalid_http")

    def connection_made(self, transport) -> None:  # noqa: ANN001 - asyncio's signature
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse(b"503 Service Unavailable", f"the server holds its limit of {self.max_connections} "
                         "connections; retry later", "server_error", "too_many_connections", b"retry-after: 1\r\n")
            return
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        before = self.cycle
        super().on_response_complete()
        if self.cycle is before:  # no pipelined request began: the connection waits for headers again
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        if self.transport.is_closing():
            return
        waiting_after = self.cycle  # None, or the request whose response just ended

        def late() -> None:
            if self.cycle is waiting_after and not self.transport.is_closing():
                self._refuse(b"408 Request Timeout", f"no complete request headers within {self.header_timeout_s:g} s",
                             "invalid_request_error", "request_timeout")

        self._header_timer = self.loop.call_later(self.header_timeout_s, late)


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown first tells the app (its body reader and lifespan) that it began."""

    def __init__(self, config: uvicorn.Config, shutdown: Shutdown):
        super().__init__(config)
        self.shutdown_state = shutdown

    async def shutdown(self, sockets=None) -> None:  # noqa: ANN001 - uvicorn's signature
        self.shutdown_state.begin()
        await super().shutdown(sockets)


@dataclass
class ServerParts:
    loop: ServingLoop
    metrics: ServeMetrics
    server: uvicorn.Server


def make_server(engine: Engine, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 64,
                drain_timeout_s: float = 600.0, log_level: str = "warning", header_timeout_s: float = HEADER_TIMEOUT_S,
                body_timeout_s: float = BODY_TIMEOUT_S, keep_alive_s: int = KEEP_ALIVE_S,
                max_connections: int = MAX_CONNECTIONS) -> ServerParts:
    """The server of `engine` (a `specter.api.Engine`, or the `specter.api.Served` it wraps: the same
    name, method, max_batch, tokenizer, cfg and context_length); closing the engine stays the caller's.
    SIGTERM ends within `drain_timeout_s` in all: uvicorn's wait for in-flight requests and the engine's
    drain share it, and a client still sending its headers or body is refused at once."""
    metrics = ServeMetrics(engine.name, engine.method.name)
    loop = ServingLoop(engine.method, engine.max_batch, max_queue, metrics)
    shutdown = Shutdown(drain_timeout_s)
    app = create_app(engine, loop, metrics, drain_timeout_s, shutdown=shutdown, body_timeout_s=body_timeout_s)
    protocol = type("SpecterHTTPProtocol", (JsonErrorProtocol,),
                    {"header_timeout_s": header_timeout_s, "max_connections": max_connections})
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=drain_timeout_s, timeout_keep_alive=keep_alive_s, http=protocol)
    server = DrainingServer(config, shutdown)

    def engine_died() -> None:  # a server whose engine has stopped answers nothing: it exits (non-zero)
        server.should_exit = True

    loop.on_death = engine_died
    return ServerParts(loop, metrics, server)


LOOPBACK = ("127.0.0.1", "::1", "localhost")


def is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host in LOOPBACK


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket on (host, port), bound before the model loads: an address that cannot
    be used is one clear error (OSError with the reason) instead of a failure after minutes of loading."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise OSError(f"--host {host!r} is not an address of this machine ({err.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    sock.set_inheritable(True)
    return sock


class ThreadedServer:
    """The server on a free loopback port, in a daemon thread: ``with ThreadedServer(engine) as s: s.url``."""

    def __init__(self, engine: Engine, max_queue: int = 64, drain_timeout_s: float = 60.0, **limits: float):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.parts = make_server(engine, port=self.port, max_queue=max_queue, drain_timeout_s=drain_timeout_s,
                                 **limits)  # header_timeout_s, body_timeout_s, keep_alive_s, max_connections
        self.thread = threading.Thread(target=self.parts.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="specter-http")

    @property
    def loop(self) -> ServingLoop:
        return self.parts.loop

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.parts.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.parts.server.should_exit = True
        self.thread.join(timeout=60)
        self.sock.close()
