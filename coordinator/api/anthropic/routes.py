"""Thin Anthropic Messages routes: convert the request to chat → the chat pipeline → write Anthropic.

A Messages request takes the whole chat path (``pipeline/messages/translate.py``); only the way
credentials arrive, errors look and the answer is written differ (docs/anthropic-api.md). When the
sidecar cannot convert it, it goes as it is to an engine's own ``/v1/messages`` (the native chain,
``pipeline/native_api.py``) and the engine's answer comes back as it is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from coordinator.api.auth import ApiKeyCheck
from coordinator.api.body import read_json_body
from coordinator.api.door import OnError, Prepared, Wire, client_request_id, passthrough_wire, serve_http
from coordinator.config import Settings
from coordinator.observability.record import Record
from coordinator.pipeline.admission.tenants import Tenant
from coordinator.pipeline.chat_form import ConversionUnavailable
from coordinator.pipeline.context import ChunkStream
from coordinator.pipeline.errors import PipelineError
from coordinator.pipeline.messages.convert import MessageStream, error_event, to_message
from coordinator.pipeline.messages.translate import MessagesTranslator, in_messages_terms
from coordinator.pipeline.service import Pipeline

OPERATION = "messages.create"
_encode = msgspec.json.Encoder().encode

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
          503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


def error_response(exc: PipelineError, request_id: str | None = None) -> JSONResponse:
    """``{"type": "error", "error": {"type", "message"}}`` with the pipeline error's status."""
    exc = in_messages_terms(exc)
    headers = {"X-Request-Id": request_id, "request-id": request_id} if request_id else {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(exc.retry_after)
    if exc.headers:
        headers.update(exc.headers)
    return JSONResponse({"type": "error", "error": {"type": error_type(exc.status), "message": exc.message}},
                        status_code=exc.status, headers=headers)


def frame(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _encode(data) + b"\n\n"


async def message_events(session: ChunkStream, on_error: OnError, record: Record) -> AsyncIterator[bytes]:
    """The chat chunks as Anthropic events; a failure after the first byte is an ``error`` event."""
    convert = MessageStream()
    try:
        async for chunk in session.events():
            for name, data in convert.feed(chunk):
                record.output_event()
                yield frame(name, data)
    except Exception as exc:
        on_error(exc)
        record.fail(exc)
        if isinstance(exc, PipelineError):
            yield frame(*error_event(error_type(exc.status), exc.message))
        else:
            yield frame(*error_event("api_error", "Internal server error"))
        return
    for name, data in convert.finish():
        yield frame(name, data)
    record.complete()


def stream_error(exc: PipelineError | None) -> dict[str, Any]:
    """Anthropic's ``error`` event for a failure after the stream started."""
    if exc is None:
        return error_event("api_error", "Internal server error")[1]
    exc = in_messages_terms(exc)
    return error_event(error_type(exc.status), exc.message)[1]


def build_router(pipeline: Pipeline, translator: MessagesTranslator, auth: ApiKeyCheck,
                 settings: Settings) -> APIRouter:
    router = APIRouter()
    wire = Wire(error=error_response, body=lambda chat, _: to_message(chat),
                stream=lambda session, on_error, record, _: message_events(session, on_error, record))
    native_wire = passthrough_wire(error_response, stream_error)

    async def prepare(body: Any, request_id: str, _: Tenant) -> Any:
        try:
            return await translator.chat(body, request_id)
        except ConversionUnavailable as exc:
            return Prepared(body, native_wire, native=exc.call)

    def authorize(request: Request) -> Tenant:
        """Anthropic clients send ``x-api-key``; ``Authorization: Bearer`` works too."""
        key = request.headers.get("x-api-key")
        return auth(f"Bearer {key}" if key is not None else request.headers.get("authorization"))

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await serve_http(request, pipeline, settings, kind="chat", operation=OPERATION,
                                authorize=authorize, wire=wire, prepare=prepare)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        """Render's token count of the prompt the request would run (vLLM's answer shape)."""
        request_id = client_request_id(request.headers.get("x-request-id"),
                                       settings.limits.request_id_max_length)
        try:
            authorize(request)
            body = await read_json_body(request.stream(), max_bytes=settings.server.max_body_bytes,
                                        max_depth=settings.limits.max_json_depth,
                                        timeout_s=settings.limits.body_timeout_s)
            try:
                chat = await translator.count_tokens_chat(body, request_id)
                tokens = await pipeline.prompt_tokens("chat", chat, request_id)
            except ConversionUnavailable as exc:  # the native chain: an engine counts
                tokens = await pipeline.native_count_tokens(exc.call, body, request_id)
        except PipelineError as exc:
            return error_response(exc, request_id)
        return JSONResponse({"input_tokens": tokens, "context_management": {"original_input_tokens": tokens}},
                            headers={"X-Request-Id": request_id})

    return router
