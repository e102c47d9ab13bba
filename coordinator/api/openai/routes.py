"""Thin OpenAI routes: parse → pipeline → write JSON or SSE. No request logic lives here."""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.datastructures import Address

from coordinator.api.auth import ApiKeyCheck
from coordinator.api.body import read_json_body
from coordinator.api.openai.errors import error_response
from coordinator.api.openai.sse import OwningStreamingResponse, sse_body
from coordinator.api.shutdown import RECORD_KEY
from coordinator.config import Settings
from coordinator.observability.record import Door, Record
from coordinator.pipeline.catalog import ModelEntry
from coordinator.pipeline.context import Kind, RequestContext
from coordinator.pipeline.errors import BadRequest, ClientGone, PipelineError
from coordinator.pipeline.service import OPERATIONS, Pipeline

log = logging.getLogger(__name__)


def build_router(pipeline: Pipeline, auth: ApiKeyCheck, settings: Settings) -> APIRouter:
    router = APIRouter()
    limits = settings.limits
    priority_header = settings.admission.priority_header

    async def handle(kind: Kind, request: Request) -> Response:
        request_id = client_request_id(request.headers.get("x-request-id"), limits.request_id_max_length)
        headers = {"X-Request-Id": request_id}
        record = start_record(pipeline, "http", request_id=request_id, connection_id=peer(request.client),
                              operation=OPERATIONS[kind])
        request.scope[RECORD_KEY] = record  # the drain deadline records its cut as a 503 (api/shutdown.py)
        try:
            auth(request.headers.get("authorization"))
            body = await read_json_body(request.stream(), max_bytes=settings.server.max_body_bytes,
                                        max_depth=limits.max_json_depth, timeout_s=limits.body_timeout_s)
            served = await pipeline.serve(kind, body, request_id,
                                          priority=header_priority(request.headers.get(priority_header)),
                                          gone=lambda: _disconnected(request), record=record)
        except PipelineError as exc:
            record.fail(exc, exc.status)
            record.finish()
            return error_response(exc, request_id)
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
            return JSONResponse(served.response, headers=headers)
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

        return OwningStreamingResponse(sse_body(served.stream, on_error, record), release, headers)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle("chat", request)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle("completion", request)

    @router.post("/v1/responses")
    @router.post("/v1/messages")
    async def not_served(request: Request) -> Response:
        """Responses and Anthropic Messages are not served (docs/openai-api.md): a clear 404."""
        return error_response(PipelineError(
            f"{request.url.path} is not served by this coordinator; use /v1/chat/completions or "
            f"/v1/completions", status=404, type="NotFoundError"))

    @router.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            auth(request.headers.get("authorization"))
        except PipelineError as exc:
            return error_response(exc)
        data = [card for e in pipeline.catalog.entries() for card in _cards(e)]
        return JSONResponse({"object": "list", "data": data})

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        """One model card (the SDK's ``models.retrieve``); aliases answer with their own id."""
        try:
            auth(request.headers.get("authorization"))
            entry = pipeline.catalog.resolve(model_id)
        except PipelineError as exc:
            return error_response(exc)
        return JSONResponse(next(c for c in _cards(entry) if c["id"] == model_id))

    return router


def _cards(e: ModelEntry) -> list[dict[str, Any]]:
    card = {"object": "model", "created": e.created, "owned_by": "vllm", "root": e.root,
            "parent": None, "max_model_len": e.max_model_len}
    return [{"id": e.name, **card}, *({"id": a, **card, "parent": e.name} for a in e.aliases)]


def start_record(pipeline: Pipeline, door: Door, **fields: Any) -> Record:
    """A door's observation record, going to the pipeline's observer when it has one."""
    observer = pipeline.observer
    return observer.start(door, **fields) if observer is not None else Record(door, **fields)


def peer(client: Address | None) -> str | None:
    """The TCP peer as ``host:port`` (the record's connection id)."""
    return f"{client.host}:{client.port}" if client is not None else None


def route_headers(ctx: RequestContext) -> dict[str, str]:
    """Say so when a request left the default path (render + token-only engines): the native route
    (an engine's OpenAI API) and/or the local tokenizer (render was unavailable)."""
    out: dict[str, str] = {}
    if ctx.route != "tokens":
        out["X-Coordinator-Route"] = ctx.route
    if ctx.tokenizer_source != "render":
        out["X-Tokenizer-Source"] = ctx.tokenizer_source
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
