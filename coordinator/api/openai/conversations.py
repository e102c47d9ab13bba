"""Thin OpenAI Conversations routes over ``pipeline/responses/conversations.py`` (docs/responses-api.md)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from coordinator.api.auth import ApiKeyCheck
from coordinator.api.body import read_json_body
from coordinator.api.openai.errors import error_response
from coordinator.api.openai.responses import item_page
from coordinator.config import Settings
from coordinator.pipeline.errors import BadRequest, PipelineError
from coordinator.pipeline.responses.chain import ResponseChain
from coordinator.pipeline.responses.conversations import Conversations

Work = Callable[[Conversations, str, Any], Awaitable[Any]]   # conversations, tenant, body (or None)


def build_router(chain: ResponseChain, auth: ApiKeyCheck, settings: Settings) -> APIRouter:
    router = APIRouter()
    limits = settings.limits

    async def answer(request: Request, work: Work, body: bool = False) -> Response:
        """The JSON body (with ``body``), credentials, the store, then ``work(conversations, tenant,
        body)``; any refusal, a malformed body's included, in OpenAI's error body."""
        try:
            data = await body_of(request) if body else None
            tenant = auth(request.headers.get("authorization"))
            if chain.store is None:
                raise BadRequest("conversations need the response store, and it is off on this server "
                                 "(responses.store.backend)")
            return JSONResponse(await work(Conversations(chain.store), tenant.name, data))
        except PipelineError as exc:
            return error_response(exc)

    async def body_of(request: Request) -> Any:
        if not (await request.body()).strip():
            return {}
        return await read_json_body(request.stream(), max_bytes=settings.server.max_body_bytes,
                                    max_depth=limits.max_json_depth, timeout_s=limits.body_timeout_s)

    @router.post("/v1/conversations")
    async def create(request: Request) -> Response:
        return await answer(request, lambda c, t, body: c.create(t, body), body=True)

    @router.get("/v1/conversations/{conversation_id}")
    async def retrieve(request: Request, conversation_id: str) -> Response:
        async def work(c: Conversations, t: str, _: Any) -> Any:
            return (await c.get(t, conversation_id)).response
        return await answer(request, work)

    @router.post("/v1/conversations/{conversation_id}")
    async def update(request: Request, conversation_id: str) -> Response:
        return await answer(request, lambda c, t, body: c.update(t, conversation_id, body), body=True)

    @router.delete("/v1/conversations/{conversation_id}")
    async def delete(request: Request, conversation_id: str) -> Response:
        return await answer(request, lambda c, t, _: c.delete(t, conversation_id))

    @router.get("/v1/conversations/{conversation_id}/items")
    async def items(request: Request, conversation_id: str) -> Response:
        async def work(c: Conversations, t: str, _: Any) -> Any:
            return item_page((await c.get(t, conversation_id)).input_items, request.query_params)
        return await answer(request, work)

    @router.post("/v1/conversations/{conversation_id}/items")
    async def add(request: Request, conversation_id: str) -> Response:
        async def work(c: Conversations, t: str, body: Any) -> Any:
            added = await c.add(t, conversation_id, body.get("items") if isinstance(body, dict) else None)
            return {"object": "list", "data": added, "first_id": added[0]["id"] if added else None,
                    "last_id": added[-1]["id"] if added else None, "has_more": False}
        return await answer(request, work, body=True)

    @router.get("/v1/conversations/{conversation_id}/items/{item_id}")
    async def item(request: Request, conversation_id: str, item_id: str) -> Response:
        return await answer(request, lambda c, t, _: c.item(t, conversation_id, item_id))

    @router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
    async def remove(request: Request, conversation_id: str, item_id: str) -> Response:
        return await answer(request, lambda c, t, _: c.remove(t, conversation_id, item_id))

    return router
