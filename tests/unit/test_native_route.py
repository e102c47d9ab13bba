"""The native route's own rules, with engines played by httpx.MockTransport: who may take it, the id
rewrite, breaker feeding, retries on another native engine, and that budgets are always released."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from coordinator.app import build_app
from coordinator.config import EngineSettings, ModelSettings, Settings
from coordinator.pipeline.admission.budget import TokenLedger
from coordinator.pipeline.admission.controller import AdmissionController
from coordinator.pipeline.context import PromptPlan, RequestContext, StopSpec
from coordinator.pipeline.engines.native import NativeClient
from coordinator.pipeline.engines.registry import EngineRegistry
from coordinator.pipeline.errors import (
    EngineBusy,
    TokenRouteMissing,
    UpstreamClientError,
    UpstreamUnavailable,
)
from coordinator.pipeline.native_route import NativeRoute, NativeRouteRefused
from coordinator.pipeline.scheduling.scheduler import Scheduler, build_profile
from coordinator.pipeline.topology.attempts import Attempts

MODEL = "m"
Handler = Callable[[httpx.Request], httpx.Response]


def settings(*engines: EngineSettings) -> Settings:
    return Settings(engines=list(engines), models=[ModelSettings(name=MODEL)])


def route(cfg: Settings, handler: Handler, obfuscated: bool = False) -> tuple[NativeRoute, EngineRegistry]:
    registry = EngineRegistry(cfg, httpx.AsyncClient())
    ledger = TokenLedger(None)
    admission = AdmissionController(cfg.admission, ledger)
    scheduler = Scheduler(registry, build_profile(cfg.scheduling, ledger.engine_room), index=None,
                          block_size=16, learn=False, topology=cfg.topology)
    client = NativeClient(cfg.engine_client, transport=httpx.MockTransport(handler))
    attempts = Attempts(registry, scheduler, admission, cfg.resilience)
    return NativeRoute(client, registry, attempts, obfuscated=lambda: obfuscated), registry


def ctx(stream: bool = False) -> RequestContext:
    c = RequestContext(kind="chat", request_id="abc", body={"model": MODEL, "messages": [], "stream": stream},
                       model=MODEL, stream=stream, include_usage=False)
    c.prompts = [PromptPlan(0, {"sampling_params": {"max_tokens": 7}}, [1, 2, 3], 1, StopSpec(()))]
    c.route = "native"
    return c


def openai_answer(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    assert body["max_tokens"] == 7 and body["model"] == MODEL
    if body["stream"]:
        frames = "".join(f"data: {json.dumps({'id': 'chatcmpl-engine', 'choices': [{'index': 0, 'delta': {'content': t}}]})}\n\n"
                         for t in ("Pa", "ris"))
        return httpx.Response(200, text=frames + "data: [DONE]\n\n", headers={"content-type": "text/event-stream"})
    return httpx.Response(200, json={"id": "chatcmpl-engine", "choices": [{"index": 0, "message": {"content": "Paris"}}]})


def held(registry: EngineRegistry) -> int:
    return sum(e.inflight_requests + e.inflight_tokens for e in registry.engines)


def test_who_may_take_the_native_route() -> None:
    plain = settings(EngineSettings(url="http://a"))
    native = settings(EngineSettings(url="http://a"), EngineSettings(url="http://b", native_api=True))
    pd_native = settings(EngineSettings(url="http://b", native_api=True, role="decode"))
    assert isinstance(route(plain, openai_answer)[0].refusal(MODEL, "render is down"), UpstreamUnavailable)
    assert "no engine serves the OpenAI API" in str(route(plain, openai_answer)[0].refusal(MODEL, "x"))
    assert route(pd_native, openai_answer)[0].refusal(MODEL, "x") is not None  # union only
    assert route(native, openai_answer)[0].refusal(MODEL, "x") is None
    refused = route(native, openai_answer, obfuscated=True)[0].refusal(MODEL, "x")
    assert isinstance(refused, NativeRouteRefused) and refused.status == 503


def test_takes_over_only_before_anything_was_sent() -> None:
    r, _ = route(settings(EngineSettings(url="http://b", native_api=True)), openai_answer)
    c = ctx()
    c.route = "tokens"
    c.visible = True
    assert not r.takes_over(c, TokenRouteMissing("404"))
    c.visible = False
    assert r.takes_over(c, TokenRouteMissing("404")) and c.route == "native"
    obf, _ = route(settings(EngineSettings(url="http://b", native_api=True)), openai_answer, obfuscated=True)
    assert not obf.takes_over(ctx(), TokenRouteMissing("404"))


def test_complete_goes_to_a_native_engine_only_and_rewrites_the_id() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.url.host}{request.url.path}")
        return openai_answer(request)

    r, registry = route(settings(EngineSettings(url="http://a"), EngineSettings(url="http://b", native_api=True)),
                        handler)
    out = asyncio.run(r.complete(ctx()))
    assert out["id"] == "chatcmpl-abc" and out["choices"][0]["message"]["content"] == "Paris"
    assert seen == ["b/v1/chat/completions"] and held(registry) == 0


def test_stream_passes_chunks_through_and_releases_on_close() -> None:
    r, registry = route(settings(EngineSettings(url="http://b", native_api=True)), openai_answer)

    async def go() -> list[dict[str, Any]]:
        c = ctx(stream=True)
        stream = await r.open_stream(c)
        assert held(registry) > 0
        try:
            chunks = [chunk async for chunk in stream.events()]
        finally:
            await stream.aclose()
        assert c.visible
        return chunks

    chunks = asyncio.run(go())
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == ["Pa", "ris"]
    assert {c["id"] for c in chunks} == {"chatcmpl-abc"} and held(registry) == 0
    assert r.client.open_streams == 0


def test_engine_failure_is_retried_on_another_native_engine_and_fed_to_its_breaker() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "b":
            return httpx.Response(500, text="boom")
        return openai_answer(request)

    cfg = settings(EngineSettings(url="http://b", native_api=True), EngineSettings(url="http://c", native_api=True))
    cfg.resilience.breaker_failures = 1
    r, registry = route(cfg, handler)
    for _ in range(2):  # whichever engine the scheduler tries first, the answer comes from c
        assert asyncio.run(r.complete(ctx()))["id"] == "chatcmpl-abc"
    b = registry.get("http://b")
    assert b is not None and b.breaker.state == "open" and held(registry) == 0


def test_native_route_retries_a_busy_engine_elsewhere_without_opening_its_breaker() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "b":
            return httpx.Response(429, json={"error": {"message": "busy", "type": "RateLimitError",
                                                       "param": None, "code": 429}})
        return openai_answer(request)

    cfg = settings(EngineSettings(url="http://b", native_api=True), EngineSettings(url="http://c", native_api=True))
    cfg.resilience.breaker_failures = 1
    r, registry = route(cfg, handler)
    for _ in range(2):
        assert asyncio.run(r.complete(ctx()))["id"] == "chatcmpl-abc"
    b = registry.get("http://b")
    assert b is not None and b.breaker.state == "closed" and held(registry) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_native_route_stops_retrying_once_engines_died_under_the_request(stream: bool) -> None:
    """The token path's bound (resilience.retries_after_engine_death) holds here too: a request whose
    engines die one after the other (a request that kills engines) is not retried through the fleet."""
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(503)  # gone
        calls.append(request.url.host)
        return httpx.Response(502, text="engine core died")

    cfg = settings(*(EngineSettings(url=f"http://{h}", native_api=True) for h in "bcde"))
    cfg.resilience.retries = 5
    cfg.resilience.retries_after_engine_death = 1
    cfg.resilience.backoff_initial_s = 0.001
    cfg.resilience.backoff_max_s = 0.001
    r, registry = route(cfg, handler)

    async def go() -> None:
        if stream:
            await r.open_stream(ctx(stream=True))
        else:
            await r.complete(ctx())

    with pytest.raises(UpstreamUnavailable):
        asyncio.run(go())
    assert len(calls) == 2 and len(set(calls)) == 2  # one death retried, the second ends it
    assert held(registry) == 0


def test_a_client_error_is_returned_and_does_not_count_against_the_engine() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "too long", "type": "BadRequestError",
                                                   "param": None, "code": 400}})

    cfg = settings(EngineSettings(url="http://b", native_api=True))
    cfg.resilience.breaker_failures = 1
    r, registry = route(cfg, handler)
    with pytest.raises(UpstreamClientError) as err:
        asyncio.run(r.complete(ctx()))
    assert err.value.status == 400 and registry.engines[0].breaker.state == "closed" and held(registry) == 0


def test_a_failure_mid_stream_ends_it_with_an_error_and_feeds_the_breaker() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        frames = 'data: {"id": "x", "choices": []}\n\ndata: {"error": {"message": "engine died"}}\n\n'
        return httpx.Response(200, text=frames, headers={"content-type": "text/event-stream"})

    cfg = settings(EngineSettings(url="http://b", native_api=True))
    cfg.resilience.breaker_failures = 1
    r, registry = route(cfg, handler)

    async def go() -> None:
        stream = await r.open_stream(ctx(stream=True))
        try:
            with pytest.raises(UpstreamUnavailable, match="engine died"):
                async for _ in stream.events():
                    pass
        finally:
            await stream.aclose()

    asyncio.run(go())
    assert registry.engines[0].breaker.state == "open" and held(registry) == 0


def test_responses_without_a_render_sidecar_is_a_502_naming_it_with_an_openai_body() -> None:
    """The conversion needs the project's render sidecar; none answers here (nothing started)."""
    client = TestClient(build_app(settings(EngineSettings(url="http://a"))))  # no lifespan: nothing starts
    r = client.post("/v1/responses", json={"model": MODEL, "input": "hi"})
    assert r.status_code == 502
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 502
    assert "/v1/responses needs the coordinator's render sidecar" in err["message"]


def test_messages_without_a_render_sidecar_is_a_502_naming_it_in_anthropic_shape() -> None:
    """The conversion needs the project's render sidecar; none answers here (nothing started)."""
    client = TestClient(build_app(settings(EngineSettings(url="http://a"))))
    r = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 5,
                                          "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 502
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "api_error"
    assert "render sidecar" in body["error"]["message"]


@pytest.mark.parametrize(("status", "body", "expected"), [
    (404, {"detail": "Not Found"}, TokenRouteMissing),
    (501, None, TokenRouteMissing),
    (403, {"error": {"message": "Scale-out endpoints are disabled. Restart vllm serve with "
                                "--enable-scale-out to enable them.", "type": "PermissionDeniedError",
                     "param": None, "code": 403}}, TokenRouteMissing),
    (403, {"error": {"message": "forbidden", "type": "PermissionDeniedError", "param": None, "code": 403}},
     UpstreamClientError),
    (404, {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "param": None,
                     "code": 404}}, UpstreamClientError),
    (500, None, UpstreamUnavailable),
    (429, {"error": {"message": "busy", "type": "RateLimitError", "param": None, "code": 429}}, EngineBusy),
    (503, {"error": {"message": "busy", "type": "ServiceUnavailableError", "param": None, "code": 503}},
     EngineBusy),
])
def test_what_an_engine_status_means_for_the_token_route(status: int, body: Any, expected: type) -> None:
    """Only a missing route (bare 404, 501, vLLM's 'scale-out disabled' 403) may send a request to the
    native route; a model 404 or another 403 is the client's error."""
    from coordinator.pipeline.engines.breaker import CircuitBreaker
    from coordinator.pipeline.engines.engine import Engine
    from coordinator.pipeline.engines.http_errors import raise_for_token_route

    engine = Engine(url="http://e0", role="union", model=None, weight=1.0, token_budget=1,
                    breaker=CircuitBreaker(3, 10.0))
    with pytest.raises(expected):
        raise_for_token_route(engine, status, body)


@pytest.mark.parametrize(("status", "body", "expected", "says"), [
    (401, {"error": "Unauthorized"}, UpstreamUnavailable, "engines[].api_key"),
    (401, {"error": {"message": "bad key", "type": "AuthenticationError", "param": None, "code": 401}},
     UpstreamClientError, "bad key"),
    (404, {"detail": "Not Found"}, UpstreamUnavailable, "on its OpenAI API"),
    (400, {"error": {"message": "no such field", "type": "BadRequestError", "param": None, "code": 400}},
     UpstreamClientError, "no such field"),
    (429, {"error": {"message": "busy", "type": "RateLimitError", "param": None, "code": 429}}, EngineBusy, "busy"),
    (429, None, UpstreamUnavailable, "on its OpenAI API"),
    (500, None, UpstreamUnavailable, "HTTP 500"),
])
def test_what_an_engine_status_means_on_its_own_api(status: int, body: Any, expected: type, says: str) -> None:
    """The native route reads the same answers by the same rules: only an OpenAI error body is the
    engine's verdict on the client's request; a bare 401 is the coordinator's credential."""
    from coordinator.pipeline.engines.breaker import CircuitBreaker
    from coordinator.pipeline.engines.engine import Engine
    from coordinator.pipeline.engines.http_errors import raise_for_openai_route

    engine = Engine(url="http://e0", role="union", model=None, weight=1.0, token_budget=1,
                    breaker=CircuitBreaker(3, 10.0))
    with pytest.raises(expected) as caught:
        raise_for_openai_route(engine, status, body)
    assert type(caught.value) is expected and says in str(caught.value)


# -- the native chain: Messages and Responses bodies to the engines' own routes ------------------

def api_ctx(api: str, body: dict[str, Any], stream: bool) -> RequestContext:
    c = RequestContext(kind="chat", request_id="abc", body={"model": MODEL, **body, "stream": stream},
                       model=MODEL, stream=stream, include_usage=False)
    c.prompts = [PromptPlan(0, {"sampling_params": {"max_tokens": 7}}, [1, 2, 3], 1, StopSpec(()))]
    c.route, c.native_api = "native", api  # type: ignore[assignment]
    return c


MESSAGE_EVENTS = [{"type": "message_start", "message": {"id": "msg_engine"}},
                  {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Paris"}},
                  {"type": "message_stop"}]


def messages_engine(seen: list[tuple[str, dict[str, Any]]]) -> Handler:
    """vLLM's ``/v1/messages``: named events and no ``[DONE]`` (the stream just ends)."""
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        if body["stream"]:
            frames = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in MESSAGE_EVENTS)
            return httpx.Response(200, text=frames, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"id": "msg_engine", "type": "message", "content": [
            {"type": "text", "text": "Paris"}], "usage": {"input_tokens": 3, "output_tokens": 1}})
    return handler


@pytest.mark.parametrize("stream", [False, True])
def test_a_messages_body_goes_to_the_engines_messages_route_as_it_is(stream: bool) -> None:
    """The engine's answer keeps its own ids and shape; a stream without ``[DONE]`` ends at
    ``message_stop`` (not a broken stream), and everything is released."""
    seen: list[tuple[str, dict[str, Any]]] = []
    r, registry = route(settings(EngineSettings(url="http://a"), EngineSettings(url="http://b", native_api=True)),
                        messages_engine(seen))
    body = {"max_tokens": 5, "system": "brief", "messages": [{"role": "user", "content": "hi"}]}

    async def go() -> Any:
        c = api_ctx("messages", body, stream)
        if not stream:
            return await r.complete(c)
        s = await r.open_stream(c)
        try:
            return [e async for e in s.events()]
        finally:
            await s.aclose()

    out = asyncio.run(go())
    if stream:
        assert out == MESSAGE_EVENTS
    else:
        assert out["id"] == "msg_engine" and out["content"][0]["text"] == "Paris"
    assert seen == [("/v1/messages", {"model": MODEL, **body, "stream": stream})]  # max_tokens: the client's
    assert held(registry) == 0 and r.client.open_streams == 0


def test_a_responses_body_without_a_budget_gets_what_admission_reserved() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        assert request.url.path == "/v1/responses"
        return httpx.Response(200, json={"id": "resp_engine", "object": "response", "output": []})

    r, registry = route(settings(EngineSettings(url="http://b", native_api=True)), handler)
    out = asyncio.run(r.complete(api_ctx("responses", {"input": "hi"}, False)))
    assert out["id"] == "resp_engine" and seen[0]["max_output_tokens"] == 7 and "max_tokens" not in seen[0]
    assert held(registry) == 0


def test_a_native_stream_that_ends_before_its_last_event_is_broken() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        frames = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in MESSAGE_EVENTS[:2])
        return httpx.Response(200, text=frames, headers={"content-type": "text/event-stream"})

    r, registry = route(settings(EngineSettings(url="http://b", native_api=True)), handler)

    async def go() -> list[dict[str, Any]]:
        s = await r.open_stream(api_ctx("messages", {"max_tokens": 5, "messages": []}, True))
        got: list[dict[str, Any]] = []
        try:
            with pytest.raises(UpstreamUnavailable, match="without"):
                async for e in s.events():
                    got.append(e)
        finally:
            await s.aclose()
        return got

    assert len(asyncio.run(go())) == 2 and held(registry) == 0


def test_the_transcript_is_the_prompt_text_in_template_order() -> None:
    """System, tools, then the turns; ids, roles and media payloads are no prompt text."""
    from coordinator.pipeline.native_api import transcript_parts

    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                      {"type": "image", "source": {"data": "QUJD" * 999}}]},
                         {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "find",
                                                            "input": {"q": "cats"}}]}],
            "system": "brief", "tools": [{"name": "find", "description": "search"}], "max_tokens": 9}
    assert list(transcript_parts("messages", body)) == ["brief", "find", "search", "look", "find", "cats"]
    responses = {"input": [{"type": "function_call_output", "call_id": "c1", "output": "42"}],
                 "instructions": "be kind"}
    assert list(transcript_parts("responses", responses)) == ["be kind", "42"]
