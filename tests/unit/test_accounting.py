"""``GET /admin/accounting``: every count the coordinator holds, behind the admin API keys."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from fastapi import FastAPI
from pydantic import SecretStr

from coordinator.api.admin import build_admin_router
from coordinator.api.auth import ApiKeyCheck
from coordinator.config import AdmissionSettings, EngineSettings, Settings
from coordinator.observability.accounting import Accounting
from coordinator.observability.metrics import Metrics
from coordinator.pipeline.admission.budget import TokenLedger
from coordinator.pipeline.admission.controller import AdmissionController
from coordinator.pipeline.engines.registry import EngineRegistry


@dataclass
class Counts:
    inflight: int = 0
    open_sessions: int = 0
    producer_tasks: int = 0
    open_streams: int = 0
    pending_aborts: int = 0
    outstanding: int = 0


def build() -> tuple[FastAPI, Counts, EngineRegistry, Metrics]:
    settings = Settings(engines=[EngineSettings(url="http://e0:8000")])
    metrics = Metrics()
    registry = EngineRegistry(settings, httpx.AsyncClient(), metrics)
    ledger = TokenLedger(None)
    admission = AdmissionController(AdmissionSettings(), ledger, metrics)
    live = Counts()
    accounting = Accounting(live, live, ledger, admission, live, lambda: [live], lambda: registry.engines)
    accounting.export(metrics)
    app = FastAPI()
    app.include_router(build_admin_router(registry, admission, ApiKeyCheck([SecretStr("k")]),
                                          accounting=accounting.snapshot))
    return app, live, registry, metrics


async def test_accounting_reports_every_count_and_their_sum() -> None:
    app, live, registry, metrics = build()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c") as c:
        assert (await c.get("/admin/accounting")).status_code == 401
        auth = {"authorization": "Bearer k"}
        idle = (await c.get("/admin/accounting", headers=auth)).json()
        assert idle["held"] == 0 and idle["engines"] == [
            {"url": "http://e0:8000", "inflight_requests": 0, "inflight_tokens": 0}]
        assert set(idle) >= {"inflight_requests", "admission_tokens", "queued", "open_stream_sessions",
                             "producer_tasks", "open_engine_streams", "open_native_streams",
                             "pending_engine_aborts", "sidecar_calls"}
        live.producer_tasks, live.open_streams, live.outstanding = 2, 1, 3
        registry.engines[0].inflight_requests = 1
        busy = (await c.get("/admin/accounting", headers=auth)).json()
        assert (busy["producer_tasks"], busy["open_engine_streams"], busy["sidecar_calls"]) == (2, 1, 3)
        assert busy["held"] == 7
    assert metrics.registry.get_sample_value("coordinator_producer_tasks") == 2
    assert metrics.registry.get_sample_value("coordinator_sidecar_calls_inflight") == 3
