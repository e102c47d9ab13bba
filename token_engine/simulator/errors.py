"""vLLM 0.32's error bodies and exception handlers, reproduced for the simulator.

Why: a coordinator branches on status codes and sometimes on messages, so the simulator must fail the way
vLLM fails. Sources: `vllm/entrypoints/serve/exception_handling/` (handlers, `create_error_response`,
`sanitize_message`), `vllm/exceptions.py` and `vllm/v1/engine/exceptions.py`.
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import JSONResponse

ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
# vLLM 0.32 sampling_params.py (_validate_structured_outputs) and serve/tokenize: no tokenizer loaded.
STRUCTURED_OUTPUTS_NEED_TOKENIZER = (
    "Structured outputs requires a tokenizer so it can't be used with 'skip_tokenizer_init'")
NO_TOKENIZER_MESSAGE = "Tokenizer not available when `skip_tokenizer_init=True`"


class SimValidationError(Exception):
    """vLLM's VLLMValidationError: a client error that is *not* a ValueError.

    Raised inside pydantic validators it escapes pydantic untouched (as vLLM's does) and becomes a
    400 `BadRequestError` whose `param` is `parameter`.
    """

    def __init__(self, message: str, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value

    def __str__(self) -> str:
        base = super().__str__()
        extras = []
        if self.parameter is not None:
            extras.append(f"parameter={self.parameter}")
        if self.value is not None:
            extras.append(f"value={self.value}")
        return f"{base} ({', '.join(extras)})" if extras else base


class SimHTTPError(Exception):
    """An error answered with a fixed status, type and message (vLLM's create_error_response path)."""

    def __init__(
        self, message: str, err_type: str = "BadRequestError", status: int = 400, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.err_type = err_type
        self.status = status
        self.param = param


class GenerationError(Exception):
    """vLLM's GenerationError: the engine finished a request with finish_reason "error" (HTTP 500)."""

    def __init__(self, message: str = "Internal server error") -> None:
        super().__init__(message)


def sanitize_message(message: str) -> str:
    """Strip memory addresses, tracebacks and file paths, like vLLM does before answering."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's `ErrorResponse.model_dump()`: key order message, type, param, code."""
    return {"error": {"message": sanitize_message(message), "type": err_type, "param": param, "code": code}}


def error_for_exception(exc: Exception) -> dict[str, Any]:
    """vLLM's `create_error_response(exc)` for the exception kinds the simulator raises."""
    if isinstance(exc, SimValidationError):
        return error_body(str(exc), "BadRequestError", 400, exc.parameter)
    if isinstance(exc, SimHTTPError):
        return error_body(exc.message, exc.err_type, exc.status, exc.param)
    if isinstance(exc, GenerationError):
        return error_body(str(exc), "InternalServerError", 500)
    if isinstance(exc, ValueError | TypeError | OverflowError):
        return error_body(str(exc), "BadRequestError", 400)
    if isinstance(exc, NotImplementedError):
        return error_body(str(exc), "NotImplementedError", 501)
    return error_body(str(exc), "InternalServerError", 500)


def streaming_error_data(exc: Exception) -> str:
    """The post-200 error event payload: vLLM uses plain `json.dumps` here (spaces after separators)."""
    return json.dumps(error_for_exception(exc))


def _json(body: dict[str, Any], status: int) -> JSONResponse:
    return JSONResponse(body, status_code=status)


# --- RequestValidationError → 400, exactly as vllm/.../handlers/validation.py --------------------------

_BRACKETED_INTERNAL_RE = re.compile(r"[\[\]{}()]")
_INTERNAL_LOC_MARKERS = frozenset(
    {
        "function-wrap", "function-after", "function-before", "function-plain", "json-or-python",
        "lax-or-strict", "chain", "default", "nullable", "tagged-union", "union", "call", "arguments",
        "is-instance", "is-subclass", "callable", "str", "int", "float", "bool", "bytes", "bytearray",
        "list", "tuple", "dict", "set", "frozenset", "complex", "none", "nonetype",
    }
)  # fmt: skip
_MAX_REPORTED_ERRORS = 10
_MAX_ERROR_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000


def _summarize_error_input(value: object) -> object:
    if isinstance(value, str):
        if len(value) > _MAX_ERROR_INPUT_CHARS:
            return value[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
        return value
    if isinstance(value, bytes | bytearray):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = str(value)
    except Exception:
        return f"<{type(value).__name__}>"
    if len(text) > _MAX_ERROR_INPUT_CHARS:
        return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
    return text


def _is_internal_loc_segment(segment: str) -> bool:
    return bool(_BRACKETED_INTERNAL_RE.search(segment)) or segment.lower() in _INTERNAL_LOC_MARKERS


def clean_loc_for_param(loc: tuple[Any, ...]) -> str:
    """('body', 'function-wrap[...]', 'x') → "body.x", as vLLM reports `param`."""
    parts = [str(p) for p in loc if not _is_internal_loc_segment(str(p))]
    if not parts:
        return ".".join(str(p) for p in loc)
    return ".".join(parts)


def _format_error(err: object) -> str:
    if isinstance(err, dict):
        err = dict(err)
        if "input" in err:
            err["input"] = _summarize_error_input(err["input"])
        loc = err.get("loc")
        if isinstance(loc, tuple | list):
            err["loc"] = clean_loc_for_param(tuple(loc))
    text = str(err)
    if len(text) > _MAX_ERROR_CHARS:
        text = text[:_MAX_ERROR_CHARS] + "...[truncated]"
    return text


async def validation_exception_handler(_req: Request, exc: Exception) -> JSONResponse:
    """400 `Bad Request` with vLLM's message text and cleaned `param` (never FastAPI's 422)."""
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    param: str | None = None
    for error in errors:
        ctx = error.get("ctx") if isinstance(error, dict) else None
        if isinstance(ctx, dict) and isinstance(ctx.get("error"), SimValidationError):
            param = ctx["error"].parameter
            break
    if param is None and errors:
        first = errors[0]
        loc = first.get("loc") if isinstance(first, dict) else None
        if loc:
            param = clean_loc_for_param(tuple(loc))
    if errors:
        count = len(errors)
        label = "error" if count == 1 else "errors"
        reported = errors[:_MAX_REPORTED_ERRORS]
        message = f"{count} validation {label}:\n"
        message += "".join(f"  {_format_error(err)}\n" for err in reported)
        if count > len(reported):
            message += f"  ...and {count - len(reported)} more {label}\n"
        message = message.rstrip()
    else:
        message = "Validation error"
    return _json(error_body(message, HTTPStatus.BAD_REQUEST.phrase, 400, param), 400)


async def http_exception_handler(_req: Request, exc: Exception) -> JSONResponse:
    """HTTPException → `{"error": {..., "type": "<HTTP phrase>"}}`; unknown paths keep FastAPI's 404."""
    assert isinstance(exc, HTTPException)
    body = error_body(str(exc.detail), HTTPStatus(exc.status_code).phrase, exc.status_code)
    return _json(body, exc.status_code)


async def generic_exception_handler(_req: Request, exc: Exception) -> JSONResponse:
    body = error_for_exception(exc)
    return _json(body, int(body["error"]["code"]))


def install_exception_handlers(app: FastAPI) -> None:
    """Register the handlers in vLLM's layering (framework errors, vLLM errors, raw exceptions)."""
    app.add_exception_handler(HTTPException, http_exception_handler)
    app.add_exception_handler(RequestValidationError, validation_exception_handler)
    for exc_type in (
        SimValidationError, SimHTTPError, GenerationError, ValueError, TypeError, OverflowError,
        NotImplementedError, Exception,
    ):  # fmt: skip
        app.add_exception_handler(exc_type, generic_exception_handler)


def validate_json_request(request: Request) -> None:
    """vLLM's `validate_json_request` dependency: only `application/json` bodies are accepted."""
    content_type = request.headers.get("content-type", "").lower()
    if content_type.split(";", maxsplit=1)[0] != "application/json":
        raise RequestValidationError(errors=["Unsupported Media Type: Only 'application/json' is allowed"])
