"""Thin OpenAI routes: parse → pipeline → write JSON or SSE. No request logic lives here."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from coordinator.api.auth import ApiKeyCheck
from coordinator.api.door import Wire, serve_http
from coordinator.api.openai.errors import error_response
from coordinator.api.openai.sse import sse_body
from coordinator.config import Settings
from coordinator.pipeline.admission.tenants import Tenant
from coordinator.pipeline.catalog import model_cards
from coordinator.pipeline.context import Kind
from coordinator.pipeline.errors import ModelNotFound, PipelineError
from coordinator.pipeline.service import OPERATIONS, Pipeline


def build_router(pipeline: Pipeline, auth: ApiKeyCheck, settings: Settings) -> APIRouter:
    router = APIRouter()
    wire = Wire(error=error_response, body=lambda response, _: response,
                stream=lambda session, on_error, record, _: sse_body(session, on_error, record))

    def authorize(request: Request) -> Tenant:
        return auth(request.headers.get("authorization"))

    async def handle(kind: Kind, request: Request) -> Response:
        return await serve_http(request, pipeline, settings, kind=kind, operation=OPERATIONS[kind],
                                authorize=authorize, wire=wire)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle("chat", request)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle("completion", request)

    @router.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            tenant = auth(request.headers.get("authorization"))
        except PipelineError as exc:
            return error_response(exc)
        return JSONResponse(pipeline.catalog.model_list(tenant.may_use))

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        """One model card (the SDK's ``models.retrieve``); aliases answer with their own id."""
        try:
            tenant = auth(request.headers.get("authorization"))
            if pipeline.catalog.adapter(model_id) is not None and not tenant.may_use(model_id):
                raise ModelNotFound(f"The model `{model_id}` does not exist.", param="model")
            entry = pipeline.catalog.resolve(model_id)
        except PipelineError as exc:
            return error_response(exc)
        return JSONResponse(next(c for c in model_cards(entry) if c["id"] == model_id))

    return router
