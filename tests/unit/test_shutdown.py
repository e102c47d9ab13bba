"""The drain middleware at the deadline, on a bare ASGI exchange (no server, no engines).

The application stands in for the front door: a streaming response that never ends on its own and
a route that waits for the client like ``Pipeline.serve``. At ``Drain.expire`` both must see the
client leave (so their own cleanup runs), and the client must get a proper end instead of a cut.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response
from starlette.responses import StreamingResponse

from coordinator.api.shutdown import Drain, DrainMiddleware
from coordinator.config import ServerSettings


def app_with(released: list[str]) -> FastAPI:
    app = FastAPI()

    @app.get("/stream")
    async def stream() -> Response:
        async def body() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield b'data: {"choices":[]}\n\n'
                    await asyncio.sleep(0)
            finally:
                released.append("stream")

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.get("/wait")
    async def wait(request: Request) -> Response:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        released.append("wait")
        return Response(status_code=499)

    return app


async def exchange(mw: DrainMiddleware, path: str, drain: Drain, after_bytes: int) -> list[dict[str, Any]]:
    """Run one GET; expire the drain once ``after_bytes`` of body went out (0: at the first receive)."""
    sent: list[dict[str, Any]] = []
    never = asyncio.Event()
    first = True

    async def receive() -> dict[str, Any]:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": b"", "more_body": False}
        if after_bytes == 0:
            drain.expire()
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if sum(len(m.get("body", b"")) for m in sent) >= after_bytes > 0:
            drain.expire()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b"", "headers": [],
             "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}
    await mw(scope, receive, send)
    return sent


def drain() -> Drain:
    s = ServerSettings()
    return Drain(s.drain_delay_s, s.drain_timeout_s)


async def test_an_open_stream_ends_with_a_retryable_error_and_done_after_releasing() -> None:
    released: list[str] = []
    d = drain()
    sent = await exchange(DrainMiddleware(app_with(released), d), "/stream", d, after_bytes=200)
    assert released == ["stream"]
    assert sent[0]["status"] == 200
    body = b"".join(m.get("body", b"") for m in sent[1:])
    frames = [f for f in body.split(b"\n\n") if f]
    assert frames[-1] == b"data: [DONE]"
    error = json.loads(frames[-2][len(b"data: "):])["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    assert all(f == b'data: {"choices":[]}' for f in frames[:-2])  # no frame was cut
    assert sent[-1]["more_body"] is False


async def test_a_request_without_an_answer_yet_gets_503_instead_of_the_apps_499() -> None:
    released: list[str] = []
    d = drain()
    sent = await exchange(DrainMiddleware(app_with(released), d), "/wait", d, after_bytes=0)
    assert released == ["wait"]
    assert sent[0]["status"] == 503 and (b"retry-after", b"1") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["error"]["type"] == "ServiceUnavailableError"
    assert len(sent) == 2 and sent[1]["more_body"] is False


async def test_before_the_deadline_nothing_changes() -> None:
    released: list[str] = []
    d = drain()
    d.begin()
    d.close()  # draining, listener closed: requests in flight are left alone

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}  # the client itself left

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "GET", "path": "/wait", "raw_path": b"/wait", "query_string": b"", "headers": [],
             "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}
    await DrainMiddleware(app_with(released), d)(scope, receive, send)
    assert sent[0]["status"] == 499 and released == ["wait"]
