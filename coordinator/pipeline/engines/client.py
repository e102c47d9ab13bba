"""Token-only engine client: ``POST /inference/v1/generate`` (JSON or SSE) and abort.

Closing a generate stream aborts the request inside vLLM; we also call
``/inference/v1/abort_requests`` with the engine's full id (``generate-tokens-<id>``) because a
pooled connection may be closed lazily, and an abort must not depend on that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import msgspec
from httpx_sse import EventSource

from coordinator.config import EngineClientSettings
from coordinator.observability import tracing
from coordinator.observability.record import on_engine_abort
from coordinator.pipeline.engines.registry import Engine
from coordinator.pipeline.errors import (
    BUSY_STATUSES,
    EngineBusy,
    PipelineError,
    TokenRouteMissing,
    UpstreamClientError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from coordinator.pipeline.http_lanes import Lanes, transport
from coordinator.pipeline.obfuscation import Obfuscator

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
    headers = {"X-Request-Id": request_id}
    if engine is not None and engine.api_key:
        headers["Authorization"] = f"Bearer {engine.api_key}"
    tracing.inject(headers)
    return headers


class EngineStreamError(UpstreamUnavailable):
    """The engine reported an error inside a stream that had already started."""


class EngineUnreachable(UpstreamUnavailable):
    """No connection could be made: the request never reached the engine, so another may take it."""


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

    async def generate(self, engine: Engine, body: dict[str, Any], request_id: str) -> dict[str, Any]:
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
        _raise_for_status(engine, resp.status_code, _json_or_none(resp.content))
        data = _json_or_none(resp.content)
        if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
            raise UpstreamUnavailable(f"engine {engine.url} returned an unexpected body")
        return data

    @contextlib.asynccontextmanager
    async def stream(self, engine: Engine, body: dict[str, Any], request_id: str,
                     include_usage: bool) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
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
                    request_id: str) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
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
                _raise_for_status(engine, resp.status_code, _json_or_none(resp.content))
                raise UpstreamUnavailable(f"engine {engine.url} answered HTTP {resp.status_code}")

            async def chunks() -> AsyncIterator[dict[str, Any]]:
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
                            raise _error_event(engine, chunk["error"], before_output=not handed)
                        handed = True
                        yield chunk
                except httpx.TimeoutException as exc:
                    raise UpstreamTimeout(f"engine {engine.url} stream stalled") from exc
                except httpx.HTTPError as exc:
                    raise UpstreamUnavailable(f"engine {engine.url} stream broke: "
                                              f"{exc.__class__.__name__}") from exc
                raise UpstreamUnavailable(f"engine {engine.url} stream ended without [DONE]")

            yield chunks()
        finally:
            self.open_streams -= 1
            await resp.aclose()
            if not finished:
                self.abort_soon(engine, request_id)

    def _send_failed(self, engine: Engine, request_id: str,
                     exc: httpx.HTTPError) -> UpstreamUnavailable | UpstreamTimeout:
        """No connection: the engine never saw the request (safe to retry elsewhere). A timeout: it may be
        running, so abort it. Anything else: the engine failed."""
        name = exc.__class__.__name__
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            return EngineUnreachable(f"engine {engine.url} unreachable: {name}")
        if isinstance(exc, httpx.TimeoutException):
            self.abort_soon(engine, request_id)
            return UpstreamTimeout(f"engine {engine.url} timed out")
        return UpstreamUnavailable(f"engine {engine.url} unreachable: {name}")

    def abort_soon(self, engine: Engine, request_id: str) -> asyncio.Task[bool]:
        """Fire-and-forget abort by full engine id; tracked so shutdown waits for it. The task's result
        says whether the engine accepted it; the current request's observation record gets the task
        (``record.on_engine_abort``), so a door can learn the answer without waiting for it."""
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
            if not accepted:
                log.warning("abort of %s on %s refused: HTTP %d", request_id, engine.url, resp.status_code)
        if self.on_abort is not None:
            self.on_abort(accepted)
        return accepted


_SCALE_OUT_DISABLED = "Scale-out endpoints are disabled"


def _json_or_none(content: bytes) -> Any:
    try:
        return _decode(content)
    except msgspec.DecodeError:
        return None


def credential_refused(engine: Engine, status: int, data: Any) -> None:
    """vLLM's ``--api-key`` answers a bare ``{"error": "Unauthorized"}`` 401: the coordinator's
    credential for this engine is missing or wrong, and the client is not at fault (a 502 saying so,
    not the engine's 401 passed on as if the client's key were bad)."""
    if status == 401 and not (isinstance(data, dict) and isinstance(data.get("error"), dict)):
        raise UpstreamUnavailable(f"engine {engine.url} refused the coordinator's credential (HTTP 401): "
                                  "set engines[].api_key to the engine's --api-key")


def _error_event(engine: Engine, error: Any, *, before_output: bool) -> PipelineError:
    """What an SSE error event means.

    vLLM validates a request's sampling parameters (a grammar, ``skip_tokenizer_init``) only when the
    engine takes it, after the 200: its refusal arrives as the stream's first event, ``{"error":
    {..., "code": 400}}``. Before any output a 4xx there is the client's error, which the topology
    reads before the stream counts as open (``legs.first_chunk``), so the client gets the status and
    body before any byte, as ``vllm serve`` answers; any other error before output is the engine's
    failure (retried elsewhere). Once output flowed it stays an error in the stream
    (``EngineStreamError``)."""
    err = error if isinstance(error, dict) else {"message": str(error)}
    message = err.get("message", error)
    if not before_output:
        return EngineStreamError(f"engine error: {message}")
    code = err.get("code")
    if isinstance(code, int) and 400 <= code < 500 and code not in BUSY_STATUSES:
        return UpstreamClientError(code, {"error": err}, f"engine {engine.url} refused the request")
    return UpstreamUnavailable(f"engine {engine.url} failed before any output: {message}")


def _raise_for_status(engine: Engine, status: int, data: Any) -> None:
    if status == 200:
        return
    if status == 403 and _SCALE_OUT_DISABLED in str(((data or {}).get("error") or {}).get("message", "")
                                                    if isinstance(data, dict) else ""):
        # A plain `vllm serve` (no --enable-scale-out) refuses the token route with this 403: the
        # engine is healthy, the route is missing, not the client's fault.
        raise TokenRouteMissing(f"engine {engine.url} has the scale-out routes disabled (HTTP 403)")
    credential_refused(engine, status, data)
    if status in BUSY_STATUSES:
        raise EngineBusy(status, data, f"engine {engine.url} is busy (HTTP {status})")
    if 400 <= status < 500 and status != 404:
        raise UpstreamClientError(status, data, f"engine {engine.url} rejected the request")
    if status == 404 and isinstance(data, dict) and isinstance(data.get("error"), dict):
        raise UpstreamClientError(status, data, "engine does not serve this model")
    if status in (404, 501):  # a bare 404 (no OpenAI error body) or 501: no token-only route here
        raise TokenRouteMissing(f"engine {engine.url} does not serve /inference/v1/generate "
                                f"(HTTP {status})")
    raise UpstreamUnavailable(f"engine {engine.url} failed with HTTP {status}")

