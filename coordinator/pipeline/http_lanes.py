"""HTTP connection pools split into small lanes, so picking a connection stays cheap.

httpcore's pool scans every pooled connection on every request, and counts idle ones with a nested
scan (quadratic in the pool size), plus one readability syscall per idle connection. With dozens of
derender calls or engine streams in flight on one pool that bookkeeping was a quarter of the
coordinator's CPU (measured with py-spy at 64 streams). Spreading the connections over lanes of at
most ``LANE_CONNECTIONS``, each its own ``httpx.AsyncClient``, keeps every scan short; a call takes
the lane with the fewest calls in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec

LANE_CONNECTIONS = 8
KEEPALIVE_EXPIRY_S = 3.0
"""How long an idle pooled connection is kept. Below the 5 s keep-alive timeout of the uvicorn
servers we call (vLLM's engines and render sidecar, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``): with httpx's
default of 5 s too, a connection
reused just as the server closes it fails with "Server disconnected without sending a response",
which a one-engine fleet cannot retry elsewhere (seen as a 502 under load)."""


_decode = msgspec.json.Decoder().decode


def json_or_none(content: bytes) -> Any:
    """An answer's JSON body, or None when it has none (a bare error page, an empty body)."""
    try:
        return _decode(content)
    except msgspec.DecodeError:
        return None


@functools.cache
def shared_ssl_context() -> ssl.SSLContext:
    """One TLS context for every client: httpx otherwise loads the CA bundle once per client, and a
    coordinator builds dozens of lane clients (seconds of start-up on a busy 2-core machine)."""
    return httpx.create_ssl_context()


class ResetSafeTransport(httpx.AsyncHTTPTransport):
    """httpx's transport, where a peer that dies as a connection opens is a ``ConnectError``.

    anyio 4 answers a stream's socket attributes from the live socket; when the engine is killed
    between accept and httpcore's first look at the connection, that socket is already ``None`` and
    httpcore lets the ``AttributeError`` through. Without this, a SIGKILLed engine's health probe
    (or a stream opened to it) failed the request with a 500 instead of counting as a dead engine.
    """

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except AttributeError as exc:
            if "'NoneType' object has no attribute" not in str(exc):
                raise
            raise httpx.ConnectError(f"the connection closed as it opened ({exc})", request=request) from exc


def transport(limits: httpx.Limits) -> ResetSafeTransport:
    """The transport every coordinator client uses (a client given a transport takes its pool
    limits and TLS context from it, not from its own arguments)."""
    return ResetSafeTransport(limits=limits, verify=shared_ssl_context())


class Lanes:
    """``total_connections`` spread over ``ceil(total / LANE_CONNECTIONS)`` clients."""

    def __init__(self, total_connections: int, make_client: Callable[[httpx.Limits], httpx.AsyncClient],
                 keepalive_expiry: float | None = KEEPALIVE_EXPIRY_S) -> None:
        per_lane = min(LANE_CONNECTIONS, total_connections)
        limits = httpx.Limits(max_connections=per_lane, max_keepalive_connections=per_lane,
                              keepalive_expiry=keepalive_expiry)
        self.clients = [make_client(limits) for _ in range(-(-total_connections // per_lane))]
        self._load = [0] * len(self.clients)

    @property
    def first(self) -> httpx.AsyncClient:
        """A client for one-off calls (probes, model lists)."""
        return self.clients[0]

    @contextlib.contextmanager
    def lane(self) -> Iterator[httpx.AsyncClient]:
        """The client with the fewest calls in flight, held for one call (or one whole stream)."""
        i = min(range(len(self.clients)), key=self._load.__getitem__)
        self._load[i] += 1
        try:
            yield self.clients[i]
        finally:
            self._load[i] -= 1

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients))
