"""OpenAI error bodies for the HTTP front door."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from coordinator.pipeline.errors import PipelineError, openai_param

log = logging.getLogger(__name__)


def error_body(message: str, type_: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def error_response(exc: PipelineError, request_id: str | None = None) -> JSONResponse:
    headers = {"X-Request-Id": request_id} if request_id else {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(exc.retry_after)
    if exc.headers:
        headers.update(exc.headers)
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def sse_error_frame(exc: BaseException) -> bytes:
    if isinstance(exc, PipelineError):
        body = exc.body()
    else:
        body = error_body("Internal server error", "InternalServerError", 500)
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def install_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI error body, including framework-level ones."""

    async def _pipeline(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, PipelineError)
        return error_response(exc, request.headers.get("x-request-id"))

    async def _http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        names = {404: "NotFoundError", 405: "MethodNotAllowed", 413: "RequestTooLarge"}
        return JSONResponse(error_body(str(exc.detail), names.get(exc.status_code, "Error"), exc.status_code),
                            status_code=exc.status_code)

    async def _validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        param = openai_param(".".join(str(p) for p in first.get("loc", ()))) or None
        message = f"Invalid value for '{param}': {first.get('msg', 'invalid request')}"
        return JSONResponse(error_body(message, "BadRequestError", 400, param), status_code=400)

    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body("Internal server error", "InternalServerError", 500), status_code=500)

    app.add_exception_handler(PipelineError, _pipeline)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(Exception, _unexpected)
