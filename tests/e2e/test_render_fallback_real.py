"""Render fallback and the native route on real vLLM processes.

* Render unreachable from the start: the local tokenizer computes the prompt ids and an engine marked
  ``native_api`` (``--enable-scale-out``) answers through its OpenAI API; greedy text equals the normal
  path (render + token-only engine), and the response headers and the log say local + native.
* Render stopped mid-run and started again: requests answer through the fallback while it is down and
  use render again once it is back.
* A 4xx from render is the client's error: returned as is, never retried through the fallback.
* Engines answering a bare 404 on ``/inference/v1/generate``: the request takes the native route.
* Render off (``render.enable: false``, the RFC's switch): no sidecar at all, every request tokenized
  locally and answered by the engine's own API, equal to the normal path, with no fallback warnings.
* Messages and Responses without the sidecar (down or off): the native chain, the client's body to the
  engine's own ``/v1/messages`` and ``/v1/responses``, equal to that engine's answer.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from coordinator.config import EngineSettings, ModelSettings
from tests.conftest import MAX_MODEL_LEN, SERVED, CoordinatorFactory, VllmStack, make_settings
from tests.support import CoordinatorServer, free_port, generate_calls, sse_events, streamed_text, wait_until
from token_engine.simulator import SimConfig, SimulatedEngine

pytestmark = pytest.mark.e2e

QUESTION = "What is the capital of France?"


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": QUESTION}],
            "temperature": 0, "max_tokens": 24, **extra}


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "prompt": "The capital of France is", "temperature": 0,
            "max_tokens": 12, **extra}


# Chat and completions, JSON and SSE: what each native-route test sends.
EVERY_FORM = [("/v1/chat/completions", chat(), "chat"), ("/v1/chat/completions", chat(stream=True), "chat"),
              ("/v1/completions", completion(), "completion"),
              ("/v1/completions", completion(stream=True), "completion")]


def models(model_dir: Path) -> list[ModelSettings]:
    return [ModelSettings(name=SERVED, aliases=["gpt-4o-mini"], path=str(model_dir))]


def engines(stack: VllmStack, native_url: str | None = None) -> list[EngineSettings]:
    return [EngineSettings(url=stack.engine.url),
            EngineSettings(url=native_url or stack.native.url, native_api=True)]


def ask(coord: CoordinatorServer, path: str, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(f"{coord.url}{path}", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r


def text_of(r: httpx.Response, kind: str = "chat") -> str:
    if r.headers["content-type"].startswith("text/event-stream"):
        return streamed_text(sse_events(r), kind)[0]
    choice = r.json()["choices"][0]
    return str(choice["message"]["content"] if kind == "chat" else choice["text"])


def route_of(r: httpx.Response) -> tuple[str | None, str | None]:
    return r.headers.get("x-coordinator-route"), r.headers.get("x-tokenizer-source")


def assert_nothing_held(coord: CoordinatorServer) -> None:
    c = coord.components
    assert coord.wait_idle() == 0
    assert wait_until(lambda: c.ledger.global_inflight == 0 and all(
        e.inflight_requests == 0 and e.inflight_tokens == 0 for e in c.registry.engines))
    assert c.native is not None and c.native.client.open_streams == 0


@pytest.fixture(scope="module")
def normal(vllm_stack: VllmStack) -> Iterator[CoordinatorServer]:
    """The normal path (render + token-only engine): the reference outputs."""
    with CoordinatorServer(make_settings(vllm_stack.render_url, [vllm_stack.engine.url])) as server:
        yield server


def test_render_unreachable_from_start_answers_through_local_tokenizer_and_native_route(
        vllm_stack: VllmStack, normal: CoordinatorServer, model_dir: Path,
        coordinator_factory: CoordinatorFactory, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="coordinator")
    coord = coordinator_factory(f"http://127.0.0.1:{free_port()}", [], engines=engines(vllm_stack),
                                models=models(model_dir))
    for path, body, kind in EVERY_FORM:
        expected = text_of(ask(normal, path, body), kind)
        r = httpx.post(f"{coord.url}{path}", json=body, headers={"X-Request-Id": "fb-1"}, timeout=180)
        assert r.status_code == 200, r.text
        assert route_of(r) == ("native", "local")
        assert text_of(r, kind) == expected != ""
        ids = [e["id"] for e in sse_events(r) if isinstance(e, dict)] if body.get("stream") else [r.json()["id"]]
        assert set(ids) == {("chatcmpl-" if kind == "chat" else "cmpl-") + "fb-1"}
    usage = ask(coord, "/v1/chat/completions", chat()).json()["usage"]
    assert usage["completion_tokens"] > 0 and usage["prompt_tokens"] > 10
    fallbacks = [r.getMessage() for r in caplog.records if "event=render_fallback" in r.getMessage()]
    assert fallbacks and "fallback=local_tokenizer" in fallbacks[0] and "request_id=fb-1" in fallbacks[0]
    rendered = [r.getMessage() for r in caplog.records if "event=render request_id=fb-1" in r.getMessage()]
    assert rendered and "tokenizer_source=local" in rendered[0] and "route=native" in rendered[0]
    ready = httpx.get(f"{coord.url}/ready", timeout=10).json()
    assert ready["render"] is False and ready["render_fallback"] is True and ready["ready"] is True
    assert_nothing_held(coord)


def test_render_off_sends_every_request_down_the_native_chain(
        vllm_stack: VllmStack, normal: CoordinatorServer, model_dir: Path,
        coordinator_factory: CoordinatorFactory, caplog: pytest.LogCaptureFixture) -> None:
    """No sidecar runs at the configured address, and none is asked: not a fallback but the route.
    Neither engine is marked: the coordinator learns that the ``--enable-scale-out`` one serves its
    own API and the ``--tokens-only`` one does not (its ``/v1/chat/completions`` would fail), so every
    request lands on the first."""
    caplog.set_level(logging.INFO, logger="coordinator")
    coord = coordinator_factory(f"http://127.0.0.1:{free_port()}", [], render={"enable": False},
                                engines=[EngineSettings(url=vllm_stack.engine.url),
                                         EngineSettings(url=vllm_stack.native.url)],
                                models=models(model_dir))
    tokens_only, scale_out = coord.components.registry.engines
    assert (tokens_only.learned_native_api, scale_out.learned_native_api) == (False, True)
    for path, body, kind in EVERY_FORM:
        expected = text_of(ask(normal, path, body), kind)
        r = ask(coord, path, body)
        assert route_of(r) == ("native", "local")
        assert text_of(r, kind) == expected != ""
    messages = httpx.post(f"{coord.url}/v1/messages", json={
        "model": SERVED, "max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}]}, timeout=60)
    assert messages.status_code == 200 and route_of(messages) == ("native", "local"), messages.text
    assert not [r for r in caplog.records if "event=render_fallback" in r.getMessage()]
    ready = httpx.get(f"{coord.url}/ready", timeout=10).json()
    assert ready["render"] == "off" and ready["ready"] is True
    assert_nothing_held(coord)


def test_client_disconnect_on_the_native_route_releases_everything(
        vllm_stack: VllmStack, model_dir: Path, coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(f"http://127.0.0.1:{free_port()}", [], engines=engines(vllm_stack),
                                models=models(model_dir))
    body = chat(stream=True, max_tokens=1000, ignore_eos=True)
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{coord.url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and route_of(r) == ("native", "local")
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert coord.components.native is not None and coord.components.native.client.open_streams == 1
    assert_nothing_held(coord)
    running = httpx.get(f"{vllm_stack.native.url}/metrics", timeout=10).text
    assert wait_until(lambda: _running(vllm_stack.native.url) == 0, timeout=10), running


def _running(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_render_stopped_mid_run_then_back(vllm_stack: VllmStack, model_dir: Path, logs_dir: Path,
                                          coordinator_factory: CoordinatorFactory) -> None:
    from render_sidecar.launch import RenderSidecar

    port = free_port()

    def sidecar() -> Any:
        return RenderSidecar(model_dir, port=port, served_model_name=SERVED, max_model_len=MAX_MODEL_LEN,
                             log_path=logs_dir / "render-restart.log", echo=False)

    render = sidecar()
    try:
        render.start()
        render.wait_ready(timeout=600)
        coord = coordinator_factory(render.url, [], engines=engines(vllm_stack), models=models(model_dir))
        before = ask(coord, "/v1/chat/completions", chat())
        assert route_of(before) == (None, None)

        render.stop()
        down = ask(coord, "/v1/chat/completions", chat())
        down_stream = ask(coord, "/v1/chat/completions", chat(stream=True))
        assert route_of(down) == route_of(down_stream) == ("native", "local")
        assert text_of(down) == text_of(down_stream) == text_of(before)

        render = sidecar()
        render.start()
        render.wait_ready(timeout=600)
        after = ask(coord, "/v1/chat/completions", chat())
        after_stream = ask(coord, "/v1/chat/completions", chat(stream=True))
        assert route_of(after) == route_of(after_stream) == (None, None)
        assert text_of(after) == text_of(after_stream) == text_of(before)
        assert_nothing_held(coord)
    finally:
        render.stop()


def test_render_client_error_is_returned_not_retried_locally(
        vllm_stack: VllmStack, model_dir: Path, coordinator_factory: CoordinatorFactory,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="coordinator")
    coord = coordinator_factory(vllm_stack.render_url, [], engines=engines(vllm_stack), models=models(model_dir))
    too_long = chat(messages=[{"role": "user", "content": "word " * 3000}], max_tokens=None)
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=too_long, timeout=60)
    assert r.status_code == 400, r.text
    assert "context length" in r.json()["error"]["message"] and route_of(r) == (None, None)
    assert not [rec for rec in caplog.records if "render_fallback" in rec.getMessage()]
    assert_nothing_held(coord)


class Route404Proxy:
    """A real engine behind a proxy whose ``/inference/v1/generate`` answers FastAPI's bare 404: an
    engine that serves the OpenAI API but not the token-only route."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.port = free_port()
        self.generate_calls = 0
        self.server = uvicorn.Server(uvicorn.Config(
            Starlette(routes=[Route("/{path:path}", self._handle, methods=["GET", "POST"])]),
            host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="route-404-proxy")
        self._http: httpx.AsyncClient | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, request: Request) -> Response:
        if request.url.path == "/inference/v1/generate":
            self.generate_calls += 1
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(300, connect=5))
        upstream = self._http.build_request(
            request.method, f"{self.upstream}{request.url.path}", content=await request.body(),
            headers={k: v for k, v in request.headers.items() if k.lower() in ("content-type", "x-request-id")})
        resp = await self._http.send(upstream, stream=True)
        return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type"), background=BackgroundTask(resp.aclose))

    def __enter__(self) -> Route404Proxy:
        self.thread.start()
        assert wait_until(lambda: self.server.started, timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_engines_without_the_token_route_fall_back_to_the_native_route(
        vllm_stack: VllmStack, normal: CoordinatorServer, model_dir: Path,
        coordinator_factory: CoordinatorFactory) -> None:
    with SimulatedEngine(SimConfig(model=SERVED)) as sim, Route404Proxy(vllm_stack.native.url) as proxy:
        sim.set_faults(fail_next=1000, fail_status=404, fail_body={"detail": "Not Found"})
        coord = coordinator_factory(vllm_stack.render_url, [], models=models(model_dir),
                                    engines=[EngineSettings(url=sim.url), EngineSettings(url=proxy.url, native_api=True)])
        for body in (chat(), chat(stream=True), chat(stream=True, stream_options={"include_usage": True})):
            r = ask(coord, "/v1/chat/completions", body)
            assert route_of(r) == ("native", None)
            assert text_of(r) == text_of(ask(normal, "/v1/chat/completions", body)) != ""
        assert proxy.generate_calls >= 3
        assert_nothing_held(coord)


MESSAGES = {"model": SERVED, "max_tokens": 16, "temperature": 0, "system": "Answer briefly.",
            "messages": [{"role": "user", "content": QUESTION}]}
RESPONSES = {"model": SERVED, "max_output_tokens": 16, "temperature": 0, "instructions": "Answer briefly.",
             "input": QUESTION}


def messages_text(r: httpx.Response) -> str:
    if r.headers["content-type"].startswith("text/event-stream"):
        return "".join(e["delta"].get("text", "") for e in anthropic_events(r) if e["type"] == "content_block_delta")
    return "".join(b.get("text", "") for b in r.json()["content"])


def responses_text(r: httpx.Response) -> str:
    if r.headers["content-type"].startswith("text/event-stream"):
        return "".join(e["delta"] for e in anthropic_events(r) if e["type"] == "response.output_text.delta")
    return "".join(c["text"] for item in r.json()["output"] if item["type"] == "message"
                   for c in item["content"] if c["type"] == "output_text")


def anthropic_events(r: httpx.Response) -> list[dict[str, Any]]:
    """``event: <type>`` + ``data: <json>`` frames (Messages and Responses), the name checked."""
    out = []
    for block in r.text.strip().split("\n\n"):
        name, data = block.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}", block
        out.append(event)
    return out


NATIVE_APIS = [("/v1/messages", MESSAGES, messages_text), ("/v1/responses", RESPONSES, responses_text)]


@pytest.mark.parametrize("render", ["down", "off"])
def test_responses_and_messages_take_the_engines_own_api_without_the_sidecar(
        render: str, vllm_stack: VllmStack, model_dir: Path, coordinator_factory: CoordinatorFactory,
        caplog: pytest.LogCaptureFixture) -> None:
    """The RFC's native chain: with render down or off, ``/v1/messages`` and ``/v1/responses`` go as
    they are to a ``native_api`` engine's own routes, admitted and placed like any request, and the
    answer equals the same engine's, JSON and SSE, event for event."""
    caplog.set_level(logging.INFO, logger="coordinator")
    coord = coordinator_factory(f"http://127.0.0.1:{free_port()}", [], engines=engines(vllm_stack),
                                models=models(model_dir), render={"enable": render == "down"})
    token_calls = generate_calls(vllm_stack.engine.url)
    for path, body, text in NATIVE_APIS:
        for stream in (False, True):
            sent = {**body, "stream": stream}
            direct = httpx.post(f"{vllm_stack.native.url}{path}", json=sent, timeout=120)
            assert direct.status_code == 200, direct.text
            r = httpx.post(f"{coord.url}{path}", json={**sent, "model": "gpt-4o-mini"}, timeout=120)
            assert r.status_code == 200, r.text
            assert route_of(r) == ("native", "local")
            assert text(r) == text(direct) != ""
            if stream:
                kinds = [e["type"] for e in anthropic_events(r)]
                assert kinds == [e["type"] for e in anthropic_events(direct)], kinds
    count = {k: v for k, v in MESSAGES.items() if k not in ("max_tokens", "temperature")}
    direct = httpx.post(f"{vllm_stack.native.url}/v1/messages/count_tokens", json=count, timeout=60)
    ours = httpx.post(f"{coord.url}/v1/messages/count_tokens", json={**count, "model": "gpt-4o-mini"}, timeout=60)
    assert ours.status_code == direct.status_code == 200, (ours.text, direct.text)
    assert ours.json()["input_tokens"] == direct.json()["input_tokens"] > 5
    chains = [r.getMessage() for r in caplog.records if "event=native_api" in r.getMessage()]
    assert len(chains) == 4 and "api=messages" in chains[0] and "prompt_tokens=" in chains[0]
    assert generate_calls(vllm_stack.engine.url) == token_calls  # the token-only engine saw none
    assert_nothing_held(coord)


def test_native_chain_errors_keep_each_apis_shape(
        vllm_stack: VllmStack, model_dir: Path, coordinator_factory: CoordinatorFactory) -> None:
    """The client's mistake is the engine's 4xx in the API's own error shape; with no engine serving
    the API the answer is a 502 naming the sidecar, and nothing reaches an engine."""
    coord = coordinator_factory(f"http://127.0.0.1:{free_port()}", [], engines=engines(vllm_stack),
                                models=models(model_dir))
    no_budget = {k: v for k, v in MESSAGES.items() if k != "max_tokens"}
    m = httpx.post(f"{coord.url}/v1/messages", json=no_budget, timeout=30)
    assert m.status_code == 400 and m.json()["error"]["type"] == "invalid_request_error", m.text
    bad = httpx.post(f"{coord.url}/v1/messages", json={**MESSAGES, "messages": "hi"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["type"] == "error", bad.text
    r = httpx.post(f"{coord.url}/v1/responses", json={**RESPONSES, "temperature": "hot"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError", r.text
    token_only = coordinator_factory(f"http://127.0.0.1:{free_port()}", [vllm_stack.engine.url],
                                     models=models(model_dir))
    r = httpx.post(f"{token_only.url}/v1/responses", json=RESPONSES, timeout=30)
    assert r.status_code == 502 and "render sidecar" in r.json()["error"]["message"], r.text
    assert "native_api" in r.json()["error"]["message"]
    m = httpx.post(f"{token_only.url}/v1/messages", json=MESSAGES, timeout=30)
    assert m.status_code == 502 and m.json()["error"]["type"] == "api_error", m.text
    assert route_of(ask(coord, "/v1/chat/completions", chat())) == ("native", "local")  # the fallback is up
    assert_nothing_held(coord)
    assert_nothing_held(token_only)


async def test_nnrp_responses_take_the_engines_own_api_without_the_sidecar(
        vllm_stack: VllmStack, model_dir: Path, coordinator_factory: CoordinatorFactory) -> None:
    """The native chain on NNRP's ``responses.create`` too: render off, the engine's own Responses
    events are the operation's result events (its ``response.completed`` the terminal one), and the
    text equals the engine's answer over HTTP, streamed or not."""
    from coordinator.nnrp.client import NnrpClient

    coord = coordinator_factory(f"http://127.0.0.1:{free_port()}", [], engines=engines(vllm_stack),
                                models=models(model_dir), render={"enable": False})
    token_calls = generate_calls(vllm_stack.engine.url)
    async with httpx.AsyncClient(timeout=120) as http:
        direct = await http.post(f"{vllm_stack.native.url}/v1/responses", json={**RESPONSES, "stream": True})
    kinds = [e["type"] for e in anthropic_events(direct)]
    want = responses_text(direct)
    url = coord.url.replace("http://", "ws://") + "/nnrp/v1"
    async with await NnrpClient.connect(url) as client:
        whole = await (await client.responses({**RESPONSES, "model": "gpt-4o-mini"})).collect()
        streamed = await (await client.responses({**RESPONSES, "model": "gpt-4o-mini", "stream": True})).collect()
    assert [e["type"] for e in whole] == ["response.completed"], whole
    response = whole[0]["response"]
    assert "".join(c["text"] for item in response["output"] if item["type"] == "message"
                   for c in item["content"] if c["type"] == "output_text") == want != ""
    assert [e["type"] for e in streamed] == kinds, [e["type"] for e in streamed]
    assert "".join(e["delta"] for e in streamed if e["type"] == "response.output_text.delta") == want
    assert generate_calls(vllm_stack.engine.url) == token_calls  # the token-only engine saw none
    assert_nothing_held(coord)
