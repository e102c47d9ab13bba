"""One HTTP request through the pipeline, whatever API it speaks (OpenAI, Anthropic Messages).

The doors differ only in how they check credentials, how a body becomes a pipeline request, and how
answers, errors and streams are written (``Wire``); the request's life (its id, observation record,
body limits, the race with a client that leaves, releasing a stream however it ends) is this one
function, so a fix to it reaches every API.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from starlette.datastructures import Address

from coordinator.api.body import read_json_body
from coordinator.api.openai.sse import OwningStreamingResponse
from coordinator.api.shutdown import RECORD_KEY
from coordinator.config import Settings
from coordinator.observability.record import Door, Record
from coordinator.pipeline.admission.tenants import Tenant
from coordinator.pipeline.context import ChunkStream, Kind, NativeCall, RequestContext
from coordinator.pipeline.errors import BadRequest, ClientGone, PipelineError
from coordinator.pipeline.service import Pipeline

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode

OnError = Callable[[BaseException], None]


@dataclass(frozen=True)
class Wire:
    """How one API writes what the pipeline answers (``RequestContext``: the served request)."""

    error: Callable[[PipelineError, str | None], Response]
    body: Callable[[dict[str, Any], RequestContext], dict[str, Any]]  # pipeline's JSON answer → the API's
    stream: Callable[[ChunkStream, OnError, Record, RequestContext], AsyncIterator[bytes]]
    # Runs on a whole JSON answer before it is written, and may change it (Responses stores it).
    keep: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]] | None = None


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` may answer when the answer's writing depends on the request (Responses echoes
    the request's fields): the pipeline's body and the wire for this one request. With ``native``,
    the body is the client's own, for the engines' route for its API (``pipeline/native_api.py``)."""

    body: Any
    wire: Wire
    native: NativeCall | None = None
    answered: Response | None = None   # answered already (a background Responses run was started)


def passthrough_wire(error: Callable[[PipelineError, str | None], Response],
                     error_event: Callable[[PipelineError | None], dict[str, Any]]) -> Wire:
    """The wire of a request on the native chain: the engine's answer is already in the client's API,
    so bodies go out as they came and events are framed as vLLM frames them (``event: <type>``).
    ``error_event``: the API's event for a failure after the first byte (None: not the client's)."""

    async def events(session: ChunkStream, on_error: OnError, record: Record,
                     _: RequestContext) -> AsyncIterator[bytes]:
        try:
            async for event in session.events():
                record.output_event()
                yield sse_frame(event)
        except Exception as exc:
            on_error(exc)
            record.fail(exc)
            yield sse_frame(error_event(exc if isinstance(exc, PipelineError) else None))
            return
        record.complete()

    return Wire(error=error, body=lambda answer, _: answer, stream=events)


def sse_frame(event: dict[str, Any]) -> bytes:
    """``event: <type>\ndata: <json>\n\n``: how vLLM frames Messages and Responses events."""
    return b"event: " + str(event.get("type")).encode() + b"\ndata: " + _encode(event) + b"\n\n"


async def serve_http(request: Request, pipeline: Pipeline, settings: Settings, *, kind: Kind,
                     operation: str, authorize: Callable[[Request], Tenant], wire: Wire,
                     prepare: Callable[[Any, str, Tenant], Awaitable[Any]] | None = None) -> Response:
    """``prepare(body, request_id, tenant)``: the API's body → the pipeline's (e.g. Messages → chat), or
    a ``Prepared`` with the wire to write this request's answer with."""
    limits = settings.limits
    request_id = client_request_id(request.headers.get("x-request-id"), limits.request_id_max_length)
    headers = {"X-Request-Id": request_id}
    record = start_record(pipeline, "http", request_id=request_id, connection_id=peer(request.client),
                          operation=operation)
    request.scope[RECORD_KEY] = record  # the drain deadline records its cut as a 503 (api/shutdown.py)
    try:
        tenant = authorize(request)
        body = await read_json_body(request.stream(), max_bytes=settings.server.max_body_bytes,
                                    max_depth=limits.max_json_depth, timeout_s=limits.body_timeout_s)
        native = None
        if prepare is not None:
            body = await prepare(body, request_id, tenant)
            if isinstance(body, Prepared):
                if body.answered is not None:
                    record.complete()
                    record.finish()
                    return body.answered
                body, wire, native = body.body, body.wire, body.native
        served = await pipeline.serve(
            kind, body, request_id,
            priority=header_priority(request.headers.get(settings.admission.priority_header)),
            gone=lambda: _disconnected(request), record=record, operation=operation, tenant=tenant,
            native=native)
    except PipelineError as exc:
        record.fail(exc, exc.status)
        record.finish()
        return wire.error(exc, request_id)
    except ClientGone:
        record.gone()
        record.finish()
        return Response(status_code=499)
    except BaseException as exc:
        record.fail(exc) if isinstance(exc, Exception) else record.gone()
        record.finish()
        raise
    headers.update(route_headers(served.ctx))
    if served.stream is None:
        record.transport = "http/json"
        record.output_event()
        record.complete()
        record.finish()
        assert served.response is not None
        answer = wire.body(served.response, served.ctx)
        if wire.keep is not None:
            answer = await wire.keep(answer)
        return JSONResponse(answer, headers=headers)
    record.transport = "http/sse"

    async def release() -> None:
        """Release the stream, then end the record (a body that did not reach its end: client gone)."""
        try:
            await served.aclose()
        finally:
            if record.outcome in (None, "cancelled"):
                record.gone()
            record.finish()

    def on_error(exc: BaseException) -> None:
        if not isinstance(exc, PipelineError):
            log.error("stream %s failed", request_id, exc_info=exc)
        else:
            log.warning("stream %s failed: %s", request_id, exc.message)

    return OwningStreamingResponse(wire.stream(served.stream, on_error, record, served.ctx), release, headers)


def start_record(pipeline: Pipeline, door: Door, **fields: Any) -> Record:
    """A door's observation record, going to the pipeline's observer when it has one."""
    observer = pipeline.observer
    return observer.start(door, **fields) if observer is not None else Record(door, **fields)


def peer(client: Address | None) -> str | None:
    """The TCP peer as ``host:port`` (the record's connection id)."""
    return f"{client.host}:{client.port}" if client is not None else None


def route_headers(ctx: RequestContext) -> dict[str, str]:
    """Say so when a request left the default path (render + token-only engines): the native route
    (an engine's OpenAI API) and/or the local tokenizer (render was unavailable); and the tenant's
    rate-limit state, as OpenAI sends it on every answer."""
    out: dict[str, str] = {}
    if ctx.route != "tokens":
        out["X-Coordinator-Route"] = ctx.route
    if ctx.tokenizer_source != "render":
        out["X-Tokenizer-Source"] = ctx.tokenizer_source
    out.update(ctx.rate_headers)  # the tenant's x-ratelimit-* (rate_limits.py)
    return out


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]+")


def client_request_id(header: str | None, max_length: int) -> str:
    """The client's ``X-Request-Id`` when it is a plain token of sane length, else a fresh id.

    It becomes part of the response ``id``, log lines and engine request ids, so anything that could
    break those (spaces, quotes, control characters, megabytes) is replaced; the response header
    always carries the id actually used."""
    if header and len(header) <= max_length and _REQUEST_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex


async def _disconnected(request: Request) -> None:
    """Completes when the client closes the connection (what ``Pipeline.serve`` races against)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def header_priority(value: str | None) -> int | None:
    """The priority header as an integer (None when absent or blank); anything else is a 400."""
    if value is None or not value.strip():
        return None
    try:
        return int(value)
    except ValueError:
        raise BadRequest(f"The priority header must be an integer, got {value!r}") from None
