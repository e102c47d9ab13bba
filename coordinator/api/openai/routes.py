"""Thin OpenAI routes: parse → pipeline → write JSON or SSE. No request logic lives here."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from coordinator.api.auth import ApiKeyCheck
from coordinator.api.openai.errors import error_response
from coordinator.api.openai.sse import OwningStreamingResponse, sse_body
from coordinator.pipeline.context import Kind
from coordinator.pipeline.errors import BadRequest, PipelineError
from coordinator.pipeline.service import Pipeline

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client closed the connection before a non-streaming answer was ready."""


def build_router(pipeline: Pipeline, auth: ApiKeyCheck, max_body_bytes: int,
                 priority_header: str = "x-request-priority") -> APIRouter:
    router = APIRouter()

    async def handle(kind: Kind, request: Request) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"X-Request-Id": request_id}
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(pipeline.track())
        try:
            auth(request.headers.get("authorization"))
            body = await _read_json(request, max_body_bytes)
            ctx = await pipeline.begin(kind, body, request_id, priority=request.headers.get(priority_header))
            if not ctx.stream:
                result = await _unless_client_leaves(request, pipeline.complete(ctx))
                return JSONResponse(result, headers=headers)
            # Opening may wait in the admission queue: a client that leaves meanwhile gives up its place.
            session = await _unless_client_leaves(request, pipeline.open_stream(ctx))
            stack.push_async_callback(session.aclose)
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

    @router.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            auth(request.headers.get("authorization"))
        except PipelineError as exc:
            return error_response(exc)
        data: list[dict[str, Any]] = []
        for e in pipeline.catalog.entries():
            card = {"object": "model", "created": e.created, "owned_by": "vllm", "root": e.root,
                    "parent": None, "max_model_len": e.max_model_len}
            data.append({"id": e.name, **card})
            data.extend({"id": a, **card, "parent": e.name} for a in e.aliases)
        return JSONResponse({"object": "list", "data": data})

    return router


async def _read_json(request: Request, max_bytes: int) -> Any:
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > max_bytes:
            raise PipelineError(f"Request body larger than {max_bytes} bytes", status=413,
                                type="RequestTooLarge")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"Request body is not valid JSON: {exc}") from None


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
