"""Graceful shutdown: SIGTERM drains the coordinator instead of cutting its streams.

Plain uvicorn, on SIGTERM, closes the listener at once (a Kubernetes Service may still route new
connections here for a few seconds, which are then refused), closes every WebSocket with 1012 at
once, and waits for the HTTP responses in flight, forever or until ``timeout_graceful_shutdown``;
then it cancels their tasks, which cuts a stream mid-body (no error event, no ``[DONE]``). It also
re-raises the signal once it is done, so the process never exits 0. The phases here
(docs/shutdown.md):

1. **Delay** (``server.drain_delay_s``): ``/ready`` answers 503 ``{"draining": true}``, everything
   else as usual, so endpoints stop routing here before the listener goes away.
2. **Drain** (``server.drain_timeout_s``): the listener is closed and idle keep-alive connections
   too; responses and streams in flight go on; NNRP sessions take no new operations and close with
   1001 when their open ones are done.
3. **Deadline**: what is still open ends through its own client-gone path (engine requests aborted,
   admission released); the middleware then ends an SSE body with a retryable error event and
   ``[DONE]``, answers a request that had not started its response with 503, and NNRP sessions
   cancel their operations (source ``server``) and close with 1001.

Then the lifespan closes the components and the process exits 0. A second signal exits at once.
Here: the drain's state and the middleware the doors run behind; the server loop that drives the
phases is the runtime's (``runtime/server.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Protocol

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.api.openai.errors import sse_error_frame
from coordinator.config import ServerSettings
from coordinator.pipeline.errors import PipelineError

REASON = "the server is shutting down"


RECORD_KEY = "coordinator.record"
"""Where a door leaves the request's observation record in the ASGI scope, so that a request cut at
the deadline is recorded as the 503 its client gets, not as a client that left."""


def shutting_down() -> PipelineError:
    """What a client still being served at the deadline gets: a 503 it may retry elsewhere."""
    return PipelineError(f"{REASON}; retry the request", status=503, type="ServiceUnavailableError")


class GoesAway(Protocol):
    """A long-lived session (NNRP) that ends itself on shutdown."""

    def go_away(self, reason: str, *, now: bool) -> None:
        """Take no new work; end once the open work is done, or at once (``now``)."""


class Drain:
    """The shutdown state one coordinator's server loop, ``/ready``, middleware and sessions share."""

    def __init__(self, delay_s: float, timeout_s: float) -> None:
        self.delay_s = delay_s
        self.timeout_s = timeout_s
        self.since: float | None = None  # monotonic time of begin()
        self.closing = False  # the listener is closed
        self.expired = False  # the deadline passed: whatever is open ends now
        self._deadline: asyncio.Future[None] | None = None
        self._sessions: set[GoesAway] = set()

    @property
    def draining(self) -> bool:
        return self.since is not None

    def begin(self) -> bool:
        """Start draining; False when it had already begun. Only records the time, so it is safe in a
        signal handler or from another thread (the server loop polls ``delay_over``)."""
        if self.since is not None:
            return False
        self.since = time.monotonic()
        return True

    def delay_over(self) -> bool:
        return self.since is not None and time.monotonic() - self.since >= self.delay_s

    def close(self) -> None:
        """The listener is closed: sessions end as soon as their open operations are done."""
        self.closing = True
        for s in list(self._sessions):
            s.go_away(REASON, now=False)

    def expire(self) -> None:
        """The drain timeout passed: cut requests still waiting, end open sessions now."""
        self.expired = True
        if self._deadline is not None and not self._deadline.done():
            self._deadline.set_result(None)
        for s in list(self._sessions):
            s.go_away(REASON, now=True)

    def deadline(self) -> asyncio.Future[None]:
        """Completes at ``expire`` (made lazily: it belongs to the server's event loop)."""
        if self._deadline is None:
            self._deadline = asyncio.get_running_loop().create_future()
            if self.expired:
                self._deadline.set_result(None)
        return self._deadline

    @contextlib.contextmanager
    def hold(self, session: GoesAway) -> Iterator[None]:
        """Register a session for its lifetime (one opened during the drain is told at once)."""
        self._sessions.add(session)
        if self.closing or self.expired:
            session.go_away(REASON, now=self.expired)
        try:
            yield
        finally:
            self._sessions.discard(session)


def install_drain(app: FastAPI, settings: ServerSettings) -> Drain:
    """Give ``app`` its drain state (``app.state.drain``) and the middleware that acts on it."""
    drain = Drain(settings.drain_delay_s, settings.drain_timeout_s)
    app.state.drain = drain
    app.add_middleware(DrainMiddleware, drain=drain)
    return drain


class _Exchange:
    __slots__ = ("complete", "cut", "replaced", "sse", "started")

    def __init__(self) -> None:
        self.cut = False  # we told the application that the client left
        self.started = self.sse = self.complete = self.replaced = False


class DrainMiddleware:
    """At the deadline, an HTTP request still open is ended through its own client-gone path.

    The application is told the client disconnected (its next or pending ``receive``), which is the
    one path that already releases everything a request holds: Starlette stops the stream, the
    pipeline closes the engine streams, aborts the engine requests and releases admission. The
    client, still connected, then gets from here what the application can no longer send: the end
    of an SSE body as an error event the client may retry on and ``[DONE]``, or a 503 for a request
    that had not started its answer. Frames are never cut: the stream is stopped between sends."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ex = _Exchange()
        drain = self.drain

        async def receive_until_deadline() -> Message:
            if not ex.cut and not drain.expired:
                message = asyncio.ensure_future(receive())
                try:
                    await asyncio.wait((message, drain.deadline()), return_when=asyncio.FIRST_COMPLETED)
                except BaseException:
                    message.cancel()
                    raise
                if message.done():
                    return message.result()
                message.cancel()  # uvicorn's receive only waits on an event: nothing is lost
            if not ex.cut:
                ex.cut = True
                record = scope.get(RECORD_KEY)
                if record is not None:
                    exc = shutting_down()
                    record.server_ended(exc.type, exc.status)
            return {"type": "http.disconnect"}

        async def send_unless_cut(message: Message) -> None:
            if ex.replaced:
                return
            if message["type"] == "http.response.start":
                if ex.cut:  # the application answers a request it saw leave (499): tell the client why
                    ex.replaced = ex.complete = True
                    await _send_json_error(send)
                    return
                ex.started = True
                ex.sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                             for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ex.complete = True
            await send(message)

        await self.app(scope, receive_until_deadline, send_unless_cut)
        if ex.cut and ex.started and not ex.complete:
            tail = sse_error_frame(shutting_down()) + b"data: [DONE]\n\n" if ex.sse else b""
            await send({"type": "http.response.body", "body": tail, "more_body": False})


async def _send_json_error(send: Send) -> None:
    exc = shutting_down()
    body = sse_error_frame(exc)[len(b"data: "):].rstrip(b"\n")
    await send({"type": "http.response.start", "status": exc.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                            (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
