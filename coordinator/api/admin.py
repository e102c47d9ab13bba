"""Operator endpoints: see the engine pool, drain and restore engines, replace the static list, and
what the coordinator holds right now (``/admin/accounting``: every count is 0 when idle; a count that
stays up is a leak).

Thin: each route calls one registry method. Guarded by the same API keys as the OpenAI routes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter, ValidationError

from coordinator.api.admin_lora import build_lora_router, residency
from coordinator.api.auth import ApiKeyCheck
from coordinator.api.openai.errors import error_response
from coordinator.config import PD_ROLES, EngineSettings
from coordinator.pipeline.admission.controller import AdmissionController
from coordinator.pipeline.admission.tenants import DEFAULT
from coordinator.pipeline.catalog import ModelCatalog
from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.engines.lora import AdapterLoader
from coordinator.pipeline.engines.registry import EngineRegistry
from coordinator.pipeline.errors import BadRequest, ModelNotFound, PipelineError

_ENGINE_LIST = TypeAdapter(list[EngineSettings])


def describe(e: Engine) -> dict[str, Any]:
    return {"url": e.url, "role": e.role, "model": e.model, "weight": e.weight, "state": e.state,
            "breaker": e.breaker.state, "inflight_requests": e.inflight_requests,
            "inflight_tokens": e.inflight_tokens, "token_budget": e.token_budget,
            "kv_events": e.kv_events, "telemetry": vars(e.telemetry), "adapters": residency(e)}


def build_admin_router(registry: EngineRegistry, admission: AdmissionController,
                       auth: ApiKeyCheck, *,
                       accounting: Callable[[], dict[str, Any]] | None = None,
                       catalog: ModelCatalog | None = None, loader: AdapterLoader | None = None) -> APIRouter:
    """``catalog`` and ``loader``: the LoRA adapters' routes (``admin_lora.py``) are served too."""
    router = APIRouter(prefix="/admin")

    def guarded(request: Request) -> None:
        """Operators only: with keys configured, a key of the ``default`` tenant (``server.api_keys``);
        a tenant's key may call the model APIs but never drain engines or read the fleet's state."""
        tenant = auth(request.headers.get("authorization"))
        if auth.enabled and tenant.name != DEFAULT:
            raise PipelineError("The admin endpoints take an operator key (server.api_keys), not a "
                                "tenant's key", status=403, type="PermissionDeniedError")

    def find(url: str) -> Engine:
        engine = registry.get(url.rstrip("/"))
        if engine is None:
            raise ModelNotFound(f"No engine {url!r} in the pool", param="url")
        return engine

    @router.get("/engines")
    async def engines(request: Request) -> Response:
        try:
            guarded(request)
        except PipelineError as exc:
            return error_response(exc)
        return JSONResponse({"engines": [describe(e) for e in registry.engines],
                             "queued": admission.queue_length})

    @router.get("/accounting")
    async def held(request: Request) -> Response:
        """Admission tokens and queue, requests, stream sessions, producer tasks, open engine streams,
        pending aborts, sidecar calls in flight, and each engine's in-flight counts."""
        try:
            guarded(request)
        except PipelineError as exc:
            return error_response(exc)
        if accounting is None:
            return error_response(ModelNotFound("accounting is not wired in this coordinator"))
        return JSONResponse(accounting())

    @router.post("/engines/drain")
    async def drain(request: Request, url: str) -> Response:
        return set_drain(request, url, drain=True)

    @router.post("/engines/undrain")
    async def undrain(request: Request, url: str) -> Response:
        return set_drain(request, url, drain=False)

    def set_drain(request: Request, url: str, *, drain: bool) -> Response:
        try:
            guarded(request)
            engine = find(url)
        except PipelineError as exc:
            return error_response(exc)
        # The registry announces the change; app.py's listener wakes the admission queue.
        (registry.drain if drain else registry.undrain)(engine.url)
        return JSONResponse(describe(engine))

    @router.put("/engines")
    async def replace(request: Request) -> Response:
        """Replace the static engine list (same shape as ``engines:`` in the YAML); no restart."""
        try:
            guarded(request)
            try:
                items = _ENGINE_LIST.validate_json(await request.body())
            except ValidationError as exc:
                raise BadRequest(f"Invalid engine list: {exc.errors()[0]['msg']}", param="engines") from None
            mixed = registry.settings.mixed_pd_protocols(items)
            if mixed is None and not registry.settings.uses_trigger() and any(
                    e.role in PD_ROLES and e.pd_protocol == "trigger" for e in items):
                mixed = ("trigger P/D engines need the metaserver, which starts only when trigger engines "
                         "are configured at start-up")
            if mixed is not None:
                raise BadRequest(mixed, param="engines")
            registry.update(items)
        except PipelineError as exc:
            return error_response(exc)
        return JSONResponse({"engines": [describe(e) for e in registry.engines]})

    if catalog is not None and loader is not None:
        router.include_router(build_lora_router(registry, catalog, loader, registry.settings, guarded),
                              prefix="")
    return router
