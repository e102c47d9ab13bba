"""The render fallback and the native route against fake parts (no vLLM engine starts here).

The native engine is played by a small OpenAI server (``FakeNativeEngine``): canned chat answers, a
stream that lasts until the client leaves, a bare 404 on ``/inference/v1/generate``, and a record of
what it was sent. The render sidecar is either a dead port or the real one (for the token route).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from coordinator.config import EngineSettings, ModelSettings
from tests.conftest import MAX_MODEL_LEN, SERVED, CoordinatorFactory
from tests.support import CoordinatorServer, free_port, sse_events, streamed_text, wait_until
from token_engine.simulator import SimConfig, SimulatedEngine

WORDS = ["Paris", " is", " the", " capital", "."]


class FakeNativeEngine:
    """An engine's OpenAI API, just enough for the native route; no token-only route."""

    def __init__(self) -> None:
        self.port = free_port()
        self.bodies: list[dict[str, Any]] = []
        self.request_ids: list[str] = []
        self.open_streams = 0
        self.generate_calls = 0
        app = Starlette(routes=[
            Route("/health", lambda r: Response()),
            Route("/metrics", lambda r: Response("")),
            Route("/v1/models", lambda r: JSONResponse(
                {"data": [{"id": SERVED, "max_model_len": MAX_MODEL_LEN}]})),
            Route("/inference/v1/generate", self._generate, methods=["POST"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
        ])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="fake-native")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _generate(self, request: Request) -> Response:
        self.generate_calls += 1
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    async def _chat(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.bodies.append(body)
        self.request_ids.append(request.headers.get("x-request-id", ""))
        if not body.get("stream"):
            return JSONResponse({"id": "chatcmpl-engine", "object": "chat.completion", "model": body["model"],
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(WORDS)},
                                              "finish_reason": "stop"}],
                                 "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}})
        endless = bool(body.get("ignore_eos"))

        async def frames() -> AsyncIterator[bytes]:
            self.open_streams += 1
            try:
                i = 0
                while endless or i < len(WORDS):
                    chunk = {"id": "chatcmpl-engine", "object": "chat.completion.chunk", "model": body["model"],
                             "choices": [{"index": 0, "delta": {"content": WORDS[i % len(WORDS)]}}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                    i += 1
                    await asyncio.sleep(0.01)
                yield b"data: [DONE]\n\n"
            finally:
                self.open_streams -= 1

        return StreamingResponse(frames(), media_type="text/event-stream")

    def __enter__(self) -> FakeNativeEngine:
        self.thread.start()
        assert wait_until(lambda: self.server.started, timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def native() -> Iterator[FakeNativeEngine]:
    with FakeNativeEngine() as engine:
        yield engine


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Capital of France?"}], **extra}


def models(model_dir: Path) -> list[ModelSettings]:
    return [ModelSettings(name=SERVED, aliases=["gpt-4o-mini"], path=str(model_dir))]


def dead_render() -> str:
    return f"http://127.0.0.1:{free_port()}"


def released(coord: CoordinatorServer) -> bool:
    c = coord.components
    return (coord.wait_idle() == 0 and c.ledger.global_inflight == 0 and c.native is not None
            and c.native.client.open_streams == 0
            and all(e.inflight_requests == 0 for e in c.registry.engines))


def test_render_down_serves_through_the_native_engine(native: FakeNativeEngine, model_dir: Path,
                                                      coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(dead_render(), [], models=models(model_dir),
                                engines=[EngineSettings(url=native.url, native_api=True)],
                                limits={"default_max_tokens": 50})
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), headers={"X-Request-Id": "q1"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-coordinator-route"] == "native" and r.headers["x-tokenizer-source"] == "local"
    assert r.json()["id"] == "chatcmpl-q1" and r.json()["choices"][0]["message"]["content"] == "Paris is the capital."
    sent = native.bodies[-1]
    assert sent["model"] == SERVED and sent["max_tokens"] == 50  # alias resolved, default cap applied
    assert native.request_ids[-1].startswith("q1-")                # unique per attempt

    r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(stream=True), timeout=60)
    events = sse_events(r)
    assert r.headers["x-coordinator-route"] == "native" and events[-1] == "[DONE]"
    assert streamed_text(events)[0] == "Paris is the capital."
    assert {e["id"] for e in events[:-1]} == {"chatcmpl-" + r.headers["x-request-id"]}
    assert released(coord)


def test_client_leaving_a_native_stream_closes_it_upstream(native: FakeNativeEngine, model_dir: Path,
                                                           coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(dead_render(), [], models=models(model_dir),
                                engines=[EngineSettings(url=native.url, native_api=True)])
    with httpx.Client(timeout=30) as c, c.stream("POST", f"{coord.url}/v1/chat/completions",
                                                 json=chat(stream=True, ignore_eos=True)) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert native.open_streams == 1
    assert wait_until(lambda: native.open_streams == 0, timeout=10)
    assert wait_until(lambda: released(coord), timeout=10)


def test_render_down_without_a_native_engine_is_a_clear_502(model_dir: Path,
                                                            coordinator_factory: CoordinatorFactory) -> None:
    with SimulatedEngine(SimConfig(model=SERVED)) as sim:
        coord = coordinator_factory(dead_render(), [sim.url], models=models(model_dir))
        r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30)
        assert r.status_code == 502
        message = r.json()["error"]["message"]
        assert "render is unavailable" in message and "no engine serves the OpenAI API" in message
        ready = httpx.get(f"{coord.url}/ready", timeout=10).json()
        assert ready["ready"] is False and ready["render_fallback"] is False


def test_obfuscation_refuses_the_native_route(native: FakeNativeEngine, model_dir: Path, tmp_path: Path,
                                              coordinator_factory: CoordinatorFactory) -> None:
    key = tmp_path / "token.key"
    key.write_bytes(bytes(range(32)))
    coord = coordinator_factory(dead_render(), [], models=models(model_dir),
                                engines=[EngineSettings(url=native.url, native_api=True)],
                                obfuscation={"enabled": True, "key_file": str(key)})
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30)
    assert r.status_code == 503 and "obfuscation" in r.json()["error"]["message"]
    assert native.bodies == []


@pytest.fixture
def not_token_engines(native: FakeNativeEngine) -> Iterator[tuple[SimulatedEngine, FakeNativeEngine]]:
    """A simulated engine and the fake native one, both answering a bare 404 on the token route."""
    with SimulatedEngine(SimConfig(model=SERVED)) as sim:
        sim.set_faults(fail_next=1000, fail_status=404, fail_body={"detail": "Not Found"})
        yield sim, native


def test_a_missing_token_route_falls_back_to_the_native_route(
        render_sidecar: Any, not_token_engines: tuple[SimulatedEngine, FakeNativeEngine],
        coordinator_factory: CoordinatorFactory) -> None:
    sim, native = not_token_engines
    coord = coordinator_factory(render_sidecar.url, [], engines=[EngineSettings(url=sim.url),
                                                                 EngineSettings(url=native.url, native_api=True)])
    for body in (chat(), chat(stream=True)):
        r = httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-coordinator-route"] == "native" and "x-tokenizer-source" not in r.headers
    assert native.generate_calls >= 1 and len(native.bodies) == 2
    assert released(coord)


def test_a_missing_token_route_without_a_native_engine_is_a_502(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    with SimulatedEngine(SimConfig(model=SERVED)) as sim:
        sim.set_faults(fail_next=1000, fail_status=501)
        coord = coordinator_factory(render_sidecar.url, [sim.url])
        r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30)
        assert r.status_code == 502 and "/inference/v1/generate" in r.json()["error"]["message"]


def test_a_missing_token_route_does_not_open_breakers(
        render_sidecar: Any, not_token_engines: tuple[SimulatedEngine, FakeNativeEngine],
        coordinator_factory: CoordinatorFactory) -> None:
    sim, native = not_token_engines
    coord = coordinator_factory(render_sidecar.url, [], engines=[EngineSettings(url=sim.url),
                                                                 EngineSettings(url=native.url, native_api=True)],
                                resilience={"breaker_failures": 2})
    for _ in range(3):
        assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=60).status_code == 200
    assert all(e.breaker.state == "closed" for e in coord.components.registry.engines)
