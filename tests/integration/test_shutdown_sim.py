"""Draining on shutdown (docs/shutdown.md), on simulated engines behind the real render sidecar.

``begin_drain`` is what SIGTERM does to ``python -m coordinator`` (tests/e2e/test_shutdown_real.py
sends the real signal to a real process); here the phases are checked cheaply and in detail:
``/ready`` turns 503 at once while requests are still served, the listener closes after the delay,
open streams finish, and at the deadline what is left ends with a retryable error, its engine
request aborted and its admission released. NNRP sessions close with 1001.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from coordinator.nnrp.client import NnrpClient
from tests.conftest import CoordinatorFactory
from tests.support import CoordinatorServer, StreamReader, refused, wait_until
from token_engine.simulator import SimConfig, SimulatedEngine

SERVED = "smollm2-135m-instruct"


@pytest.fixture
def sim() -> Iterator[SimulatedEngine]:
    with SimulatedEngine(SimConfig(model=SERVED, decode_s_per_token=0.02)) as engine:
        yield engine


def chat(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, **extra}


async def until(pred: Callable[[], object], within: float = 10.0) -> bool:
    """``wait_until`` for async tests: the NNRP client reads its frames on this event loop."""
    deadline = time.monotonic() + within
    while True:
        if pred() or time.monotonic() > deadline:
            return bool(pred())
        await asyncio.sleep(0.02)


def ready(url: str) -> httpx.Response:
    return httpx.get(f"{url}/ready", timeout=10)


def test_open_stream_finishes_while_ready_says_draining_and_the_listener_closes(
        render_sidecar: Any, sim: SimulatedEngine, coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url],
                                server={"drain_delay_s": 1.0, "drain_timeout_s": 30})
    assert ready(coord.url).status_code == 200
    reader = StreamReader(coord.url, chat(150, stream=True))  # ~3 s at 20 ms a token
    reader.start()
    assert reader.first.wait(30)
    coord.begin_drain()
    r = ready(coord.url)
    assert r.status_code == 503 and r.json()["ready"] is False and r.json()["draining"] is True
    # During the delay requests are still served: a load balancer may not have noticed yet.
    assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat(3), timeout=30).status_code == 200
    assert wait_until(lambda: refused(coord.url), timeout=10)
    assert reader.is_alive(), "the stream should outlive the listener"
    reader.join(30)
    events = reader.events
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events if isinstance(e, dict))
    finish = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c.get("finish_reason")]
    assert finish == ["length"]
    assert wait_until(lambda: coord.stopped, timeout=15)
    assert sim.state()["completed"] >= 2 and sim.state()["aborted"] == []


def test_deadline_ends_streams_and_requests_with_a_retryable_error_and_aborts_them(
        render_sidecar: Any, sim: SimulatedEngine, coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url],
                                server={"drain_delay_s": 0, "drain_timeout_s": 1.0})
    reader = StreamReader(coord.url, chat(1000, stream=True))  # ~20 s: far beyond the deadline
    reader.start()
    assert reader.first.wait(30)
    answer: list[httpx.Response] = []
    plain = threading.Thread(target=lambda: answer.append(
        httpx.post(f"{coord.url}/v1/chat/completions", json=chat(1000), timeout=60)), daemon=True)
    plain.start()
    assert wait_until(lambda: len(sim.state()["running"]) == 2, timeout=10)
    coord.begin_drain()
    reader.join(30)
    plain.join(30)
    events = reader.events
    assert reader.status == 200 and events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    tokens = sum(1 for e in events[:-2] for c in e["choices"] if (c.get("delta") or {}).get("content"))
    assert 0 < tokens < 1000
    assert answer[0].status_code == 503 and answer[0].json()["error"]["type"] == "ServiceUnavailableError"
    assert answer[0].headers["retry-after"] == "1"
    assert wait_until(lambda: sim.state()["running"] == [] and len(sim.state()["aborted"]) == 2)
    c = coord.components
    assert c.pipeline.inflight == 0 and c.ledger.global_inflight == 0
    # Metrics tell the truth: two requests ended by the server with the 503 their clients got, and no
    # client left (the cut takes the client-gone path inside, but the client was still there).
    # Each request's record is written as its handler ends, which may be just after its client read
    # the 503: wait for both.
    def samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in c.metrics.registry.collect() for s in fam.samples}

    def by_status() -> dict[str | None, float]:
        return {dict(k[1]).get("status"): v for k, v in samples().items()
                if k[0] == "coordinator_requests_total"}

    assert wait_until(lambda: by_status().get("503") == 2), by_status()
    assert "499" not in by_status()
    assert not any(v for k, v in samples().items() if k[0] == "coordinator_client_disconnects_total")
    assert wait_until(lambda: coord.stopped, timeout=15)


async def test_nnrp_sessions_go_away_after_their_operations(
        render_sidecar: Any, sim: SimulatedEngine, coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url],
                                server={"drain_delay_s": 0, "drain_timeout_s": 30})
    ws = coord.url.replace("http://", "ws://") + "/nnrp/v1"
    idle = await NnrpClient.connect(ws)
    busy = await NnrpClient.connect(ws)
    try:
        op = await busy.chat(chat(100, stream=True))  # ~2 s
        events = op.__aiter__()
        assert (await anext(events))["type"] == "response.output_text.delta"
        coord.begin_drain()
        assert await until(lambda: idle.close_code is not None)
        assert idle.close_code == 1001
        late = await (await busy.chat(chat(5, stream=True))).collect()
        assert [e["type"] for e in late] == ["response.error"] and late[0]["status"] == 503
        rest = [e async for e in events]
        assert rest[-1]["type"] == "response.completed"
        assert await until(lambda: busy.close_code is not None)
        assert busy.close_code == 1001
    finally:
        await idle.close()
        await busy.close()
    assert await until(lambda: coord.stopped, within=15)


async def test_nnrp_operation_open_at_the_deadline_is_cancelled_by_the_server(
        render_sidecar: Any, sim: SimulatedEngine, coordinator_factory: CoordinatorFactory) -> None:
    coord: CoordinatorServer = coordinator_factory(render_sidecar.url, [sim.url],
                                                   server={"drain_delay_s": 0, "drain_timeout_s": 0.5})
    client = await NnrpClient.connect(coord.url.replace("http://", "ws://") + "/nnrp/v1")
    try:
        op = await client.chat(chat(1000, stream=True))
        events = op.__aiter__()
        assert (await anext(events))["type"] == "response.output_text.delta"
        coord.begin_drain()
        last = [e async for e in events][-1]
        assert last["type"] == "response.cancelled" and last["diagnostics"]["source"] == "server"
        assert await until(lambda: client.close_code is not None)
        assert client.close_code == 1001
    finally:
        await client.close()
    assert await until(lambda: sim.state()["running"] == [] and len(sim.state()["aborted"]) == 1)
    assert await until(lambda: coord.stopped, within=15)
