"""HTTP client for the pool of localhost vLLM render sidecars (render, derender, models, health).

vLLM's streaming derender runs on one event loop per sidecar process, so streaming capacity grows
with the number of processes, not with ``--renderer-num-workers``. ``render.urls`` lists the
processes (same model and flags); each call goes to the one with the fewest calls in flight (ties:
round robin). Render and derender are stateless (a stream's ``stream_state`` travels with every call),
so any chunk may go to any sidecar, and a call that failed without a usable answer (no connection, a
broken connection, a 5xx) is retried once on another sidecar (a broken connection also on the same
one, when it is alone); a sidecar that refused a connection gets no calls for ``render.skip_s``
(docs/decisions.md, "Render sidecar pool").

JSON goes through msgspec both ways (several times faster than the stdlib on the per-chunk path).
Parts of a body that do not change between calls can be encoded once and passed as ``msgspec.Raw``
values (see ``post``), or a whole body as bytes (``post_raw``). Failures are mapped to pipeline
errors here so render and derender callers only see typed errors: ``Upstream*`` for render (what the
render fallback reacts to), ``ResponseStageError`` and its subclasses for derender, which no engine
retry, relay or breaker rule matches (docs/decisions.md, "Derender failures").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from coordinator.config import RenderSettings
from coordinator.observability import tracing
from coordinator.pipeline.errors import (
    DerenderRejected,
    DerenderTimeout,
    DerenderUnavailable,
    PipelineError,
    ResponseStageError,
    UpstreamClientError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from coordinator.pipeline.http_lanes import KEEPALIVE_EXPIRY_S, Lanes, json_or_none
from coordinator.pipeline.http_lanes import transport as lanes_transport

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def encode(obj: Any) -> bytes:
    """UTF-8 JSON bytes; ``msgspec.Raw`` values inside ``obj`` are spliced in verbatim.

    Callers use it to pre-encode the parts of a body that stay the same for a whole stream::

        options = msgspec.Raw(encode(ctx.derender_request))   # once per request
        await sidecar.post(path, {..., "chat_request": options})  # per chunk: no re-encoding
    """
    return _encode(obj)


@dataclass(eq=False)
class Sidecar:
    """One sidecar process: its connection lanes and what the picker needs to know of it."""

    url: str
    index: int
    lanes: Lanes
    outstanding: int = 0       # calls in flight
    calls: int = 0             # calls sent (retries included)
    skip_until: float = 0.0    # monotonic; refused a connection, so no calls before this
    relearn: bool = True       # its derender features are unknown (never asked, or it was gone since)
    excluded: str | None = None  # why it gets no calls (it disagrees with the pool's parsers)

    @property
    def http(self) -> httpx.AsyncClient:
        """A connection pool for one-off calls (health, models)."""
        return self.lanes.first


@dataclass(eq=False)
class Affinity:
    """Where one stream's derender calls go: the sidecar that served its last call, while it answers
    (its parser session is there, docs/parsers.md). Render calls have none and stay least-loaded."""

    sidecar: Sidecar | None = None


@dataclass(frozen=True)
class StageErrors:
    """The error types one stage's failures become: unreachable/5xx/malformed body, timeout, a 4xx
    for the request, a missing route (bare 404/405, and 501 where listed in ``unsupported_statuses``)."""

    unavailable: Callable[[str], PipelineError]
    timeout: Callable[[str], PipelineError]
    rejected: Callable[[int, Any, str], PipelineError]
    unsupported: Callable[[str], PipelineError]
    unsupported_statuses: frozenset[int]


STAGE_ERRORS: dict[str, StageErrors] = {
    "render": StageErrors(UpstreamUnavailable, UpstreamTimeout, UpstreamClientError, UpstreamUnavailable,
                          frozenset({404, 405})),
    "derender": StageErrors(DerenderUnavailable, DerenderTimeout, DerenderRejected, ResponseStageError,
                            frozenset({404, 405, 501})),
}


def stage_errors(stage: str) -> StageErrors:
    return STAGE_ERRORS.get(stage, STAGE_ERRORS["render"])


class _Retryable(Exception):
    """The call got no usable answer from this sidecar; another one may give it. ``broken``: the
    connection broke under the call (reset, closed without an answer), which a fresh connection to
    the same sidecar usually does not repeat."""

    def __init__(self, error: PipelineError, broken: bool = False) -> None:
        super().__init__(error.message)
        self.error = error
        self.broken = broken


class SidecarClient:
    """Typed calls to the render sidecars; knows nothing of the client-facing HTTP layer."""

    def __init__(self, settings: RenderSettings, transport: httpx.AsyncBaseTransport | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``transport`` replaces the network for every sidecar (tests); ``clock`` drives ``skip_s``."""
        self.settings = settings
        self._clock = clock
        def client(url: str) -> Callable[[httpx.Limits], httpx.AsyncClient]:
            return lambda limits: httpx.AsyncClient(
                base_url=url, transport=transport or lanes_transport(limits),
                timeout=httpx.Timeout(settings.timeout_s))

        self.sidecars = [Sidecar(url, i, Lanes(settings.max_connections, client(url), KEEPALIVE_EXPIRY_S))
                         for i, url in enumerate(settings.endpoints)]
        # Round-robin start among equally loaded sidecars, one cursor per stage: with a shared one,
        # the derender calls between two renders decided (by their parity) where the next render went.
        self._next: dict[str, int] = {}

    async def aclose(self) -> None:
        await asyncio.gather(*(s.lanes.aclose() for s in self.sidecars))

    def pick(self, exclude: Sidecar | None = None, stage: str = "render",
             affinity: Affinity | None = None) -> Sidecar | None:
        """The sidecar for the next call: the stream's own (``affinity``) while it is not skipped,
        else the fewest calls in flight among those not skipped, ties taken in round-robin order. If
        every candidate is skipped, the one whose skip ends first (better one connection attempt than
        a certain failure). None when ``exclude`` was the only one. Sidecars excluded for disagreeing
        with the pool get no calls while another one is there."""
        candidates = [s for s in self.sidecars if s is not exclude and s.excluded is None] or [
            s for s in self.sidecars if s is not exclude]
        if not candidates:
            return None
        now = self._clock()
        own = affinity.sidecar if affinity is not None else None
        if own is not None and own in candidates and own.skip_until <= now:
            return own
        live = [s for s in candidates if s.skip_until <= now]
        if not live:
            return min(candidates, key=lambda s: s.skip_until)
        n, start = len(self.sidecars), self._next.get(stage, 0)
        self._next[stage] = (start + 1) % n
        return min(live, key=lambda s: (s.outstanding, (s.index - start) % n))

    async def post(self, path: str, body: Mapping[str, Any], *, request_id: str | None = None,
                   stage: str = "render", affinity: Affinity | None = None,
                   decode: Callable[[bytes], Any] | None = None,
                   headers: Mapping[str, str] | None = None) -> Any:
        """POST ``body`` as JSON (``msgspec.Raw`` values spliced in as they are) and return the decoded
        reply; 4xx pass through as client errors, the rest become 502/504. With ``affinity`` the call
        goes to the stream's sidecar while it answers, and ``affinity`` then names the one that did.
        ``decode``: a typed msgspec decoder for the reply (a reply it refuses is a malformed body)."""
        return await self.post_raw(path, _encode(body), request_id=request_id, stage=stage,
                                   affinity=affinity, decode=decode, headers=headers)

    async def post_raw(self, path: str, content: bytes, *, request_id: str | None = None,
                       stage: str = "render", affinity: Affinity | None = None,
                       decode: Callable[[bytes], Any] | None = None,
                       headers: Mapping[str, str] | None = None) -> Any:
        """Like ``post`` for a body that is already JSON bytes (e.g. built once from ``encode``)."""
        headers = {**(headers or {}), "content-type": "application/json"}
        if request_id:
            headers["x-request-id"] = request_id
        tracing.inject(headers)  # traceparent of the render/derender span (nothing when tracing is off)
        first = self.pick(stage=stage, affinity=affinity)
        assert first is not None  # settings.endpoints is never empty
        try:
            return await self._send(first, path, content, headers, stage, affinity, decode)
        except _Retryable as failed:
            # Render and derender calls are safe to send twice: derender carries its whole state in
            # the call (a cached parser session that already moved on only misses and replays).
            # A broken pooled connection (the server closed it as idle just as the call went out:
            # a reset, or no answer) is retried on the same sidecar when it is the only one.
            second = self.pick(exclude=first, stage=stage) or (first if failed.broken else None)
            if second is None:
                raise failed.error from failed.__cause__
            log.info("%s on %s failed (%s); retrying on %s", stage, first.url, failed.error.message,
                     second.url)
        try:
            return await self._send(second, path, content, headers, stage, affinity, decode)
        except _Retryable as failed:
            raise failed.error from failed.__cause__

    async def call(self, sidecar: Sidecar, method: str, path: str,
                   body: Mapping[str, Any] | None = None) -> tuple[int, Any] | None:
        """One plain call to one sidecar (start-up questions): status and decoded body (None when it
        is not JSON); None when the sidecar did not answer."""
        try:
            resp = await sidecar.http.request(method, path, content=None if body is None else _encode(body),
                                              headers={"content-type": "application/json"},
                                              timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return None
        return resp.status_code, json_or_none(resp.content)

    async def _send(self, sidecar: Sidecar, path: str, content: bytes, headers: dict[str, str],
                    stage: str, affinity: Affinity | None = None,
                    decode: Callable[[bytes], Any] | None = None) -> Any:
        errors = stage_errors(stage)
        sidecar.outstanding += 1
        sidecar.calls += 1
        try:
            with sidecar.lanes.lane() as http:
                resp = await http.post(path, content=content, headers=headers)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            # Nothing listens (process gone or restarting): skip it for a while; when it is back it
            # may run other flags, so its derender features are asked again.
            sidecar.skip_until = self._clock() + self.settings.skip_s
            sidecar.relearn = True
            raise _Retryable(errors.unavailable(
                f"{stage} sidecar unreachable: {exc.__class__.__name__}")) from exc
        except httpx.TimeoutException as exc:
            # A slow sidecar is an overloaded one: a second attempt would only add load and latency.
            raise errors.timeout(f"{stage} sidecar timed out after {self.settings.timeout_s}s") from exc
        except httpx.TransportError as exc:
            # Connection broke under the call (sidecar died, or closed an idle keep-alive connection).
            raise _Retryable(errors.unavailable(
                f"{stage} sidecar unreachable: {exc.__class__.__name__}"), broken=True) from exc
        except httpx.HTTPError as exc:
            raise errors.unavailable(f"{stage} sidecar unreachable: {exc.__class__.__name__}") from exc
        finally:
            sidecar.outstanding -= 1
        sidecar.skip_until = 0.0
        if affinity is not None and resp.status_code < 500:
            affinity.sidecar = sidecar  # it answered: the stream's session (if any) is there now
        if resp.status_code >= 400:
            data = json_or_none(resp.content)
            status = resp.status_code
            if status in errors.unsupported_statuses and (status == 501 or not _is_model_404(data)):
                # The route is missing (an older or differently built sidecar): every sidecar of the
                # pool runs the same build, so asking another one would not help.
                log.error("%s sidecar %s answered %s on %s: %s is not available there", stage,
                          sidecar.url, status, path, stage)
                raise errors.unsupported(f"{stage} is not available on the render sidecar (HTTP {status})")
            if 400 <= status < 500:
                raise errors.rejected(status, data, f"{stage} rejected the request")
            log.warning("%s sidecar %s answered %s on %s: %s", stage, sidecar.url, status, path,
                        resp.text[:300])
            raise _Retryable(errors.unavailable(f"{stage} sidecar failed with HTTP {status}"))
        try:
            return (decode or _decode)(resp.content)
        except msgspec.ValidationError as exc:
            raise errors.unavailable(f"{stage} sidecar returned an unexpected body: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise errors.unavailable(f"{stage} sidecar returned invalid JSON") from exc

    async def models(self) -> list[dict[str, Any]]:
        """The model cards of the first sidecar that answers (all serve the same model)."""
        error: Exception = RuntimeError("no render sidecar configured")
        order = sorted(self.sidecars, key=lambda s: (s.skip_until > self._clock(), s.index))
        for sidecar in order:
            try:
                resp = await sidecar.http.get("/v1/models")
                resp.raise_for_status()
                data = _decode(resp.content).get("data", [])
            except (httpx.HTTPError, msgspec.DecodeError, AttributeError) as exc:
                error = exc
                continue
            return [m for m in data if isinstance(m, dict)]
        raise error

    async def health(self) -> dict[str, bool]:
        """``GET /health`` of every sidecar, concurrently; refreshes which ones are skipped."""
        async def probe(sidecar: Sidecar) -> bool:
            try:
                resp = await sidecar.http.get("/health", timeout=HEALTH_TIMEOUT_S)
            except httpx.HTTPError:
                sidecar.skip_until = self._clock() + self.settings.skip_s
                sidecar.relearn = True
                return False
            ok = resp.status_code == 200
            sidecar.skip_until = 0.0 if ok else self._clock() + self.settings.skip_s
            return ok

        results = await asyncio.gather(*(probe(s) for s in self.sidecars))
        return {s.url: ok for s, ok in zip(self.sidecars, results, strict=True)}

    async def healthy(self) -> bool:
        """At least one sidecar answers (the pool still serves every call then)."""
        return any((await self.health()).values())


def _is_model_404(data: Any) -> bool:
    """A 404 with an OpenAI error body is 'unknown model' (client error); a bare 404 is a missing route."""
    return isinstance(data, dict) and isinstance(data.get("error"), dict)
