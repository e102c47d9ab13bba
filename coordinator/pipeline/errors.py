"""Pipeline errors: HTTP-free, but each knows the OpenAI status/type a front door should use.

Every stage raises one of these; the front doors turn them into the OpenAI error body
``{"error": {"message", "type", "param", "code"}}`` (JSON) or an SSE ``data: {"error": ...}`` frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)


class PipelineError(Exception):
    """Base: a failure with a client-facing status code and OpenAI error type."""

    status: int = 500
    type: str = "InternalServerError"
    retry_after: int | None = None  # seconds; front doors send it as ``Retry-After``
    headers: dict[str, str] | None = None  # more response headers (a rate limit's x-ratelimit-*)

    def __init__(self, message: str, *, param: str | None = None, status: int | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}


class BadRequest(PipelineError):
    status = 400
    type = "BadRequestError"


class Unauthorized(PipelineError):
    status = 401
    type = "AuthenticationError"


class ModelNotFound(PipelineError):
    status = 404
    type = "NotFoundError"


class UpstreamClientError(PipelineError):
    """A 4xx answered by the sidecar or an engine for the client's request, in the client's terms.

    vLLM answers pydantic failures with a dump of every union branch it tried (``'loc':
    'body.messages.0.ChatCompletionDeveloperMessageParam.content'``) and some refusals with the CLI
    flags that would enable a feature. Clients get the first real problem with the OpenAI field path
    as ``param``; operator hints go to the log (``hint``)."""

    def __init__(self, status: int, body: dict[str, Any] | None, fallback: str) -> None:
        err = (body or {}).get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):
            message = str(err.get("message") or fallback)
            etype = str(err.get("type") or "BadRequestError")
            param = err.get("param") if isinstance(err.get("param"), str) else None
        else:
            message, etype, param = fallback, "BadRequestError", None
        if etype == "Bad Request":  # vLLM's pydantic-validation type; OpenAI clients expect the class name
            etype = "BadRequestError"
        self.hint: str | None = None
        dump = _pydantic_dump(message)
        if dump is not None:
            message, param = dump
        elif _CLI_FLAG.search(message):
            self.hint = message
            param = param or _feature_param(message)
            message = (f"'{param}' is not supported by this server for this model" if param
                       else "This server does not support that feature for this model")
            log.warning("a client request needs an upstream option that is not enabled: %s", self.hint)
        if param is not None:
            param = openai_param(param)
        super().__init__(message, param=param, status=status, type=etype)


class EngineBusy(UpstreamClientError):
    """An engine answered 408, 425, 429 or 503 with a body: it is alive but would not take the
    request now (vLLM's own admission, a proxy's rate limit). Another engine may take it before the
    first byte; if none does, the engine's status and message reach the client as they were."""


BUSY_STATUSES = frozenset({408, 425, 429, 503})


_PYDANTIC_ITEM = re.compile(
    r"'type': '(?P<type>[^']*)', 'loc': '(?P<loc>[^']*)', 'msg': (?P<q>['\"])(?P<msg>.*?)(?P=q)")
_CLI_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")
_CLASS_SEGMENT = re.compile(r"^[A-Z][A-Za-z0-9]*(\[.*\])?$|^function-")


def openai_param(loc: str) -> str:
    """``body.messages.0.ChatCompletionUserMessageParam.content`` → ``messages[0].content``."""
    parts = [p for p in loc.split(".") if p and p != "body" and not _CLASS_SEGMENT.match(p)]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or loc


def _pydantic_dump(message: str) -> tuple[str, str] | None:
    """The first error of a pydantic dump as ``(message, param)``; union-branch mismatches (a literal
    that picks the branch) only when nothing else is wrong."""
    items = [m.groupdict() for m in _PYDANTIC_ITEM.finditer(message)]
    if not items:
        return None
    real = [i for i in items if i["type"] != "literal_error"] or items
    # The deepest location is the most specific one the user can fix.
    best = max(real, key=lambda i: len(openai_param(i["loc"]).replace("[", ".").split(".")))
    param = openai_param(best["loc"])
    return f"Invalid value for '{param}': {best['msg']}", param


def _feature_param(hint: str) -> str | None:
    for field in ("thinking_token_budget", "tool_choice", "response_format", "reasoning", "tools"):
        if field in hint or field.replace("_", " ") in hint:
            return field
    return None


class RequestTooLarge(PipelineError):
    status = 413
    type = "RequestTooLarge"


class RequestTimeout(PipelineError):
    """The client did not deliver its request (headers or body) in time."""

    status = 408
    type = "RequestTimeout"


class VocabularyUnknown(PipelineError):
    """Token ids cannot be checked (the model's vocabulary size is not known): fail closed."""

    status = 503
    type = "ServiceUnavailableError"


class NoHealthyEngine(PipelineError):
    status = 503
    type = "ServiceUnavailableError"


class Overloaded(PipelineError):
    """Admission refused the request; the client should come back after ``retry_after`` seconds."""

    def __init__(self, message: str, *, status: int, type: str, retry_after: int) -> None:
        super().__init__(message, status=status, type=type)
        self.retry_after = retry_after


class QueueFull(Overloaded):
    """429: the waiting queue is full (OpenAI's rate-limit status, which SDKs retry with backoff)."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message, status=429, type="RateLimitError", retry_after=retry_after)


class RateLimited(PipelineError):
    """429: the tenant's requests or tokens per minute are spent (``rate_limits.py``); ``limit`` says
    which. The body is the usual error body (its message names the limit); the headers carry the
    bucket's state as OpenAI sends it."""

    status = 429
    type = "RateLimitError"

    def __init__(self, message: str, *, retry_after_s: float | None, headers: dict[str, str],
                 code: str) -> None:
        super().__init__(message)
        self.limit = code
        self.headers = dict(headers)
        if retry_after_s is not None:
            self.retry_after = max(1, math.ceil(retry_after_s))
            # OpenAI's SDKs read this one first: the wait to the millisecond.
            self.headers["retry-after-ms"] = str(max(1, math.ceil(retry_after_s * 1000)))


class QueueTimeout(Overloaded):
    """503: the request waited ``queue_timeout_s`` without capacity freeing up."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message, status=503, type="ServiceUnavailableError", retry_after=retry_after)


class UpstreamUnavailable(PipelineError):
    """The sidecar or an engine could not be reached or failed (5xx)."""

    status = 502
    type = "BadGatewayError"


class TokenRouteMissing(UpstreamUnavailable):
    """An engine answered a bare 404 or a 501 on ``/inference/v1/generate``: it does not serve the
    token-only route (not a failure of the request). Another engine may; if none does and nothing was
    sent yet, the request may take the native route (docs/decisions.md)."""


class RelayDiverged(PipelineError):
    """A grammar-constrained stream regenerated on another engine after a failure came out different
    from what the client already has (``topology/engine_stream.py``): it cannot go on. Never relayed."""

    status = 502
    type = "BadGatewayError"


class UpstreamTimeout(PipelineError):
    status = 504
    type = "GatewayTimeoutError"


class ResponseStageError(PipelineError):
    """Derender (the response stage) failed after inference ran.

    Deliberately not an ``Upstream*`` error: no engine retry, relay or breaker rule matches it, so a
    derender failure never re-runs prefill or decode and never counts against an engine: the engine
    did its part. Used as is when the sidecar has no derender route (bare 404/405/501): a deployment
    fault, so it has its own ``type``."""

    status = 502
    type = "ResponseStageError"


class DerenderRejected(ResponseStageError):
    """The sidecar refused a derender call (400/422, e.g. an invalid ``stream_state``): its status and
    detail, in the client's terms as for any sidecar 4xx."""

    def __init__(self, status: int, body: dict[str, Any] | None, fallback: str) -> None:
        parsed = UpstreamClientError(status, body, fallback)
        super().__init__(parsed.message, param=parsed.param, status=status, type=parsed.type)
        self.hint = parsed.hint


class DerenderUnavailable(ResponseStageError):
    """The sidecar could not be reached for derender, failed (5xx) or answered a malformed body."""

    type = "BadGatewayError"


class DerenderTimeout(ResponseStageError):
    status = 504
    type = "GatewayTimeoutError"


class ClientGone(Exception):
    """The client left before its answer (or its stream) was ready; nothing is owed to it."""


Gone = Callable[[], Awaitable[None]]  # completes when the client has left
T = TypeVar("T")


async def unless_gone(gone: Gone | None, work: Awaitable[T]) -> T:
    """Run ``work`` but cancel it (releasing everything it holds) if the client leaves first."""
    if gone is None:
        return await work
    main = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({main, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not main.done():
            main.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await main
            watch.cancel()
            raise ClientGone()
        watch.cancel()
    return main.result()


def first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first real error inside a task group's exception group (what the client should see)."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
