"""What an engine's HTTP answer means, for both engine clients (the token route and the engine's own
OpenAI routes): one place decides which failures another engine may retry and which are the
client's, so the two routes cannot drift apart.

The rules: no connection is ``EngineUnreachable`` (the engine never saw the request, safe anywhere
else); a timeout may leave the request running (the token client aborts it); a busy answer with a
body (the engine's own admission) may go elsewhere; a 4xx with an OpenAI error body is the client's
answer; a bare 401 is the coordinator's credential, never the client's; the rest is the engine's
failure (502/504).
"""

from __future__ import annotations

from typing import Any

import httpx

from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.errors import (
    BUSY_STATUSES,
    EngineBusy,
    PipelineError,
    TokenRouteMissing,
    UpstreamClientError,
    UpstreamTimeout,
    UpstreamUnavailable,
)

_SCALE_OUT_DISABLED = "Scale-out endpoints are disabled"


class EngineStreamError(UpstreamUnavailable):
    """The engine reported an error inside a stream that had already started."""


class EngineUnreachable(UpstreamUnavailable):
    """No connection could be made: the request never reached the engine, so another may take it."""


def send_failed(engine: Engine, exc: httpx.HTTPError) -> UpstreamUnavailable | UpstreamTimeout:
    """A request that got no answer: unreachable (never seen), timed out (may be running), or broken."""
    name = exc.__class__.__name__
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return EngineUnreachable(f"engine {engine.url} unreachable: {name}")
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"engine {engine.url} timed out")
    return UpstreamUnavailable(f"engine {engine.url} unreachable: {name}")


def stream_failed(engine: Engine, exc: httpx.HTTPError) -> UpstreamUnavailable | UpstreamTimeout:
    """An open stream that stopped: stalled past the idle timeout, or cut."""
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"engine {engine.url} stream stalled")
    return UpstreamUnavailable(f"engine {engine.url} stream broke: {exc.__class__.__name__}")


def stream_error_event(engine: Engine, error: Any, *, before_output: bool) -> PipelineError:
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


def credential_refused(engine: Engine, status: int, data: Any) -> None:
    """vLLM's ``--api-key`` answers a bare ``{"error": "Unauthorized"}`` 401: the coordinator's
    credential for this engine is missing or wrong, and the client is not at fault (a 502 saying so,
    not the engine's 401 passed on as if the client's key were bad)."""
    if status == 401 and not _has_error_body(data):
        raise UpstreamUnavailable(f"engine {engine.url} refused the coordinator's credential (HTTP 401): "
                                  "set engines[].api_key to the engine's --api-key")


def raise_for_token_route(engine: Engine, status: int, data: Any) -> None:
    """``/inference/v1/generate``'s status. A missing route (a bare 404, 501, or the 403 of an engine
    without ``--enable-scale-out``) is ``TokenRouteMissing``, which may send the request to the
    engine's own API; a model 404 with an OpenAI body is the client's."""
    if status == 200:
        return
    if status == 403 and _SCALE_OUT_DISABLED in str(data["error"].get("message", "")
                                                    if _has_error_body(data) else ""):
        # A plain `vllm serve` (no --enable-scale-out) refuses the token route with this 403: the
        # engine is healthy, the route is missing, not the client's fault.
        raise TokenRouteMissing(f"engine {engine.url} has the scale-out routes disabled (HTTP 403)")
    credential_refused(engine, status, data)
    if status in BUSY_STATUSES:
        raise EngineBusy(status, data, f"engine {engine.url} is busy (HTTP {status})")
    if 400 <= status < 500 and status != 404:
        raise UpstreamClientError(status, data, f"engine {engine.url} rejected the request")
    if status == 404 and _has_error_body(data):
        raise UpstreamClientError(status, data, "engine does not serve this model")
    if status in (404, 501):  # a bare 404 (no OpenAI error body) or 501: no token-only route here
        raise TokenRouteMissing(f"engine {engine.url} does not serve /inference/v1/generate "
                                f"(HTTP {status})")
    raise UpstreamUnavailable(f"engine {engine.url} failed with HTTP {status}")


def raise_for_openai_route(engine: Engine, status: int, data: Any) -> None:
    """The status of one of the engine's own OpenAI routes. Only answers with an OpenAI error body
    are the engine's verdict on the request; a bare 4xx (a route this engine lacks) and 5xx are its
    failure."""
    if status == 200:
        return
    credential_refused(engine, status, data)
    if status in BUSY_STATUSES and _has_error_body(data):
        raise EngineBusy(status, data, f"engine {engine.url} is busy (HTTP {status})")
    if 400 <= status < 500 and _has_error_body(data):
        raise UpstreamClientError(status, data, f"engine {engine.url} rejected the request")
    raise UpstreamUnavailable(f"engine {engine.url} failed with HTTP {status} on its OpenAI API")


def _has_error_body(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("error"), dict)
