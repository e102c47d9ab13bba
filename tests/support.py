"""Test helpers: a coordinator served by uvicorn in a thread, and SSE reading."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx
import uvicorn

from coordinator.app import Components, build_app
from coordinator.config import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class CoordinatorServer:
    """A real coordinator on a real socket (clients disconnect for real, streams are real)."""

    def __init__(self, settings: Settings) -> None:
        self.port = free_port()
        self.app = build_app(settings)
        cfg = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                             lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

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

    def __enter__(self) -> CoordinatorServer:
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


def sse_events(resp: httpx.Response) -> list[Any]:
    """Parse a complete SSE body into JSON objects; the literal "[DONE]" stays a string."""
    out: list[Any] = []
    for block in resp.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), f"bad SSE frame: {block!r}"
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def streamed_text(events: list[Any], kind: str = "chat") -> dict[int, str]:
    texts: dict[int, str] = {}
    for ev in events:
        if not isinstance(ev, dict):
            continue
        for ch in ev.get("choices", []):
            piece = (ch.get("delta") or {}).get("content") if kind == "chat" else ch.get("text")
            texts[ch["index"]] = texts.get(ch["index"], "") + (piece or "")
    return texts
