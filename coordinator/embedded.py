"""Run a coordinator on a real socket inside another program (tests, benchmarks).

A real socket matters: client disconnects, back-pressure and SSE framing only behave as in
production over a real connection, which in-process ASGI transports do not give.
"""

from __future__ import annotations

import socket
import threading
import time

from coordinator.app import Components, build_app
from coordinator.config import Settings
from coordinator.runtime.server import draining_server, uvicorn_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedCoordinator:
    """``with EmbeddedCoordinator(settings) as c: httpx.get(c.url + "/ready")``."""

    def __init__(self, settings: Settings, port: int | None = None) -> None:
        # The listening socket is bound here and handed to uvicorn, never closed in between: a port
        # picked free and bound later can be taken meanwhile (by any outgoing connection's ephemeral
        # port, or a process beside this one), and the server then fails to start.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind(("127.0.0.1", port or 0))
        except OSError:
            self._sock.close()
            raise
        self.port = int(self._sock.getsockname()[1])
        self.app = build_app(settings)
        cfg = uvicorn_config(self.app, settings, host="127.0.0.1", port=self.port, log_level="warning",
                             lifespan="on", timeout_graceful_shutdown=5)
        self.server = draining_server(self.app, cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True,
                                       name="coordinator")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def components(self) -> Components:
        c: Components = self.app.state.components
        return c

    @property
    def inflight(self) -> int:
        return self.components.pipeline.inflight

    def __enter__(self) -> EmbeddedCoordinator:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.__exit__()
                raise RuntimeError("coordinator did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        drain = self.server.drain
        self.thread.join(timeout=15 + (drain.delay_s + drain.timeout_s if drain.draining else 0))
        self._sock.close()

    def begin_drain(self) -> None:
        """What SIGTERM does to ``python -m coordinator`` (signals reach only the main thread):
        ``/ready`` turns 503, then the drain of docs/shutdown.md; the server stops when drained."""
        self.server.begin_drain()

    @property
    def stopped(self) -> bool:
        return not self.thread.is_alive()

    def wait_idle(self, timeout: float = 5.0) -> int:
        """Wait until nothing is in flight; returns what is left (0 when idle)."""
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.inflight
