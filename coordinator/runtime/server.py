"""The coordinator's HTTP server: uvicorn configured the one way every entry point (CLI, workers,
embedded, tests) runs it, with the drain's phases in front of its own shutdown (docs/shutdown.md)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from coordinator.api.server import header_timeout_protocol
from coordinator.api.shutdown import Drain
from coordinator.config import Settings
from coordinator.observability.events import JsonFormatter

log = logging.getLogger(__name__)
_PARENT_POLL_S = 0.5
_GRACE_S = 5.0  # after the deadline: how long the cut requests get to write their last bytes


def uvicorn_config(app: FastAPI, settings: Settings, *, host: str, port: int,
                   **options: Any) -> uvicorn.Config:
    """The server configuration every entry point (CLI, embedded, tests) uses."""
    return uvicorn.Config(app, host=host, port=port,
                          http=header_timeout_protocol(settings.limits.header_timeout_s), **options)


def configure_logging(settings: Settings, worker: int | None = None, role: str | None = None) -> None:
    """Log level and format from ``server``; a worker process (``server.workers``) or the pod's
    indexer (``role``) names itself in text lines, so a pod's interleaved log still tells them apart."""
    who = f"{role} " if role else "" if worker is None else f"worker-{worker} "
    logging.basicConfig(level=settings.server.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s")
    if settings.server.log_format == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per derender call is too much


class DrainingServer(uvicorn.Server):
    """uvicorn with the drain phases above in front of its own shutdown.

    The first SIGTERM/SIGINT (or ``begin_drain``) starts the drain; a second one exits at once: no
    more waiting, no lifespan shutdown, and the signal is re-raised, so the process dies of it. A
    server stopped with ``should_exit`` (no drain begun) shuts down as plain uvicorn does."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._announced = False

    def begin_drain(self) -> None:
        self.drain.begin()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.begin():
            return  # the graceful path: exit status 0, so the signal is not re-raised
        self._captured_signals.append(sig)
        self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain.draining and not self._announced:
            self._announced = True
            log.warning("draining: /ready answers 503; the listener closes in %.1f s, then in-flight "
                        "requests get %.1f s (a second signal exits at once)",
                        self.drain.delay_s, self.drain.timeout_s)
        if self.drain.delay_over():
            return True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.drain.draining and not self.force_exit:
            await self._drain()
        await super().shutdown(sockets)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        for server in self.servers:
            server.close()  # no new connections
        http = self.config.http_protocol_class
        for conn in list(self.server_state.connections):
            if isinstance(conn, http):
                conn.shutdown()  # idle keep-alive: closed now; busy: closed after its response
        self.drain.close()
        log.warning("listener closed: %d connection(s) open, %.1f s to finish",
                    len(self.server_state.connections), self.drain.timeout_s)
        started = loop.time()
        await self._wait_connections(started + self.drain.timeout_s)
        left = len(self.server_state.connections)
        if left and not self.force_exit:
            log.warning("drain timeout: ending %d connection(s) with a retryable error", left)
            self.drain.expire()
            await self._wait_connections(loop.time() + _GRACE_S)
        log.warning("drained in %.1f s", loop.time() - started)

    async def _wait_connections(self, until: float) -> None:
        loop = asyncio.get_running_loop()
        # Polled as uvicorn does: its connection set has no change notification.
        while self.server_state.connections and not self.force_exit and loop.time() < until:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


def draining_server(app: FastAPI, config: uvicorn.Config) -> DrainingServer:
    """The server for an app built by ``build_app`` (which installed its drain state)."""
    drain: Drain = app.state.drain
    return DrainingServer(config, drain)


def watch_parent(parent_pid: int) -> None:
    """A pod process (worker, indexer) whose supervisor is gone (SIGKILLed) drains and exits instead of
    living on alone: run in a daemon thread."""
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_S)
    log.warning("the supervisor (pid %d) is gone: stopping", parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)
