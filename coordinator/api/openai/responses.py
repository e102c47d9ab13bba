"""Thin OpenAI Responses route: convert the request to chat → the chat pipeline → write Responses.

A Responses request takes the whole chat path (``pipeline/responses/translate.py``); what differs
is the answer: the response object vLLM echoes for the request, output items instead of a message,
and a typed event stream (docs/openai-api.md, "Responses"). When the sidecar cannot convert it, it
goes as it is to an engine's own ``/v1/responses`` (the native chain, ``pipeline/native_api.py``)
and the engine's answer comes back as it is.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from coordinator.api.auth import ApiKeyCheck
from coordinator.api.door import OnError, Prepared, Wire, passthrough_wire, serve_http
from coordinator.api.openai.errors import error_response
from coordinator.config import Settings
from coordinator.observability.record import Record
from coordinator.pipeline.admission.tenants import Tenant
from coordinator.pipeline.chat_form import ConversionUnavailable
from coordinator.pipeline.context import ChunkStream, RequestContext
from coordinator.pipeline.errors import BadRequest, PipelineError
from coordinator.pipeline.responses.answer import ResponseEvents, to_response
from coordinator.pipeline.responses.background import ACTIVE, BackgroundRuns, Served
from coordinator.pipeline.responses.chain import Opened, ResponseNotFound, ResponsesIntake
from coordinator.pipeline.responses.convert import Event, ResponsesForm, envelope
from coordinator.pipeline.responses.store import StoredResponse
from coordinator.pipeline.responses.translate import in_responses_terms
from coordinator.pipeline.service import Pipeline

OPERATION = "responses.create"
Keep = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
_encode = msgspec.json.Encoder().encode


def responses_error(exc: PipelineError, request_id: str | None = None) -> JSONResponse:
    """OpenAI's error body, naming the Responses field the client wrote."""
    return error_response(in_responses_terms(exc), request_id)


def _frame(event: Event) -> bytes:
    """A numbered event framed as vLLM frames it: ``event: <type>\\ndata: <json>\\n\\n``."""
    name = str(event["type"]).encode()
    return b"event: " + name + b"\ndata: " + _encode(event) + b"\n\n"


async def response_events(form: ResponsesForm, session: ChunkStream, on_error: OnError, record: Record,
                          ctx: RequestContext, keep: Keep | None = None) -> AsyncIterator[bytes]:
    """``response.created`` and ``response.in_progress``, the output items' events, then
    ``response.completed``; a failure after the first byte is an ``error`` event, and the stream ends.
    The events and their numbers are ``ResponseEvents``', which NNRP sends too. ``keep`` stores the
    whole response before ``response.completed`` goes out, so a client that chains on that event finds
    it."""
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
    completed = events.completed()
    if keep is not None:
        completed["response"] = await keep(completed["response"])
    yield _frame(completed)
    record.complete()


def stream_error(exc: PipelineError | None) -> dict[str, Any]:
    """The Responses ``error`` event for a failure after the stream started (no sequence number: the
    engine's events carry theirs)."""
    err = in_responses_terms(exc) if exc is not None else None
    return {"type": "error", "code": err.type if err else "InternalServerError",
            "message": err.message if err else "Internal server error", "param": err.param if err else None}


def wire_for(form: ResponsesForm, keep: Keep | None = None) -> Wire:
    """How one Responses request's answer is written (it echoes that request's fields)."""
    return Wire(error=responses_error, body=lambda chat, ctx: to_response(form, chat, ctx),
                stream=lambda session, on_error, record, ctx: response_events(form, session, on_error,
                                                                              record, ctx, keep),
                keep=keep)


def build_router(pipeline: Pipeline, intake: ResponsesIntake, runs: BackgroundRuns, auth: ApiKeyCheck,
                 settings: Settings) -> APIRouter:
    router = APIRouter()
    chain = intake.chain
    # Errors before the conversion (credentials, the body) are written by this wire.
    default = Wire(error=responses_error, body=lambda chat, _: chat,
                   stream=lambda *_: _no_stream())

    def authorize(request: Request) -> Tenant:
        return auth(request.headers.get("authorization"))

    native_wire = passthrough_wire(responses_error, stream_error)

    async def prepare(body: Any, request_id: str, tenant: Tenant) -> Prepared:
        try:
            opened = await intake.open(body, request_id, tenant.name)
        except ConversionUnavailable as exc:
            if isinstance(body, dict) and body.get("background") is True:
                raise BadRequest("background runs need the render sidecar's conversion, which is not "
                                 "available now", param="background") from exc
            return Prepared(body, native_wire, native=exc.call)
        if opened.turn.background:
            return Prepared(None, default, answered=await background(opened, request_id, tenant))

        async def keep(response: dict[str, Any]) -> dict[str, Any]:
            await intake.keep(opened, response)
            return response

        return Prepared(opened.form.chat, wire_for(opened.form, keep if opened.turn.kept else None))

    async def background(opened: Opened, request_id: str, tenant: Tenant) -> Response:
        """Start the run, and answer its queued response (or its events, live, for ``stream``)."""
        form = opened.form
        queued = envelope(form, response_id=f"resp_{request_id}", model=str(form.response.get("model") or ""),
                          created=int(time.time()), max_output_tokens=int(form.chat.get("max_tokens") or 0),
                          output=[], status="queued", usage=None)

        async def serve(chat: dict[str, Any]) -> Served:
            return await pipeline.serve("chat", chat, request_id, operation=OPERATION, tenant=tenant)

        run = await runs.start(opened, queued, serve)
        if not form.chat.get("stream"):
            return JSONResponse(run.response, headers={"X-Request-Id": request_id})
        return StreamingResponse(_frames(runs.events(run)), media_type="text/event-stream",
                                 headers={"X-Request-Id": request_id})

    @router.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await serve_http(request, pipeline, settings, kind="chat", operation=OPERATION,
                                authorize=authorize, wire=default, prepare=prepare)

    async def stored(request: Request, response_id: str) -> tuple[Tenant, StoredResponse]:
        tenant = authorize(request)
        if chain.store is None or not response_id.startswith("resp_") or "#" in response_id:
            # Conversations (conv_…) and the store's own markers (…#cancel) share the store.
            raise ResponseNotFound(response_id, "response_id")
        entry = await chain.store.get(tenant.name, response_id)
        if entry is None:
            raise ResponseNotFound(response_id, "response_id")
        return tenant, await runs.settled(tenant.name, entry)

    @router.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str) -> Response:
        try:
            tenant, entry = await stored(request, response_id)
            if request.query_params.get("stream") not in ("true", "1"):
                return JSONResponse(entry.response)
            after = _starting_after(request.query_params.get("starting_after"))
            if not entry.response.get("background"):
                raise BadRequest("stream is only for background responses", param="stream")
            run = runs.local(tenant.name, response_id)
            if run is None:
                raise BadRequest("this background response's events are kept by the coordinator replica "
                                 "that runs it; poll it without stream", param="stream")
        except PipelineError as exc:
            return responses_error(exc)
        return StreamingResponse(_frames(runs.events(run, after)), media_type="text/event-stream")

    @router.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str) -> Response:
        try:
            tenant = authorize(request)
            gone = (chain.store is not None and response_id.startswith("resp_") and "#" not in response_id
                    and await chain.store.delete(tenant.name, response_id))
        except PipelineError as exc:
            return responses_error(exc)
        if not gone:
            return responses_error(ResponseNotFound(response_id, "response_id"))
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items(request: Request, response_id: str) -> Response:
        try:
            _, entry = await stored(request, response_id)
            page = item_page(entry.input_items, request.query_params)
        except PipelineError as exc:
            return responses_error(exc)
        return JSONResponse(page)

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel(request: Request, response_id: str) -> Response:
        try:
            tenant, entry = await stored(request, response_id)
            if entry.response.get("status") not in ACTIVE:
                # vLLM's and OpenAI's rule: only a queued or running (background) response can be.
                raise BadRequest("Cannot cancel a synchronous response.", param="response_id")
            return JSONResponse(await runs.cancel(tenant.name, entry))
        except PipelineError as exc:
            return responses_error(exc)

    return router


def _starting_after(value: str | None) -> int:
    if value is None:
        return -1
    try:
        return int(value)
    except ValueError:
        raise BadRequest("starting_after must be an integer", param="starting_after") from None


async def _frames(events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    async for event in events:
        yield _frame(event)


def item_page(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """OpenAI's list page of input items: ``order`` (``desc``, the default, newest first), ``after`` /
    ``before`` (an item id), ``limit`` (1 to 100, default 20)."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("order must be 'asc' or 'desc'", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        raise BadRequest("limit must be an integer", param="limit") from None
    if not 1 <= limit <= 100:
        raise BadRequest("limit must be between 1 and 100", param="limit")
    ordered = items if order == "asc" else list(reversed(items))
    ids = [str(item.get("id")) for item in ordered]
    for name in ("after", "before"):
        cursor = query.get(name)
        if cursor is not None and cursor not in ids:
            raise BadRequest(f"No input item with id '{cursor}'", param=name)
    if (after := query.get("after")) is not None:
        ordered = ordered[ids.index(after) + 1:]
    if (before := query.get("before")) is not None:
        cut = [str(item.get("id")) for item in ordered]
        ordered = ordered[:cut.index(before)] if before in cut else ordered
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}


async def _no_stream() -> AsyncIterator[bytes]:  # pragma: no cover - prepare always sets the wire
    raise AssertionError("a Responses request is written by its own wire")
    yield b""
