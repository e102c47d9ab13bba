"""Pipeline errors: HTTP-free, but each knows the OpenAI status/type a front door should use.

Every stage raises one of these; the front doors turn them into the OpenAI error body
``{"error": {"message", "type", "param", "code"}}`` (JSON) or an SSE ``data: {"error": ...}`` frame.
"""

from __future__ import annotations

from typing import Any


class PipelineError(Exception):
    """Base: a failure with a client-facing status code and OpenAI error type."""

    status: int = 500
    type: str = "InternalServerError"
    retry_after: int | None = None  # seconds; front doors send it as ``Retry-After``

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
    """A 4xx answered by the sidecar or an engine for the client's request: passed through as is."""

    def __init__(self, status: int, body: dict[str, Any] | None, fallback: str) -> None:
        err = (body or {}).get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):
            message = str(err.get("message") or fallback)
            etype = str(err.get("type") or "BadRequestError")
            param = err.get("param")
        else:
            message, etype, param = fallback, "BadRequestError", None
        if etype == "Bad Request":  # vLLM's pydantic-validation type; OpenAI clients expect the class name
            etype = "BadRequestError"
        super().__init__(message, param=param if isinstance(param, str) else None, status=status, type=etype)


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


class QueueTimeout(Overloaded):
    """503: the request waited ``queue_timeout_s`` without capacity freeing up."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message, status=503, type="ServiceUnavailableError", retry_after=retry_after)


class UpstreamUnavailable(PipelineError):
    """The sidecar or an engine could not be reached or failed (5xx)."""

    status = 502
    type = "BadGatewayError"


class UpstreamTimeout(PipelineError):
    status = 504
    type = "GatewayTimeoutError"
