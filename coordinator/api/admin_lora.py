"""Operator endpoints for LoRA adapters: where each is loaded, and loading, unloading, pinning by hand
(docs/lora.md). Guarded like the rest of ``/admin``; each route is one call of the loader or catalog.

An adapter the configuration does not name may be registered here (``model`` + ``path``, under
``lora.allowed_roots``): it is served from then on, until the coordinator restarts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from coordinator.api.openai.errors import error_response
from coordinator.config import Settings
from coordinator.pipeline.catalog import ModelCatalog
from coordinator.pipeline.engines.adapters import Adapter
from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.engines.lora import AdapterLoader, AdapterLoadFailed
from coordinator.pipeline.engines.registry import EngineRegistry
from coordinator.pipeline.errors import BadRequest, ModelNotFound, PipelineError


class AdapterCall(BaseModel):
    """The body of load / unload / pin / unpin."""

    model_config = ConfigDict(extra="forbid")
    adapter: str
    engine: str
    model: str | None = None   # load only: the base model of an adapter not configured yet
    path: str | None = None    # load only: where engines read it


def residency(e: Engine) -> dict[str, Any]:
    a = e.adapters
    return {"held": sorted(a.held), "pinned": sorted(a.pinned), "loading": sorted(a.loading),
            "running": dict(a.inflight), "capacity": a.capacity,
            "engine_running": list(e.telemetry.running_adapters),
            "engine_waiting": list(e.telemetry.waiting_adapters)}


def build_lora_router(registry: EngineRegistry, catalog: ModelCatalog, loader: AdapterLoader,
                      settings: Settings, guarded: Callable[[Request], None]) -> APIRouter:
    router = APIRouter(prefix="/adapters")

    async def call(request: Request) -> tuple[AdapterCall, Engine]:
        guarded(request)
        try:
            body = AdapterCall.model_validate_json(await request.body())
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(map(str, first["loc"]))
            raise BadRequest(f"Invalid body: {first['msg']}", param=param) from None
        engine = registry.get(body.engine.rstrip("/"))
        if engine is None:
            raise ModelNotFound(f"No engine {body.engine!r} in the pool", param="engine")
        return body, engine

    def known(name: str) -> Adapter:
        adapter = catalog.adapter(name)
        if adapter is None:
            raise ModelNotFound(f"The LoRA adapter `{name}` is not served here", param="adapter")
        return adapter

    def operation(path: str, op: Callable[[AdapterCall, Engine], Awaitable[None]]) -> None:
        """``POST /admin/adapters{path}``: the body checked, ``op`` run, the engine's residency answered."""
        async def handler(request: Request) -> Response:
            try:
                body, engine = await call(request)
                await op(body, engine)
            except PipelineError as exc:
                return error_response(exc)
            return JSONResponse({"engine": engine.url, **residency(engine)})

        router.add_api_route(path, handler, methods=["POST"])

    @router.get("")
    async def listing(request: Request) -> Response:
        try:
            guarded(request)
        except PipelineError as exc:
            return error_response(exc)
        engines = registry.engines
        return JSONResponse({
            "adapters": [{"name": a.name, "model": a.base, "path": a.path, "pinned": list(a.pinned),
                          "engines": [e.url for e in engines if e.adapters.holds(a.name)]}
                         for a in catalog.adapters()],
            "engines": {e.url: residency(e) for e in engines}})

    async def load(body: AdapterCall, engine: Engine) -> None:
        adapter = catalog.adapter(body.adapter)
        if adapter is None:
            if body.model is None or body.path is None:
                raise ModelNotFound(f"The LoRA adapter `{body.adapter}` is not served here; give `model` "
                                    "and `path` to register it", param="adapter")
            why = settings.adapter_path_problem(body.path)
            if why is not None:
                raise BadRequest(why, param="path")
            adapter = catalog.new_adapter(body.model, body.adapter, body.path)  # served once it loads
        elif body.path is not None and body.path != adapter.path:
            raise BadRequest(f"The LoRA adapter `{adapter.name}` is served from {adapter.path!r}",
                             param="path")
        try:
            await loader.load(engine, adapter)
        except AdapterLoadFailed as exc:
            status = exc.engine_status if exc.refused and exc.engine_status in (400, 404) else exc.status
            raise PipelineError(exc.message, status=status, type=exc.type, param="adapter") from None
        catalog.add(adapter)

    async def unload(body: AdapterCall, engine: Engine) -> None:
        adapter = known(body.adapter)
        running = engine.adapters.running(adapter.name)
        if running:
            raise PipelineError(f"{engine.url} is running {running} requests for `{adapter.name}`; unload it "
                                "once they end", status=409, type="ConflictError", param="adapter")
        engine.adapters.pinned.discard(adapter.name)
        await loader.unload(engine, adapter.name)

    async def pin(body: AdapterCall, engine: Engine) -> None:
        """Keep the adapter loaded on the engine (loaded now if it is not), never unloaded for room."""
        adapter = known(body.adapter)
        engine.adapters.pinned.add(adapter.name)
        if not engine.adapters.holds(adapter.name):
            await loader.ensure(engine, adapter)

    async def unpin(body: AdapterCall, engine: Engine) -> None:
        engine.adapters.pinned.discard(known(body.adapter).name)

    for path, op in (("/load", load), ("/unload", unload), ("/pin", pin), ("/unpin", unpin)):
        operation(path, op)
    return router
