"""The observation record end to end: real render sidecar, simulated engine, both doors on a socket.

An HTTP request and an NNRP operation fill the same record fields, ``/metrics`` carries the
request-level histograms per door, and a cancelled operation learns that the engine accepted the abort.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from coordinator.nnrp.client import NnrpClient
from coordinator.observability.record import Record
from tests.conftest import CoordinatorFactory
from tests.support import CoordinatorServer, wait_until
from token_engine.simulator import SimConfig, SimulatedEngine

SERVED = "smollm2-135m-instruct"
# Filled for every streamed request whichever door it came through.
COMMON = ("request_id", "connection_id", "transport", "model", "tenant", "operation", "stream", "route", "status",
          "outcome", "render_ms", "queue_delay_ms", "first_engine_chunk_ms", "first_event_ms",
          "prompt_tokens", "completion_tokens", "e2e_ms")


@pytest.fixture
def sim() -> Iterator[SimulatedEngine]:
    with SimulatedEngine(SimConfig(model=SERVED, mode="context", decode_s_per_token=0.02)) as s:
        yield s


@pytest.fixture
def coord(render_sidecar: Any, sim: SimulatedEngine, coordinator_factory: CoordinatorFactory
          ) -> CoordinatorServer:
    return coordinator_factory(render_sidecar.url, [sim.url])


def records(coord: CoordinatorServer) -> list[Record]:
    observer = coord.components.pipeline.observer
    assert observer is not None
    if observer.records is None:
        observer.records = []
    return observer.records


def body(max_tokens: int) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}


def ws_url(coord: CoordinatorServer) -> str:
    return coord.url.replace("http://", "ws://") + "/nnrp/v1"


async def test_both_doors_fill_the_same_record_and_metrics(coord: CoordinatorServer) -> None:
    seen = records(coord)
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{coord.url}/v1/chat/completions", json=body(12),
                            headers={"X-Request-Id": "rec-http-1"})
        assert r.status_code == 200 and "[DONE]" in r.text
    async with await NnrpClient.connect(ws_url(coord)) as client:
        events = await (await client.chat(body(12), op_id="op-rec")).collect()
        assert events[-1]["type"] == "response.completed"
    assert wait_until(lambda: len(seen) == 2, 5)
    by_door = {rec.door: rec.to_dict() for rec in seen}
    http_rec, nnrp_rec = by_door["http"], by_door["nnrp"]
    for key in COMMON:
        assert http_rec[key] is not None, ("http", key)
        assert nnrp_rec[key] is not None, ("nnrp", key)
    assert http_rec["request_id"] == "rec-http-1" and http_rec["transport"] == "http/sse"
    assert nnrp_rec["transport"] == "websocket/json" and nnrp_rec["operation_id"] == "op-rec"
    assert nnrp_rec["session_id"] and nnrp_rec["frame_id"] is not None
    for key in ("model", "operation", "stream", "route", "status", "outcome", "prompt_tokens",
                "completion_tokens"):
        assert http_rec[key] == nnrp_rec[key], key
    assert http_rec["model"] == SERVED and http_rec["completion_tokens"] == 12
    assert http_rec["output_events"] > 1 and nnrp_rec["output_events"] == len(events)
    assert http_rec["error_family"] is None and nnrp_rec["cancel_source"] is None

    text = await asyncio.to_thread(lambda: httpx.get(f"{coord.url}/metrics", timeout=10).text)
    for door in ("http", "nnrp"):
        labels = f'door="{door}",model="{SERVED}"'
        for name in ("coordinator_request_ttft_seconds_count", "coordinator_request_inter_token_seconds_count",
                     "coordinator_request_e2e_seconds_count"):
            assert f"{name}{{{labels}}}" in text, (name, door)
        assert f'coordinator_requests_total{{{labels},status="200"}} 1.0' in text


async def test_cancelled_operation_reports_the_engine_accepted_the_abort(coord: CoordinatorServer,
                                                                         sim: SimulatedEngine) -> None:
    seen = records(coord)
    async with await NnrpClient.connect(ws_url(coord)) as client:
        op = await client.chat(body(300), op_id="op-cancel", policy={"diagnostics": "summary"})
        got = []
        async for ev in op:
            got.append(ev)
            if len(got) == 3:
                await op.cancel("enough")
        cancelled = got[-1]
        assert cancelled["type"] == "response.cancelled"
        # Sent at once: the engine's answer may not be known yet, and is never waited for.
        assert cancelled["diagnostics"]["engine_abort_accepted"] in (None, True)
        for _ in range(100):  # the summary follows once the engine answered the abort
            if op.diagnostics:
                break
            await asyncio.sleep(0.1)
        summary = op.diagnostics[0]["record"]
    assert summary["engine_abort_accepted"] is True
    assert summary["state"] == "cancelled" and summary["cancel_source"] == "client"
    assert summary["status"] == 499 and summary["released"] is True
    assert sim.state()["aborted"]
    assert wait_until(lambda: len(seen) == 1, 5)
    assert seen[0].engine_abort_accepted is True and seen[0].cancel_reason == "enough"
    text = await asyncio.to_thread(lambda: httpx.get(f"{coord.url}/metrics", timeout=10).text)
    assert 'coordinator_engine_aborts_total{result="accepted"}' in text
