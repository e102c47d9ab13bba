"""Thin OpenAI routes: parse → pipeline → write JSON or SSE. No request logic lives here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from coordinator.api.auth import ApiKeyCheck
from coordinator.api.body import read_json_body
from coordinator.api.openai.errors import error_response
from coordinator.api.openai.sse import OwningStreamingResponse, sse_body
from coordinator.config import Settings
from coordinator.pipeline.catalog import ModelEntry
from coordinator.pipeline.context import Kind, RequestContext
from coordinator.pipeline.errors import PipelineError
from coordinator.pipeline.service import Pipeline

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client closed the connection before a non-streaming answer was ready."""


def build_router(pipeline: Pipeline, auth: ApiKeyCheck, settings: Settings) -> APIRouter:
    router = APIRouter()
    limits = settings.limits
    priority_header = settings.admission.priority_header

    async def handle(kind: Kind, request: Request) -> Response:
        request_id = client_request_id(request.headers.get("x-request-id"), limits.request_id_max_length)
        headers = {"X-Request-Id": request_id}
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(pipeline.track())
        try:
            auth(request.headers.get("authorization"))
            body = await read_json_body(request.stream(), max_bytes=settings.server.max_body_bytes,
                                        max_depth=limits.max_json_depth, timeout_s=limits.body_timeout_s)
            ctx = await pipeline.begin(kind, body, request_id, priority=request.headers.get(priority_header))
            if not ctx.stream:
                result = await _unless_client_leaves(request, pipeline.complete(ctx))
                return JSONResponse(result, headers={**headers, **route_headers(ctx)})
            # Opening may wait in the admission queue: a client that leaves meanwhile gives up its place.
            session = await _unless_client_leaves(request, pipeline.open_stream(ctx))
            stack.push_async_callback(session.aclose)
            headers.update(route_headers(ctx))
        except PipelineError as exc:
            await stack.aclose()
            return error_response(exc, request_id)
        except ClientGone:
            await stack.aclose()
            return Response(status_code=499)
        except BaseException:
            await stack.aclose()
            raise
        else:
            if not ctx.stream:
                await stack.aclose()

        def on_error(exc: BaseException) -> None:
            if not isinstance(exc, PipelineError):
                log.error("stream %s failed", request_id, exc_info=exc)
            else:
                log.warning("stream %s failed: %s", request_id, exc.message)

        return OwningStreamingResponse(sse_body(session, on_error), stack.aclose, headers)

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


async def _unless_client_leaves(request: Request, work: Any) -> Any:
    """Run ``work`` but cancel it (releasing everything it holds) if the client disconnects."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    main = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({main, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not main.done():
            main.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await main
            watch.cancel()
            raise ClientGone()
        watch.cancel()
    return main.result()
