"""Thin OpenAI Responses route: convert the request to chat → the chat pipeline → write Responses.

A Responses request takes the whole chat path (``pipeline/responses/translate.py``); what differs
is the answer: the response object vLLM echoes for the request, output items instead of a message,
and a typed event stream (docs/openai-api.md, "Responses").
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from coordinator.api.auth import ApiKeyCheck
from coordinator.api.door import OnError, Prepared, Wire, serve_http
from coordinator.api.openai.errors import error_response
from coordinator.config import Settings
from coordinator.observability.record import Record
from coordinator.pipeline.context import RequestContext
from coordinator.pipeline.errors import PipelineError
from coordinator.pipeline.native_route import ChunkStream
from coordinator.pipeline.responses.convert import (
    Event,
    ResponsesForm,
    ResponseStream,
    envelope,
    output_items,
    status_of,
    usage,
)
from coordinator.pipeline.responses.translate import ResponsesTranslator, in_responses_terms
from coordinator.pipeline.service import Pipeline

OPERATION = "responses.create"
_encode = msgspec.json.Encoder().encode


def responses_error(exc: PipelineError, request_id: str | None = None) -> JSONResponse:
    """OpenAI's error body, naming the Responses field the client wrote."""
    return error_response(in_responses_terms(exc), request_id)


def _id(ctx: RequestContext) -> str:
    return f"resp_{ctx.request_id}"


def _max_output_tokens(ctx: RequestContext) -> int:
    return ctx.prompts[0].max_tokens if ctx.prompts else 0


def to_response(form: ResponsesForm, chat: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
    """The chat completion as a Responses response object."""
    choice = (chat.get("choices") or [{}])[0]
    return envelope(form, response_id=_id(ctx), model=ctx.model, created=ctx.created,
                    max_output_tokens=_max_output_tokens(ctx), output=output_items(chat, form),
                    status=status_of(choice.get("finish_reason")), usage=usage(chat.get("usage")))


class _Frames:
    """Numbers events in the order they are written (``sequence_number``) and frames them as vLLM
    does: ``event: <type>\\ndata: <json>\\n\\n``."""

    def __init__(self) -> None:
        self._next = 0

    def __call__(self, event: Event) -> bytes:
        data = {**event, "sequence_number": self._next}
        self._next += 1
        name = str(event["type"]).encode()
        return b"event: " + name + b"\ndata: " + _encode(data) + b"\n\n"


async def response_events(form: ResponsesForm, session: ChunkStream, on_error: OnError, record: Record,
                          ctx: RequestContext) -> AsyncIterator[bytes]:
    """``response.created`` and ``response.in_progress``, the output items' events, then
    ``response.completed``; a failure after the first byte is an ``error`` event, and the stream ends."""
    framed = _Frames()
    started = envelope(form, response_id=_id(ctx), model=ctx.model, created=ctx.created,
                       max_output_tokens=_max_output_tokens(ctx), output=[], status="in_progress", usage=None)
    yield framed({"response": started, "type": "response.created"})
    yield framed({"response": started, "type": "response.in_progress"})
    convert = ResponseStream(form)
    try:
        async for chunk in session.events():
            for event in convert.feed(chunk):
                record.output_event()
                yield framed(event)
    except Exception as exc:
        on_error(exc)
        record.fail(exc)
        err = in_responses_terms(exc) if isinstance(exc, PipelineError) else None
        yield framed({"type": "error", "code": err.type if err else "InternalServerError",
                      "message": err.message if err else "Internal server error",
                      "param": err.param if err else None})
        return
    for event in convert.close():
        yield framed(event)
    done = envelope(form, response_id=_id(ctx), model=ctx.model, created=ctx.created,
                    max_output_tokens=_max_output_tokens(ctx), output=convert.items,
                    status=status_of(convert.finish_reason), usage=usage(convert.usage))
    yield framed({"response": done, "type": "response.completed"})
    record.complete()


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

    def authorize(request: Request) -> None:
        auth(request.headers.get("authorization"))

    async def prepare(body: Any, request_id: str) -> Prepared:
        form = await translator.form(body, request_id)
        return Prepared(form.chat, wire_for(form))

    @router.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await serve_http(request, pipeline, settings, kind="chat", operation=OPERATION,
                                authorize=authorize, wire=default, prepare=prepare)

    return router


async def _no_stream() -> AsyncIterator[bytes]:  # pragma: no cover - prepare always sets the wire
    raise AssertionError("a Responses request is written by its own wire")
    yield b""
