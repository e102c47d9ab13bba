"""The events an operation's results are made of, and the profile's errors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict

from coordinator.nnrp.profile.constants import BAD_REQUEST_TYPE, CANCEL_SOURCES, CANCELLED, ERROR


class OpenAIErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | int | None


class OpenAIErrorBody(TypedDict):
    error: OpenAIErrorDetail


class TextDeltaEvent(TypedDict):
    type: Literal["response.output_text.delta"]
    choice_index: int
    delta: str
    openai_chunk: NotRequired[Mapping[str, Any]]
    extensions: NotRequired[dict[str, Any]]


class ToolCallDeltaEvent(TypedDict):
    type: Literal["response.tool_call.delta"]
    choice_index: int
    tool_call: Mapping[str, Any]  # the OpenAI ``delta.tool_calls[]`` entry, unchanged
    openai_chunk: NotRequired[Mapping[str, Any]]
    extensions: NotRequired[dict[str, Any]]


class UsageEvent(TypedDict):
    type: Literal["response.usage"]
    usage: Mapping[str, Any]
    openai_chunk: NotRequired[Mapping[str, Any]]
    extensions: NotRequired[dict[str, Any]]


class ChoiceFinish(TypedDict):
    index: int
    finish_reason: str | None


class CompletedEvent(TypedDict):
    type: Literal["response.completed"]
    id: str | None
    model: str | None
    finish_reason: str | None  # choice 0's; ``choices`` has every choice's
    choices: list[ChoiceFinish]
    response: NotRequired[Mapping[str, Any]]  # the whole chat.completion (non-streaming only)
    extensions: NotRequired[dict[str, Any]]


class ErrorEvent(TypedDict):
    type: Literal["response.error"]
    status: int
    error: OpenAIErrorDetail
    openai_chunk: NotRequired[Mapping[str, Any]]
    extensions: NotRequired[dict[str, Any]]


class CancelDiagnostics(TypedDict):
    source: str
    reason: str
    operation_id: str | None
    engine_abort_accepted: bool | None


class CancelledEvent(TypedDict):
    type: Literal["response.cancelled"]
    diagnostics: CancelDiagnostics
    extensions: NotRequired[dict[str, Any]]


Event = TextDeltaEvent | ToolCallDeltaEvent | UsageEvent | CompletedEvent | ErrorEvent | CancelledEvent
# What one chunk can give: these are the events that may carry ``openai_chunk``.
ChunkEvent = TextDeltaEvent | ToolCallDeltaEvent | UsageEvent | ErrorEvent


class ProfileError(Exception):
    """A submit the profile refuses, with the OpenAI error body and event the client gets for it.

    ``code`` is one of ``ERROR_CODES``; ``param`` is the path inside the envelope (``body.timeout_ms``,
    ``extensions[1]``) so a client sees which part of its submit was wrong.
    """

    def __init__(self, code: str, message: str, *, param: str | None = None, status: int = 400,
                 type_: str = BAD_REQUEST_TYPE) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.status = status
        self.type = type_

    def detail(self) -> OpenAIErrorDetail:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def body(self) -> OpenAIErrorBody:
        return {"error": self.detail()}

    def event(self) -> ErrorEvent:
        return {"type": ERROR, "status": self.status, "error": self.detail()}


class ManifestError(ValueError):
    """A capability document that does not follow the profile (``path`` names the offending member)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


def error_event(detail: Mapping[str, Any], status: int | None = None) -> ErrorEvent:
    """``response.error`` from an OpenAI error detail, e.g. a pipeline error's ``body()["error"]``.

    Without an explicit status the integer ``code`` the HTTP door puts there is used, else 500; the
    four members are always present so clients can read the body exactly as over HTTP.
    """
    code = detail.get("code")
    if status is None:
        status = code if type(code) is int and 400 <= code <= 599 else 500
    param = detail.get("param")
    return {"type": ERROR, "status": status, "error": {
        "message": str(detail.get("message") or "Internal server error"),
        "type": str(detail.get("type") or "InternalServerError"),
        "param": param if isinstance(param, str) else None,
        "code": code if isinstance(code, str | int) and not isinstance(code, bool) else None,
    }}


def cancelled_event(source: str, reason: str, *, operation_id: str | None = None,
                    engine_abort_accepted: bool | None = None) -> CancelledEvent:
    """``response.cancelled``; ``engine_abort_accepted`` is None when the engine had not answered the abort
    (or no engine request existed) by the time the event had to go out, which is immediately."""
    if source not in CANCEL_SOURCES:
        raise ValueError(f"cancel source must be one of {CANCEL_SOURCES}, not {source!r}")
    diagnostics: CancelDiagnostics = {"source": source, "reason": reason, "operation_id": operation_id,
                                      "engine_abort_accepted": engine_abort_accepted}
    return {"type": CANCELLED, "diagnostics": diagnostics}


