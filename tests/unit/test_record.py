"""The observation record: filled by parts, finished exactly once, delivered after engine aborts answered."""

from __future__ import annotations

import asyncio
import contextvars
import logging

import pytest
from prometheus_client import CollectorRegistry

from coordinator.config import EngineClientSettings
from coordinator.observability.metrics import Metrics
from coordinator.observability.record import (
    CLIENT_CLOSED,
    Observer,
    Record,
    current,
    note_queue_delay,
    on_engine_abort,
)
from coordinator.pipeline.engines.breaker import CircuitBreaker
from coordinator.pipeline.engines.client import EngineClient
from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.errors import QueueFull


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_finish_delivers_exactly_once() -> None:
    observer = Observer(records=[])
    rec = observer.start("http", request_id="r1")
    rec.model, rec.stream = "m", True
    rec.output_event()
    rec.finish()
    rec.finish()
    rec.fail(RuntimeError("late"))  # after the end: ignored, the outcome stays
    assert observer.records == [rec]
    assert rec.outcome == "completed" and rec.status == 200
    d = rec.to_dict()
    assert d["door"] == "http" and d["output_events"] == 1 and d["first_event_ms"] is not None


def test_first_outcome_wins_and_gone_counts_a_disconnect() -> None:
    rec = Record("nnrp")
    rec.fail(QueueFull("full", 1.0))
    rec.cancel("client", "stop")
    assert (rec.outcome, rec.status, rec.error_family) == ("error", 429, "QueueFull")
    rec2 = Record("http")
    rec2.cancel("client_gone")
    rec2.gone()
    assert rec2.outcome == "cancelled" and rec2.status == CLIENT_CLOSED and rec2.client_gone


def test_a_request_the_server_ended_is_its_error_not_a_disconnect() -> None:
    rec = Record("http")
    rec.server_ended("ServiceUnavailableError", 503)
    rec.cancel("client_gone")      # the pipeline's client-gone path runs afterwards
    rec.gone()                     # and so does the door's
    assert (rec.outcome, rec.status, rec.error_family) == ("error", 503, "ServiceUnavailableError")
    assert not rec.client_gone


async def test_finish_waits_for_the_engine_to_answer_the_abort() -> None:
    observer = Observer(records=[])
    rec = observer.start("nnrp")
    answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    rec.abort_sent(answer)
    rec.cancel("client", "stop")
    assert rec.abort_answer() is None  # what response.cancelled can say at once
    rec.finish()
    assert observer.records == []      # not delivered while the abort is in flight
    waiter = asyncio.create_task(rec.delivered(5.0))
    answer.set_result(True)
    assert await waiter
    assert observer.records == [rec] and rec.engine_abort_accepted is True


async def test_an_unanswered_abort_is_not_accepted() -> None:
    rec = Record("nnrp")
    failed: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    failed.set_exception(RuntimeError("boom"))
    rec.abort_sent(failed)
    rec.finish()
    assert await rec.delivered(0.1)
    assert rec.engine_abort_accepted is False
    assert not await Record("http").delivered(0.01)  # never finished


async def test_deep_stages_reach_the_current_record() -> None:
    rec = Record("internal")

    async def request() -> None:
        current.set(rec)
        note_queue_delay(0.25)
        note_queue_delay(0.1)  # the longest wait of the request's engine requests
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        answer.set_result(True)
        on_engine_abort(answer)

    await asyncio.create_task(request(), context=contextvars.copy_context())
    note_queue_delay(9.0)  # another task's context: not this record
    assert rec.queue_delay_s == 0.25 and rec.abort_answer() is True


def test_metrics_from_records_go_into_the_registry_given() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    observer = Observer(metrics)
    for door in ("http", "nnrp"):
        rec = observer.start(door)  # type: ignore[arg-type]
        rec.model, rec.stream = "m", True
        rec.output_event()
        rec.output_event()
        rec.finish()
    gone = observer.start("nnrp")
    gone.model = "m"
    gone.gone("session", "connection closed")
    gone.finish()
    metrics.engine_abort(True)
    for door in ("http", "nnrp"):
        assert sample(registry, "coordinator_requests_total", door=door, model="m", status="200") == 1
        assert sample(registry, "coordinator_request_ttft_seconds_count", door=door, model="m") == 1
        assert sample(registry, "coordinator_request_inter_token_seconds_count", door=door, model="m") == 1
    assert sample(registry, "coordinator_request_e2e_seconds_count", door="nnrp", model="m") == 2
    assert sample(registry, "coordinator_requests_total", door="nnrp", model="m", status="499") == 1
    assert sample(registry, "coordinator_client_disconnects_total", door="nnrp") == 1
    assert sample(registry, "coordinator_engine_aborts_total", result="accepted") == 1


def test_request_event_per_finished_record(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="coordinator.request")
    rec = Observer().start("http", request_id="abc")
    rec.fail(QueueFull("full", 1.0))
    rec.finish()
    lines = [r for r in caplog.records if getattr(r, "event", None) == "request"]
    assert len(lines) == 1 and lines[0].request_id == "abc"  # type: ignore[attr-defined]
    assert lines[0].fields["error_family"] == "QueueFull"  # type: ignore[attr-defined]


async def test_engine_abort_reports_an_unreachable_engine() -> None:
    client = EngineClient(EngineClientSettings(connect_timeout_s=0.5))
    engine = Engine("http://127.0.0.1:9", "union", "m", 1.0, token_budget=1, breaker=CircuitBreaker(3, 10.0))
    seen: list[bool] = []
    client.on_abort = seen.append
    try:
        assert await client.abort_soon(engine, "r1") is False
    finally:
        await client.aclose()
    assert seen == [False]
