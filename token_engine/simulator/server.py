"""Run a simulated engine on a real socket from tests: `with SimulatedEngine(SimConfig()) as eng: eng.url`.

Why a real socket: coordinator code under test opens HTTP connections, streams, and disconnects; only a
real server exercises those paths (in-process ASGI transports cannot drop a TCP connection). The server
runs uvicorn in a daemon thread with its own event loop, binds an OS-chosen free port, and starts in well
under a second.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from types import TracebackType
from typing import Any

import uvicorn
from fastapi import FastAPI

from .app import build_app
from .config import SimConfig


class SimulatedEngine:
    """A simulated token-only engine listening on 127.0.0.1:<free port> until `stop()`."""

    def __init__(
        self,
        config: SimConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
    ) -> None:
        self.config = config or SimConfig()
        self.host = host
        self.app: FastAPI = build_app(self.config)
        self._requested_port = port
        self._log_level = log_level
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 5.0) -> SimulatedEngine:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._requested_port))
        self.port = sock.getsockname()[1]
        self._sock = sock
        config = uvicorn.Config(
            self.app,
            log_level=self._log_level,
            timeout_graceful_shutdown=1,
            lifespan="off",
            access_log=False,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name=f"sim-engine-{self.port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("simulated engine did not start")
            time.sleep(0.005)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving; open streams are given a second, then cut."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive() and self._server is not None:
                self._server.force_exit = True
                self._thread.join(timeout)
        if self._sock is not None:
            self._sock.close()
        self._server = self._thread = self._sock = None
        self.app.state.sim.close()  # lifespan is off here, so close the KV event publisher ourselves

    def __enter__(self) -> SimulatedEngine:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ---- test helpers (over HTTP, so they are safe from any thread; stdlib only) ----

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method)
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=10) as resp:
            result: dict[str, Any] = json.loads(resp.read() or b"{}")
        return result

    def state(self) -> dict[str, Any]:
        """`GET /sim/state`: running/waiting/aborted ids, counters, pinned transfers, KV event endpoint."""
        return self._call("GET", "/sim/state")

    def consume_transfer(self, remote_request_id: str) -> dict[str, Any]:
        """`POST /sim/kv_transfer/consume`: what a decode simulator calls after pulling the blocks."""
        return self._call("POST", "/sim/kv_transfer/consume", {"remote_request_id": remote_request_id})

    def set_faults(self, **faults: Any) -> dict[str, Any]:
        """Replace the fault set (see `SimFaults`)."""
        return self._call("POST", "/sim/faults", faults)

    def clear_faults(self) -> None:
        self._call("DELETE", "/sim/faults")
