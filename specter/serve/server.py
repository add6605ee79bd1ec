"""Running the app: uvicorn in the foreground (`specter serve`, SIGTERM drains), or in a thread on a
loopback socket of the caller's (tests and the load benchmark)."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from specter.serve.app import create_app, error_body
from specter.serve.loop import ServingLoop
from specter.serve.metrics import ServeMetrics

if TYPE_CHECKING:
    from specter.api import Engine


class JsonErrorProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type] - h11's or httptools' protocol
    """uvicorn's HTTP protocol, whose own 400 (a request it cannot parse: a garbled request line, a bad
    Content-Length) carries the app's JSON error body instead of plain text."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(error_body(f"the request is not valid HTTP/1.1 ({msg.rstrip('.')})",
                                     "invalid_request_error", code="invalid_http")).encode()
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                             b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
        self.transport.close()


@dataclass
class ServerParts:
    loop: ServingLoop
    metrics: ServeMetrics
    server: uvicorn.Server


def make_server(engine: Engine, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 64,
                drain_timeout_s: float = 600.0, log_level: str = "warning") -> ServerParts:
    """The server of `engine` (a `specter.api.Engine`, or the `specter.serve.build.Served` it wraps: the same
    name, method, max_batch, tokenizer, cfg and context_length); closing the engine stays the caller's."""
    metrics = ServeMetrics(engine.name, engine.method.name)
    loop = ServingLoop(engine.method, engine.max_batch, max_queue, metrics)
    app = create_app(engine, loop, metrics, drain_timeout_s)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=int(drain_timeout_s), http=JsonErrorProtocol)
    server = uvicorn.Server(config)

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

    def __init__(self, engine: Engine, max_queue: int = 64, drain_timeout_s: float = 60.0):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.parts = make_server(engine, port=self.port, max_queue=max_queue, drain_timeout_s=drain_timeout_s)
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
