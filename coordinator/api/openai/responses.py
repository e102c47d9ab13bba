"""Thin OpenAI Responses route: convert the request to chat → the chat pipeline → write Responses.

A Responses request takes the whole chat path (``pipeline/responses/translate.py``); what differs
is the answer: the response object vLLM echoes for the request, output items instead of a message,
and a typed event stream (docs/openai-api.md, "Responses"). When the sidecar cannot convert it, it
goes as it is to an engine's own ``/v1/responses`` (the native chain, ``pipeline/native_api.py``)
and the engine's answer comes back as it is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from coordinator.api.auth import ApiKeyCheck
from coordinator.api.door import OnError, Prepared, Wire, passthrough_wire, serve_http
from coordinator.api.openai.errors import error_response
from coordinator.config import Settings
from coordinator.observability.record import Record
from coordinator.pipeline.admission.tenants import Tenant
from coordinator.pipeline.chat_form import ConversionUnavailable
from coordinator.pipeline.context import ChunkStream, RequestContext
from coordinator.pipeline.errors import PipelineError
from coordinator.pipeline.responses.answer import ResponseEvents, to_response
from coordinator.pipeline.responses.convert import Event, ResponsesForm
from coordinator.pipeline.responses.translate import ResponsesTranslator, in_responses_terms
from coordinator.pipeline.service import Pipeline

OPERATION = "responses.create"
_encode = msgspec.json.Encoder().encode


def responses_error(exc: PipelineError, request_id: str | None = None) -> JSONResponse:
    """OpenAI's error body, naming the Responses field the client wrote."""
    return error_response(in_responses_terms(exc), request_id)


def _frame(event: Event) -> bytes:
    """A numbered event framed as vLLM frames it: ``event: <type>\\ndata: <json>\\n\\n``."""
    name = str(event["type"]).encode()
    return b"event: " + name + b"\ndata: " + _encode(event) + b"\n\n"


async def response_events(form: ResponsesForm, session: ChunkStream, on_error: OnError, record: Record,
                          ctx: RequestContext) -> AsyncIterator[bytes]:
    """``response.created`` and ``response.in_progress``, the output items' events, then
    ``response.completed``; a failure after the first byte is an ``error`` event, and the stream ends.
    The events and their numbers are ``ResponseEvents``', which NNRP sends too."""
    events = ResponseEvents(form, ctx)
    for event in events.start():
        yield _frame(event)
    try:
        async for chunk in session.events():
            for event in events.feed(chunk):
                record.output_event()
                yield _frame(event)
    except Exception as exc:
        on_error(exc)
        record.fail(exc)
        err = in_responses_terms(exc) if isinstance(exc, PipelineError) else None
        yield _frame(events.number({"type": "error", "code": err.type if err else "InternalServerError",
                                    "message": err.message if err else "Internal server error",
                                    "param": err.param if err else None}))
        return
    for event in events.close():
        yield _frame(event)
    yield _frame(events.completed())
    record.complete()


def stream_error(exc: PipelineError | None) -> dict[str, Any]:
    """The Responses ``error`` event for a failure after the stream started (no sequence number: the
    engine's events carry theirs)."""
    err = in_responses_terms(exc) if exc is not None else None
    return {"type": "error", "code": err.type if err else "InternalServerError",
            "message": err.message if err else "Internal server error", "param": err.param if err else None}


def wire_for(form: ResponsesForm) -> Wire:
    """How one Responses request's answer is written (it echoes that request's fields)."""
    return Wire(error=responses_error, body=lambda chat, ctx: to_response(form, chat, ctx),
                stream=lambda session, on_error, record, ctx: response_events(form, session, on_error,
                                                                              record, ctx))


def build_router(pipeline: Pipeline, translator: ResponsesTranslator, auth: ApiKeyCheck,
                 settings: Settings) -> APIRouter:
    router = APIRouter()
    # Errors before the conversion (credentials, the body) are written by this wire.
    default = Wire(error=responses_error, body=lambda chat, _: chat,
                   stream=lambda *_: _no_stream())

    def authorize(request: Request) -> Tenant:
        return auth(request.headers.get("authorization"))

    native_wire = passthrough_wire(responses_error, stream_error)

    async def prepare(body: Any, request_id: str) -> Prepared:
        try:
            form = await translator.form(body, request_id)
        except ConversionUnavailable as exc:
            return Prepared(body, native_wire, native=exc.call)
        return Prepared(form.chat, wire_for(form))

    @router.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await serve_http(request, pipeline, settings, kind="chat", operation=OPERATION,
                                authorize=authorize, wire=default, prepare=prepare)

    return router


async def _no_stream() -> AsyncIterator[bytes]:  # pragma: no cover - prepare always sets the wire
    raise AssertionError("a Responses request is written by its own wire")
    yield b""
