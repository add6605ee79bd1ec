"""Running the app: uvicorn in the foreground (`specter serve`, SIGTERM drains), or in a thread on a
loopback socket of the caller's (tests and the load benchmark)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from specter.serve.app import create_app
from specter.serve.build import Served
from specter.serve.loop import ServingLoop
from specter.serve.metrics import ServeMetrics


@dataclass
class ServerParts:
    loop: ServingLoop
    metrics: ServeMetrics
    server: uvicorn.Server


def make_server(served: Served, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 64,
                drain_timeout_s: float = 600.0, log_level: str = "warning") -> ServerParts:
    metrics = ServeMetrics(served.name, served.method.name)
    loop = ServingLoop(served.method, served.max_batch, max_queue, metrics)
    app = create_app(served, loop, metrics, drain_timeout_s)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=int(drain_timeout_s))
    return ServerParts(loop, metrics, uvicorn.Server(config))


class ThreadedServer:
    """The server on a free loopback port, in a daemon thread: ``with ThreadedServer(served) as s: s.url``."""

    def __init__(self, served: Served, max_queue: int = 64, drain_timeout_s: float = 60.0):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.parts = make_server(served, port=self.port, max_queue=max_queue, drain_timeout_s=drain_timeout_s)
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
