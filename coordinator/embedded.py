"""Run a coordinator on a real socket inside another program (tests, benchmarks).

A real socket matters: client disconnects, back-pressure and SSE framing only behave as in
production over a real connection, which in-process ASGI transports do not give.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from coordinator.api.server import uvicorn_config
from coordinator.app import Components, build_app
from coordinator.config import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedCoordinator:
    """``with EmbeddedCoordinator(settings) as c: httpx.get(c.url + "/ready")``."""

    def __init__(self, settings: Settings, port: int | None = None) -> None:
        self.port = port or free_port()
        self.app = build_app(settings)
        cfg = uvicorn_config(self.app, settings, host="127.0.0.1", port=self.port, log_level="warning",
                             lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="coordinator")

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
                raise RuntimeError("coordinator did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)

    def wait_idle(self, timeout: float = 5.0) -> int:
        """Wait until nothing is in flight; returns what is left (0 when idle)."""
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.inflight
