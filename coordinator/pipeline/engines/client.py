"""Token-only engine client: ``POST /inference/v1/generate`` (JSON or SSE) and abort.

Closing a generate stream aborts the request inside vLLM; we also call
``/inference/v1/abort_requests`` with the engine's full id (``generate-tokens-<id>``) because a
pooled connection may be closed lazily, and an abort must not depend on that. An engine that answers
that route 404 / 405 does not serve it: it is not called there again, and closing the connection
(which the client does for every request it leaves unfinished) is the abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import httpx
import msgspec
from httpx_sse import EventSource

from coordinator.config import EngineClientSettings
from coordinator.contracts.generate import GenerateRequest, GenerateResponse, StreamChunk
from coordinator.contracts.permutation import Obfuscator
from coordinator.observability import tracing
from coordinator.observability.record import on_engine_abort
from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.engines.http_errors import (
    raise_for_token_route,
    send_failed,
    stream_error_event,
    stream_failed,
)
from coordinator.pipeline.errors import UpstreamTimeout, UpstreamUnavailable
from coordinator.pipeline.http_lanes import Lanes, json_or_none, transport

log = logging.getLogger(__name__)
# msgspec: one decode per engine chunk is the hot path (several times faster than json.loads).
_decode = msgspec.json.Decoder().decode


def engine_request_id(request_id: str) -> str:
    """The id vLLM gives a request sent with ``X-Request-Id: request_id`` (what abort matches)."""
    return f"generate-tokens-{request_id}"


def call_headers(request_id: str, engine: Engine | None = None) -> dict[str, str]:
    """Headers of a call to an engine: ``X-Request-Id`` (the engine's id for the request, which abort
    matches), the coordinator's bearer token for an engine run with ``--api-key`` (never the client's)
    and, for a traced request, the calling span's ``traceparent`` (vLLM's spans join it)."""
    headers = {"X-Request-Id": request_id, **(engine.credentials() if engine is not None else {})}
    tracing.inject(headers)
    return headers


class EngineClient:
    obfuscator: Obfuscator | None = None  # set by ObfuscatingEngineClient: the ids engines see differ

    def __init__(self, settings: EngineClientSettings) -> None:
        self.settings = settings
        timeout = httpx.Timeout(settings.stream_idle_timeout_s, connect=settings.connect_timeout_s)
        # Small pools (see http_lanes): every open stream holds a connection, and one big pool would
        # make opening each new stream scan all of them.
        self._lanes = Lanes(settings.max_connections,
                            lambda limits: httpx.AsyncClient(timeout=timeout, transport=transport(limits)))
        self._aborts: set[asyncio.Task[bool]] = set()
        self.open_streams = 0  # generate responses held open (a leak shows here: /admin/accounting)
        self.on_abort: Callable[[bool], None] | None = None  # each abort's answer (the engine_aborts metric)

    @property
    def pending_aborts(self) -> int:
        """Abort calls sent and not finished yet."""
        return len(self._aborts)

    @property
    def http(self) -> httpx.AsyncClient:
        """A pool for probes and aborts."""
        return self._lanes.first

    async def aclose(self) -> None:
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)
        await self._lanes.aclose()

    async def generate(self, engine: Engine, body: GenerateRequest, request_id: str) -> GenerateResponse:
        """Non-streaming generate; the whole output in one JSON body."""
        payload = {**body, "stream": False, "stream_options": None}
        timeout = httpx.Timeout(self.settings.total_timeout_s, connect=self.settings.connect_timeout_s)
        try:
            with self._lanes.lane() as http:
                resp = await http.post(f"{engine.url}/inference/v1/generate", json=payload,
                                       headers=call_headers(request_id, engine), timeout=timeout)
        except asyncio.CancelledError:
            self.abort_soon(engine, request_id)
            raise
        except httpx.HTTPError as exc:
            raise self._send_failed(engine, request_id, exc) from exc
        data = json_or_none(resp.content)
        raise_for_token_route(engine, resp.status_code, data)
        if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
            raise UpstreamUnavailable(f"engine {engine.url} returned an unexpected body")
        return cast(GenerateResponse, data)

    @contextlib.asynccontextmanager
    async def stream(self, engine: Engine, body: GenerateRequest, request_id: str,
                     include_usage: bool) -> AsyncIterator[AsyncIterator[StreamChunk]]:
        """Open a generate stream; yields once headers are in (200), as an iterator of chunks.

        Leaving the context early closes the HTTP stream and aborts the engine request.
        """
        payload = {**body, "stream": True,
                   "stream_options": {"include_usage": include_usage,
                                      "continuous_usage_stats": bool(
                                          (body.get("stream_options") or {}).get("continuous_usage_stats"))}}
        with self._lanes.lane() as http:
            async with self._open(http, engine, payload, request_id) as chunks:
                yield chunks

    @contextlib.asynccontextmanager
    async def _open(self, http: httpx.AsyncClient, engine: Engine, payload: dict[str, Any],
                    request_id: str) -> AsyncIterator[AsyncIterator[StreamChunk]]:
        req = http.build_request("POST", f"{engine.url}/inference/v1/generate", json=payload,
                                 headers=call_headers(request_id, engine))
        try:
            resp = await http.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise self._send_failed(engine, request_id, exc) from exc
        finished = False
        self.open_streams += 1
        try:
            if resp.status_code != 200:
                await resp.aread()
                raise_for_token_route(engine, resp.status_code, json_or_none(resp.content))
                raise UpstreamUnavailable(f"engine {engine.url} answered HTTP {resp.status_code}")

            async def chunks() -> AsyncIterator[StreamChunk]:
                nonlocal finished
                handed = False
                try:
                    async for event in EventSource(resp).aiter_sse():
                        if event.data == "[DONE]":
                            finished = True
                            return
                        chunk = _decode(event.data)
                        if "error" in chunk:
                            finished = True
                            raise stream_error_event(engine, chunk["error"], before_output=not handed)
                        handed = True
                        yield chunk
                except httpx.HTTPError as exc:
                    raise stream_failed(engine, exc) from exc
                raise UpstreamUnavailable(f"engine {engine.url} stream ended without [DONE]")

            yield chunks()
        finally:
            self.open_streams -= 1
            await resp.aclose()
            if not finished:
                self.abort_soon(engine, request_id)

    def _send_failed(self, engine: Engine, request_id: str,
                     exc: httpx.HTTPError) -> UpstreamUnavailable | UpstreamTimeout:
        """``http_errors.send_failed``; a request that timed out may be running, so it is aborted."""
        failure = send_failed(engine, exc)
        if isinstance(failure, UpstreamTimeout):
            self.abort_soon(engine, request_id)
        return failure

    def abort_soon(self, engine: Engine, request_id: str) -> asyncio.Task[bool] | None:
        """Fire-and-forget abort by full engine id; tracked so shutdown waits for it. The task's result
        says whether the engine accepted it; the current request's observation record gets the task
        (``record.on_engine_abort``), so a door can learn the answer without waiting for it. None when
        the engine has no abort route: the closed connection aborted the request, and no call is sent."""
        if engine.abort_route is False:
            return None
        task = asyncio.create_task(self.abort(engine, request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)
        on_engine_abort(task)
        return task

    async def abort(self, engine: Engine, request_id: str) -> bool:
        """True when the engine accepted the abort (HTTP 200); False when it refused or was unreachable."""
        try:
            resp = await self.http.post(f"{engine.url}/inference/v1/abort_requests",
                                        json={"request_ids": [engine_request_id(request_id)]}, timeout=5.0,
                                        headers=call_headers(request_id, engine))
        except httpx.HTTPError as exc:
            log.warning("abort of %s on %s failed: %s", request_id, engine.url, exc.__class__.__name__)
            accepted = False
        else:
            accepted = resp.status_code == 200
            if resp.status_code in (404, 405):
                engine.abort_route = False
                log.info("engine %s has no abort route: closing its streams aborts its requests", engine.url)
            elif accepted:
                engine.abort_route = True
            else:
                log.warning("abort of %s on %s refused: HTTP %d", request_id, engine.url, resp.status_code)
        if self.on_abort is not None:
            self.on_abort(accepted)
        return accepted
