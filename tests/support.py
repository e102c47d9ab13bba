"""Test helpers: the embedded coordinator under its test name, and SSE reading."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from coordinator.embedded import EmbeddedCoordinator, free_port

__all__ = ["CoordinatorServer", "free_port", "sse_events", "streamed_text", "wait_until"]


CoordinatorServer = EmbeddedCoordinator


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


def wait_until(pred: Callable[[], object], timeout: float = 5.0) -> bool:
    """Poll ``pred`` until it holds (state changes on other threads: engines, coordinator tasks)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return bool(pred())
