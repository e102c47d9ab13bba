"""Application assembly: one place that wires config → clients → stages → front doors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from coordinator.api.auth import ApiKeyCheck
from coordinator.api.openai.errors import install_handlers
from coordinator.api.openai.routes import build_router
from coordinator.config import Settings
from coordinator.observability.metrics import Metrics
from coordinator.pipeline.catalog import ModelCatalog
from coordinator.pipeline.derender.client import Derenderer
from coordinator.pipeline.dispatch import UnionDispatcher
from coordinator.pipeline.engines.client import EngineClient
from coordinator.pipeline.engines.registry import EngineRegistry
from coordinator.pipeline.render import RenderStage
from coordinator.pipeline.scheduling.picker import LeastLoadPicker
from coordinator.pipeline.service import Pipeline
from coordinator.pipeline.sidecar import SidecarClient

log = logging.getLogger(__name__)


@dataclass
class Components:
    """The live objects of one coordinator; tests reach in here to observe state."""

    settings: Settings
    sidecar: SidecarClient
    engines: EngineClient
    registry: EngineRegistry
    pipeline: Pipeline
    metrics: Metrics


def build_components(settings: Settings) -> Components:
    sidecar = SidecarClient(settings.render)
    engines = EngineClient(settings.engine_client)
    registry = EngineRegistry(settings.engines, engines.http, settings.engine_client.health_interval_s)
    catalog = ModelCatalog(settings.models, sidecar)
    pipeline = Pipeline(
        catalog=catalog,
        render=RenderStage(sidecar, catalog),
        dispatcher=UnionDispatcher(engines, registry, LeastLoadPicker(registry)),
        derenderer=Derenderer(sidecar, parsers=settings.render.parsers),
        strict=settings.server.request_mode == "strict",
        queue_chunks=settings.stream.queue_chunks,
    )
    metrics = Metrics(lambda: pipeline.inflight)
    return Components(settings, sidecar, engines, registry, pipeline, metrics)


def build_app(settings: Settings) -> FastAPI:
    c = build_components(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await c.registry.start()
        sync = asyncio.create_task(_sync_catalog(c))
        try:
            yield
        finally:
            sync.cancel()
            await c.registry.stop()
            await c.engines.aclose()
            await c.sidecar.aclose()

    app = FastAPI(title="LLM coordinator", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.components = c
    install_handlers(app)
    app.include_router(build_router(c.pipeline, ApiKeyCheck(settings.server.api_keys),
                                    settings.server.max_body_bytes))

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        sidecar_ok = await c.sidecar.healthy()
        engines = {e.url: e.healthy for e in c.registry.engines}
        ok = sidecar_ok and any(engines.values())
        return JSONResponse({"ready": ok, "render": sidecar_ok, "engines": engines,
                             "inflight": c.pipeline.inflight}, status_code=200 if ok else 503)

    if settings.server.metrics:
        @app.get("/metrics")
        async def metrics() -> Response:
            for e in c.registry.engines:
                c.metrics.engine_inflight.labels(e.url).set(e.inflight_requests)
            return Response(generate_latest(c.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _sync_catalog(c: Components) -> None:
    """Learn max_model_len from the sidecar as soon as it answers (it may start after us)."""
    for _ in range(3600):
        if await c.pipeline.catalog.sync():
            return
        await asyncio.sleep(1.0)
