"""Client for an engine's own API (``/v1/chat/completions``, ``/v1/completions``, ``/v1/messages``,
``/v1/responses``, ``/v1/models``).

Only engines marked ``native_api`` (``vllm serve --enable-scale-out``) are called here, by the native
route (``pipeline/native_route.py``). The client's OpenAI body goes as it is; the engine tokenizes,
samples and detokenizes itself. Closing a stream closes the HTTP response, which vLLM's OpenAI server
turns into an abort of the request (it watches for the disconnect), so no separate abort call exists.
Failures are mapped by the rules the token-only client uses (``http_errors.py``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx
import msgspec
from httpx_sse import EventSource

from coordinator.config import EngineClientSettings
from coordinator.pipeline.engines.client import call_headers
from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.engines.http_errors import (
    raise_for_openai_route,
    send_failed,
    stream_error_event,
    stream_failed,
)
from coordinator.pipeline.errors import UpstreamUnavailable
from coordinator.pipeline.http_lanes import KEEPALIVE_EXPIRY_S, json_or_none
from coordinator.pipeline.http_lanes import transport as http_transport

log = logging.getLogger(__name__)
_decode = msgspec.json.Decoder().decode

NativeKind = Literal["chat", "completion", "messages", "responses"]
PATHS: dict[str, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions",
                         "messages": "/v1/messages", "responses": "/v1/responses"}
# What a well-formed non-streaming answer of each route carries.
_ANSWER_KEYS: dict[str, str] = {"chat": "choices", "completion": "choices", "messages": "content",
                                "responses": "output"}
# The event that ends a stream of the APIs that send no ``[DONE]`` (vLLM's Messages and Responses).
_LAST_EVENTS: dict[str, frozenset[str]] = {
    "messages": frozenset({"message_stop"}),
    "responses": frozenset({"response.completed", "response.failed", "response.incomplete"})}
_MODELS_TIMEOUT_S = 5.0


class NativeClient:
    """Typed calls to engines' OpenAI routes; one connection pool for all of them."""

    def __init__(self, settings: EngineClientSettings,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        limits = httpx.Limits(max_connections=settings.max_connections, keepalive_expiry=KEEPALIVE_EXPIRY_S)
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.stream_idle_timeout_s, connect=settings.connect_timeout_s),
            transport=transport or http_transport(limits))
        self.open_streams = 0  # engine responses currently held open (a leak shows here)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def complete(self, engine: Engine, kind: NativeKind, body: dict[str, Any],
                       request_id: str) -> dict[str, Any]:
        """A non-streaming call; the engine's JSON response."""
        timeout = httpx.Timeout(self.settings.total_timeout_s, connect=self.settings.connect_timeout_s)
        try:
            resp = await self._http.post(f"{engine.url}{PATHS[kind]}", json={**body, "stream": False},
                                         headers=call_headers(request_id, engine), timeout=timeout)
        except httpx.HTTPError as exc:
            raise send_failed(engine, exc) from exc
        data = json_or_none(resp.content)
        raise_for_openai_route(engine, resp.status_code, data)
        if not isinstance(data, dict) or not isinstance(data.get(_ANSWER_KEYS[kind]), list):
            raise UpstreamUnavailable(f"engine {engine.url} returned an unexpected {PATHS[kind]} body")
        return data

    @contextlib.asynccontextmanager
    async def stream(self, engine: Engine, kind: NativeKind, body: dict[str, Any],
                     request_id: str) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Open an SSE stream (yields once the engine answered 200) as an iterator of chunk dicts.

        Leaving the context closes the response: vLLM aborts the request when its client goes."""
        req = self._http.build_request("POST", f"{engine.url}{PATHS[kind]}", json={**body, "stream": True},
                                       headers=call_headers(request_id, engine))
        try:
            resp = await self._http.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise send_failed(engine, exc) from exc
        self.open_streams += 1
        try:
            if resp.status_code != 200:
                await resp.aread()
                raise_for_openai_route(engine, resp.status_code, json_or_none(resp.content))
            yield _chunks(engine, resp, _LAST_EVENTS.get(kind, frozenset()))
        finally:
            self.open_streams -= 1
            await resp.aclose()

    async def count_tokens(self, engine: Engine, body: dict[str, Any], request_id: str) -> int:
        """The engine's own ``/v1/messages/count_tokens`` answer for a Messages body."""
        try:
            resp = await self._http.post(f"{engine.url}/v1/messages/count_tokens", json=body,
                                         headers=call_headers(request_id, engine))
        except httpx.HTTPError as exc:
            raise send_failed(engine, exc) from exc
        data = json_or_none(resp.content)
        raise_for_openai_route(engine, resp.status_code, data)
        tokens = data.get("input_tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, int):
            raise UpstreamUnavailable(f"engine {engine.url} returned an unexpected count_tokens body")
        return tokens

    async def max_model_len(self, engine: Engine, model: str) -> int | None:
        """The context length the engine reports for ``model`` on ``/v1/models`` (None: unknown)."""
        try:
            resp = await self._http.get(f"{engine.url}/v1/models", timeout=_MODELS_TIMEOUT_S)
            data = _decode(resp.content) if resp.status_code == 200 else None
        except (httpx.HTTPError, msgspec.DecodeError):
            return None
        cards = data.get("data") if isinstance(data, dict) else None
        for card in cards if isinstance(cards, list) else []:
            length = card.get("max_model_len") if isinstance(card, dict) else None
            if card.get("id") == model and isinstance(length, int):
                return length
        return None


async def _chunks(engine: Engine, resp: httpx.Response,
                  last: frozenset[str]) -> AsyncIterator[dict[str, Any]]:
    """The stream's JSON events; it ends at ``[DONE]`` or, for the APIs that send none, after an
    event whose ``type`` is in ``last``. Any other end is a broken stream."""
    try:
        async for event in EventSource(resp).aiter_sse():
            if event.data == "[DONE]":
                return
            chunk = _decode(event.data)
            if not isinstance(chunk, dict):
                raise UpstreamUnavailable(f"engine {engine.url} sent a chunk that is not an object")
            if "error" in chunk:
                raise stream_error_event(engine, chunk["error"], before_output=False)
            yield chunk
            if chunk.get("type") in last:
                return
    except httpx.HTTPError as exc:
        raise stream_failed(engine, exc) from exc
    except msgspec.DecodeError as exc:
        raise UpstreamUnavailable(f"engine {engine.url} sent a chunk that is not JSON") from exc
    raise UpstreamUnavailable(f"engine {engine.url} stream ended without [DONE]")
