"""The coordinator's HTTP transport: a connection whose peer died as it opened is a connect error.

anyio 4 raises ``AttributeError`` ('NoneType' object has no attribute 'getpeername') when httpcore
looks at a socket the peer has already reset; that race (an engine SIGKILLed as a probe connects)
failed a relayed stream with a 500 in CI. The race itself cannot be produced on demand, so the
library's failure is raised in its place and the coordinator's answer to it is checked.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from coordinator.pipeline.http_lanes import ResetSafeTransport, transport


def _library_fails_with(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    async def fail(self: Any, request: httpx.Request) -> httpx.Response:
        raise error
    monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", fail)


async def _get(url: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=transport(httpx.Limits(max_connections=1))) as client:
        return await client.get(url)


def test_a_socket_gone_as_it_opened_is_a_connect_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _library_fails_with(monkeypatch, AttributeError("'NoneType' object has no attribute 'getpeername'"))
    with pytest.raises(httpx.ConnectError, match="closed as it opened"):
        asyncio.run(_get("http://127.0.0.1:9/health"))


def test_other_attribute_errors_are_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    _library_fails_with(monkeypatch, AttributeError("'Request' object has no attribute 'nope'"))
    with pytest.raises(AttributeError, match="nope"):
        asyncio.run(_get("http://127.0.0.1:9/health"))


def test_a_refused_connection_is_still_a_connect_error() -> None:
    with pytest.raises(httpx.ConnectError):
        asyncio.run(_get("http://127.0.0.1:9/health"))


def test_the_transport_keeps_the_pool_limits_it_is_given() -> None:
    made = transport(httpx.Limits(max_connections=3, max_keepalive_connections=2))
    assert isinstance(made, ResetSafeTransport)
    assert made._pool._max_connections == 3 and made._pool._max_keepalive_connections == 2
