"""Fault suite: one case per row of the failure table (render, engine, derender, client disconnect).

Each case asserts what the client sees and then that nothing leaked: ``GET /admin/accounting`` must
come back to zero (admission budget and queue, requests, stream sessions, producer tasks, open engine
streams, pending aborts, sidecar calls in flight, each engine's in-flight counts) and no simulated
engine may still run a request.

Render and derender faults come from a fault-injecting proxy in front of the real render sidecar
(``tests/faults/proxy.py``); engine faults from the simulator's hooks. The simulators run in "context"
mode (each token a function of the whole context before it, as with greedy decoding), so a stream
relayed to another engine must give exactly the text of an unfaulted one.

| failure-table row | cases |
|---|---|
| Render Token In (unreachable, timeout, unsupported, no token ids) | ``test_render_unreachable_at_start…``, ``test_render_failure…``, ``test_render_stopped_mid_run…``, ``test_render_unavailable_with_a_native_engine…`` |
| Render request validation (400/422) | ``test_render_client_errors…`` |
| token-only engine capability (404/501) | ``test_engine_without_the_token_route…`` |
| engine execution (connection, 5xx, exit, stall, error event) | ``test_engine_*``, ``test_*_stream_failure_after_output…``, ``test_probe_unhealthy…`` |
| derender request validation (400/422, invalid stream_state) | ``test_derender_rejection…``, ``test_invalid_stream_state…`` |
| derender capability missing (404/405/501) | ``test_derender_route_missing…`` |
| derender unavailable (connection, timeout, 5xx) | ``test_derender_unavailable…`` |
| client disconnect | ``test_client_disconnect…`` |
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from coordinator.config import EngineSettings, ModelSettings
from tests.conftest import SERVED, CoordinatorFactory
from tests.faults.proxy import (
    DERENDER_PATHS,
    RENDER_PATHS,
    Cut,
    Delay,
    FaultProxy,
    Malformed,
    Rewrite,
    Rule,
    Status,
)
from tests.support import CoordinatorServer, streamed_text, wait_until
from token_engine.simulator import SimConfig, SimulatedEngine

Sims = tuple[SimulatedEngine, SimulatedEngine]
RENDER_TIMEOUT_S = 3.0     # render.timeout_s in this suite: Delay(...) rules outlast it
IDLE_TIMEOUT_S = 1.0       # engine_client.stream_idle_timeout_s: a stalled engine stream fails after it
VLLM_400 = {"error": {"message": "Invalid value for 'messages[0].role': unknown role 'robot'",
                      "type": "BadRequestError", "param": "messages[0].role", "code": 400}}
VLLM_422 = {"error": {"message": "stream_state does not match this request", "type": "BadRequestError",
                      "param": "stream_state", "code": 422}}


# --------------------------------------------------------------------------- fixtures and helpers

@pytest.fixture
def proxy(render_sidecar: Any) -> Iterator[FaultProxy]:
    with FaultProxy(str(render_sidecar.url)) as p:
        yield p


@pytest.fixture
def sims() -> Iterator[Sims]:
    cfg = SimConfig(model=SERVED, mode="context", decode_s_per_token=0.005)
    with SimulatedEngine(cfg) as a, SimulatedEngine(cfg) as b:
        yield a, b


def start(factory: CoordinatorFactory, proxy: FaultProxy, engine_urls: list[str], **overrides: Any
          ) -> CoordinatorServer:
    """A coordinator whose sidecar is behind ``proxy``. Small connection pools: each pool lane is an
    HTTP client that loads the CA bundle, which is most of a default coordinator's start-up time."""
    settings: dict[str, Any] = {
        "render": {"timeout_s": RENDER_TIMEOUT_S, "max_connections": 16},
        "engine_client": {"stream_idle_timeout_s": IDLE_TIMEOUT_S, "max_connections": 32},
    }
    for key, value in overrides.items():
        base = settings.get(key)
        settings[key] = {**base, **value} if isinstance(base, dict) and isinstance(value, dict) else value
    return factory(proxy.url, engine_urls, **settings)


@pytest.fixture
def coord(proxy: FaultProxy, sims: Sims, coordinator_factory: CoordinatorFactory) -> CoordinatorServer:
    return start(coordinator_factory, proxy, [s.url for s in sims])


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 40, "temperature": 0, **extra}


def stream_chat(**extra: Any) -> dict[str, Any]:
    return chat(stream=True, stream_options={"include_usage": True}, **extra)


def post(coord: CoordinatorServer, body: dict[str, Any], kind: str = "chat") -> httpx.Response:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    return httpx.post(f"{coord.url}{path}", json=body, timeout=120)


def stream(coord: CoordinatorServer, body: dict[str, Any], *, kind: str = "chat",
           after_first: Callable[[], None] | None = None) -> list[Any]:
    """A streamed request's events; ``after_first`` runs once the first text reached the client."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    events: list[Any] = []
    with httpx.stream("POST", f"{coord.url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            if after_first is not None and streamed_text([events[-1]], kind).get(0):
                after_first()
                after_first = None
    return events


def accounting(coord: CoordinatorServer) -> dict[str, Any]:
    r = httpx.get(f"{coord.url}/admin/accounting", timeout=10)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def assert_no_leaks(coord: CoordinatorServer, *engines: SimulatedEngine) -> None:
    """Everything the request held is given back, here and on the engines."""
    assert wait_until(lambda: accounting(coord)["held"] == 0, timeout=30), accounting(coord)
    for engine in engines:
        assert wait_until(lambda e=engine: not e.state()["running"] and not e.state()["waiting"],  # type: ignore[misc]
                          timeout=30), engine.state()["running"]


def assert_openai_error(r: httpx.Response, status: int, type_: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    if type_ is not None:
        assert err["type"] == type_, err
    return err


def stream_error(events: list[Any]) -> dict[str, Any]:
    """The error event that ends a failed stream (then exactly one [DONE])."""
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
    assert isinstance(events[-2], dict) and "error" in events[-2], events[-3:]
    err: dict[str, Any] = events[-2]["error"]
    return err


def generate_calls(sims: tuple[SimulatedEngine, ...]) -> list[int]:
    return [s.state()["generate_calls"] for s in sims]


def served_by(sims: Sims, before: list[int]) -> SimulatedEngine:
    """The simulator that took the last request (its generate count grew)."""
    grown = [s for s, n in zip(sims, before, strict=True) if s.state()["generate_calls"] > n]
    assert len(grown) == 1, grown
    return grown[0]


def other(sims: Sims, one: SimulatedEngine) -> SimulatedEngine:
    return sims[1] if one is sims[0] else sims[0]


def sample(coord: CoordinatorServer, name: str, **labels: str) -> float:
    value = coord.components.metrics.registry.get_sample_value(name, labels or None)
    return float(value or 0.0)


def engine_failures(coord: CoordinatorServer) -> float:
    return sum(sample(coord, "coordinator_engine_failures_total", engine=e.url)
               for e in coord.components.registry.engines)


def check_one_continuous_stream(events: list[Any], baseline: list[Any], kind: str = "chat") -> None:
    """The relay contract: the same text as without a fault, nothing repeated or lost, one role delta,
    one finish, one id, and the same usage."""
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
    assert streamed_text(events, kind) == streamed_text(baseline, kind)
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0].get("finish_reason")]
    assert finishes == ["length"]
    if kind == "chat":
        assert sum(1 for c in chunks if (c["choices"][0].get("delta") or {}).get("role")) == 1
    assert events[-2]["usage"] == baseline[-2]["usage"]
    assert len({c["id"] for c in chunks}) == 1


# --------------------------------------------------------------------------- Render Token In

def test_render_unreachable_at_start_is_a_clear_502_and_render_is_used_once_back(
        proxy: FaultProxy, sims: Sims, coordinator_factory: CoordinatorFactory) -> None:
    """No native engine configured: the render fallback has nowhere to go, and says so."""
    proxy.stop()
    coord = start(coordinator_factory, proxy, [s.url for s in sims])
    err = assert_openai_error(post(coord, chat()), 502)
    assert "render" in err["message"] and "native_api" in err["message"], err
    assert generate_calls(sims) == [0, 0]
    assert_no_leaks(coord, *sims)
    proxy.start()
    assert wait_until(lambda: post(coord, chat()).status_code == 200, timeout=30)
    assert proxy.count(RENDER_PATHS) >= 1 and proxy.count(DERENDER_PATHS) >= 1
    assert_no_leaks(coord, *sims)


RENDER_FAILURES: dict[str, tuple[Rule, int]] = {
    "connection cut": (Cut(), 502),
    "5xx": (Status(500, "Internal Server Error"), 502),
    "bare 404": (Status(404), 502),
    "501": (Status(501, {"error": {"message": "not implemented", "type": "NotImplementedError"}}), 502),
    "malformed body": (Malformed(), 502),
    "no token ids": (Status(200, {"prompt": "hello"}), 502),
    "timeout": (Delay(RENDER_TIMEOUT_S + 3), 504),
}


@pytest.mark.parametrize("case", list(RENDER_FAILURES))
def test_render_failure_without_a_native_engine_is_a_clear_error(
        case: str, proxy: FaultProxy, sims: Sims, coord: CoordinatorServer) -> None:
    rule, status = RENDER_FAILURES[case]
    proxy.set(RENDER_PATHS, rule)
    err = assert_openai_error(post(coord, chat()), status)
    assert "render" in err["message"], err
    assert generate_calls(sims) == [0, 0] and proxy.count(DERENDER_PATHS) == 0
    assert_no_leaks(coord, *sims)


def test_render_stopped_mid_run_leaves_streams_being_derendered_alone(
        proxy: FaultProxy, sims: Sims, coord: CoordinatorServer) -> None:
    """Render availability decides only for new requests; derender (same sidecar, still up) goes on."""
    baseline = stream(coord, stream_chat(max_tokens=200))
    refused: list[httpx.Response] = []

    def render_goes_down() -> None:
        proxy.set(RENDER_PATHS, Cut())
        refused.append(post(coord, chat()))

    events = stream(coord, stream_chat(max_tokens=200), after_first=render_goes_down)
    assert streamed_text(events) == streamed_text(baseline) and events[-2]["usage"] == baseline[-2]["usage"]
    assert not any(isinstance(e, dict) and "error" in e for e in events)
    assert_openai_error(refused[0], 502)
    proxy.clear()
    assert post(coord, chat()).status_code == 200
    assert_no_leaks(coord, *sims)


@pytest.mark.e2e  # the session's real vLLM engines: runs in the real-vLLM pass of `make test`
def test_render_unavailable_with_a_native_engine_answers_through_it(
        proxy: FaultProxy, vllm_stack: Any, model_dir: Any, coordinator_factory: CoordinatorFactory) -> None:
    """Local tokenizer + the engine's own OpenAI API (native route), and the response says so."""
    native = str(vllm_stack.native.url)
    coord = start(coordinator_factory, proxy, [], engines=[EngineSettings(url=native, native_api=True)],
                  models=[ModelSettings(name=SERVED, aliases=["gpt-4o-mini"], path=str(model_dir))])
    assert post(coord, chat(max_tokens=8)).status_code == 200  # render up: the token-only route
    proxy.set(RENDER_PATHS, Cut())
    r = post(coord, chat(max_tokens=8))
    assert r.status_code == 200, r.text
    assert r.headers.get("x-coordinator-route") == "native" and r.headers.get("x-tokenizer-source") == "local"
    assert r.json()["choices"][0]["message"]["content"]
    assert_no_leaks(coord)
    proxy.clear()
    r = post(coord, chat(max_tokens=8))
    assert r.status_code == 200 and "x-coordinator-route" not in r.headers
    assert_no_leaks(coord)


# --------------------------------------------------------------------------- Render request validation

@pytest.mark.parametrize(("status", "body"), [(400, VLLM_400), (422, {**VLLM_400, "error": {
    **VLLM_400["error"], "code": 422}})], ids=["400", "422"])
def test_render_client_errors_are_returned_as_they_are(
        status: int, body: dict[str, Any], proxy: FaultProxy, sims: Sims, coord: CoordinatorServer) -> None:
    """The request's own fault: its status and detail, never a fallback that would change its meaning."""
    proxy.set(RENDER_PATHS, Status(status, body))
    err = assert_openai_error(post(coord, chat()), status, "BadRequestError")
    assert err["message"] == VLLM_400["error"]["message"] and err["param"] == "messages[0].role"
    assert generate_calls(sims) == [0, 0]
    assert_no_leaks(coord, *sims)


# --------------------------------------------------------------------------- token-only engine capability

@pytest.mark.parametrize("status", [404, 501])
def test_engine_without_the_token_route_is_a_clear_502_without_a_native_engine(
        status: int, sims: Sims, coord: CoordinatorServer) -> None:
    for s in sims:
        s.set_faults(fail_next=1, fail_status=status, fail_body={"detail": "Not Found"})
    err = assert_openai_error(post(coord, stream_chat()), 502)
    assert "native_api" in err["message"] or "/inference/v1/generate" in err["message"], err
    assert_no_leaks(coord, *sims)


# --------------------------------------------------------------------------- engine execution

@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "json"])
def test_engine_5xx_before_the_first_byte_is_retried_on_another_engine(
        streaming: bool, sims: Sims, coord: CoordinatorServer) -> None:
    body = stream_chat() if streaming else chat()
    before = generate_calls(sims)
    baseline = stream(coord, body) if streaming else post(coord, body).json()
    victim = served_by(sims, before)
    victim.set_faults(fail_next=1, fail_status=500)
    if streaming:
        events = stream(coord, body)
        check_one_continuous_stream(events, baseline)
    else:
        r = post(coord, body)
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"] == baseline["choices"][0]["message"]
        assert r.json()["usage"] == baseline["usage"]
    assert sample(coord, "coordinator_retries_total") == 1
    assert sample(coord, "coordinator_engine_failures_total", engine=victim.url) == 1
    assert_no_leaks(coord, *sims)


@pytest.mark.parametrize("status", [429, 503])
@pytest.mark.parametrize("streaming", [False, True])
def test_a_busy_engine_hands_the_request_to_another_and_keeps_its_health(
        status: int, streaming: bool, sims: Sims, coord: CoordinatorServer) -> None:
    """vLLM's own admission (or a proxy's rate limit) said 'not now' before the first byte: another
    engine serves it, and the busy engine is not counted as failed."""
    body = stream_chat() if streaming else chat()
    before = generate_calls(sims)
    baseline = stream(coord, body) if streaming else post(coord, body).json()
    victim = served_by(sims, before)
    victim.set_faults(fail_next=1, fail_status=status,
                      fail_body={"error": {"message": "busy", "type": "ServiceUnavailableError",
                                           "param": None, "code": status}})
    if streaming:
        check_one_continuous_stream(stream(coord, body), baseline)
    else:
        r = post(coord, body)
        assert r.status_code == 200 and r.json()["choices"] == baseline["choices"]
    assert sample(coord, "coordinator_retries_total") == 1
    assert sample(coord, "coordinator_engine_failures_total", engine=victim.url) in (None, 0)
    assert_no_leaks(coord, *sims)


def test_engine_unreachable_is_retried_on_another_engine(
        proxy: FaultProxy, sims: Sims, coordinator_factory: CoordinatorFactory) -> None:
    """An engine that went away since the last probe: the connection is refused, another takes it."""
    coord = start(coordinator_factory, proxy, [s.url for s in sims], scheduling={"policy": "round_robin"},
                  engine_client={"health_interval_s": 60})
    gone = sims[1].url
    sims[1].stop()
    baseline = None
    for streaming in (False, True):
        if streaming:
            events = stream(coord, stream_chat())
            assert events[-1] == "[DONE]" and "error" not in events[-2]
        else:
            baseline = post(coord, chat())
            assert baseline.status_code == 200
    assert sample(coord, "coordinator_engine_failures_total", engine=gone) == 1
    assert sample(coord, "coordinator_retries_total") == 1
    assert_no_leaks(coord, sims[0])


def test_engine_error_during_a_json_request_is_retried_on_another_engine(
        sims: Sims, coord: CoordinatorServer) -> None:
    """Nothing reached the client yet: the whole request runs again elsewhere."""
    before = generate_calls(sims)
    baseline = post(coord, chat()).json()
    victim = served_by(sims, before)
    victim.set_faults(calls=1, error_after_tokens=5)
    r = post(coord, chat())
    assert r.status_code == 200 and r.json()["choices"] == baseline["choices"]
    assert_no_leaks(coord, *sims)


@pytest.mark.parametrize("fault", [{"drop_after_tokens": 7}, {"stall_after_tokens": 7},
                                   {"error_after_tokens": 7}], ids=["killed", "stall", "error event"])
def test_engine_failure_mid_stream_continues_on_another_engine(
        fault: dict[str, int], sims: Sims, coord: CoordinatorServer) -> None:
    """Relay: the client sees one stream with the unfaulted text; the failed engine's breaker hears of it."""
    before = generate_calls(sims)
    baseline = stream(coord, stream_chat())
    victim = served_by(sims, before)
    victim.set_faults(calls=1, **fault)
    events = stream(coord, stream_chat())  # prefix affinity sends it to the same engine first
    check_one_continuous_stream(events, baseline)
    assert sample(coord, "coordinator_relays_total") == 1
    assert sample(coord, "coordinator_engine_failures_total", engine=victim.url) == 1
    assert_no_leaks(coord, *sims)


def test_engine_process_exit_mid_stream_continues_on_another_engine(
        sims: Sims, coord: CoordinatorServer) -> None:
    before = generate_calls(sims)
    # Long enough to outlast the simulator's 1 s graceful shutdown: the stream must be cut, not finish.
    baseline = stream(coord, stream_chat(max_tokens=600))
    victim = served_by(sims, before)
    stopper: list[threading.Thread] = []

    def exit_engine() -> None:  # stop() waits for its server thread: not on the reading thread
        stopper.append(threading.Thread(target=victim.stop))
        stopper[0].start()

    events = stream(coord, stream_chat(max_tokens=600), after_first=exit_engine)
    stopper[0].join(30)
    check_one_continuous_stream(events, baseline)
    assert sample(coord, "coordinator_relays_total") == 1
    assert_no_leaks(coord, other(sims, victim))


def test_engine_that_never_answers_is_a_504_and_aborted(sims: Sims, coord: CoordinatorServer) -> None:
    """No headers within the idle timeout: a slow engine may still be working, so this is not retried
    (docs/scheduling.md), and the engine is told to abort."""
    for s in sims:
        s.set_faults(hang=True, calls=1)
    assert_openai_error(post(coord, stream_chat()), 504, "GatewayTimeoutError")
    assert_no_leaks(coord, *sims)


@pytest.mark.parametrize("shape", ["three prompts", "n=2"])
def test_multi_choice_stream_failure_after_output_ends_with_an_error(
        shape: str, sims: Sims, coord: CoordinatorServer) -> None:
    """One sibling's engine fails after output reached the client: no relay (siblings share what the
    client saw), an SSE error then [DONE], and every sibling's engine request aborted."""
    for s in sims:
        s.set_faults(calls=1, error_after_tokens=10)
    if shape == "n=2":
        events = stream(coord, stream_chat(n=2, temperature=0.7, seed=3, max_tokens=200))
    else:
        body = {"model": SERVED, "prompt": ["Once upon a time", "The quick brown fox", "In a galaxy"],
                "max_tokens": 200, "temperature": 0, "stream": True}
        events = stream(coord, body, kind="completion")
    err = stream_error(events)
    assert err["code"] == 502 and err["type"] == "BadGatewayError"
    assert sample(coord, "coordinator_relays_total") == 0
    assert_no_leaks(coord, *sims)
    assert sum(s.state()["completed"] for s in sims) == 0  # every sibling stopped early


def test_probe_unhealthy_engines_still_serve(
        sims: Sims, coordinator_factory: CoordinatorFactory, render_sidecar: Any) -> None:
    """Every engine's health probe fails but generate works (a loaded host): requests are still
    served (panic routing) instead of a 503."""
    with FaultProxy(sims[0].url) as engine_proxy, FaultProxy(str(render_sidecar.url)) as proxy:
        engine_proxy.set("/health", Status(503, ""))
        coord = start(coordinator_factory, proxy, [engine_proxy.url],
                      engine_client={"health_interval_s": 0.1})
        assert wait_until(lambda: not coord.components.registry.any_healthy(), timeout=30)
        r = post(coord, chat())
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        assert sample(coord, "coordinator_panic_decisions_total", role="union") >= 1
        assert_no_leaks(coord, sims[0])


# --------------------------------------------------------------------------- derender failures

def assert_inference_ran_once(coord: CoordinatorServer, sims: Sims, before: list[int]) -> None:
    """A derender failure never re-runs prefill/decode and never counts against an engine."""
    assert sum(generate_calls(sims)) - sum(before) == 1
    assert sample(coord, "coordinator_relays_total") == 0 and sample(coord, "coordinator_retries_total") == 0
    assert engine_failures(coord) == 0
    assert all(e.breaker.state == "closed" for e in coord.components.registry.engines)


def derender_fails(coord: CoordinatorServer, sims: Sims, proxy: FaultProxy, rule: Rule, when: str
                   ) -> tuple[list[Any] | httpx.Response, list[int]]:
    """Run one request whose derender calls fail from the first call (``first``), from mid-stream
    (``mid-stream``) or in the one batch call of a JSON request (``json``)."""
    before = generate_calls(sims)
    if when == "json":
        proxy.set(DERENDER_PATHS, rule)
        return post(coord, chat()), before
    if when == "first":
        proxy.set(DERENDER_PATHS, rule)
        return stream(coord, stream_chat(max_tokens=200)), before
    return stream(coord, stream_chat(max_tokens=200), after_first=lambda: proxy.set(DERENDER_PATHS, rule)), before


def check_derender_failure(result: list[Any] | httpx.Response, status: int, type_: str) -> dict[str, Any]:
    if isinstance(result, httpx.Response):
        return assert_openai_error(result, status, type_)
    err = stream_error(result)
    assert err["code"] == status and err["type"] == type_, err
    return err


WHEN = ["first", "mid-stream", "json"]


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("status", [400, 422])
def test_derender_rejection_is_returned_with_its_detail_and_never_reruns_inference(
        status: int, when: str, proxy: FaultProxy, sims: Sims, coord: CoordinatorServer) -> None:
    body = {"error": {**VLLM_422["error"], "code": status}}
    result, before = derender_fails(coord, sims, proxy, Status(status, body), when)
    err = check_derender_failure(result, status, "BadRequestError")
    assert err["message"] == VLLM_422["error"]["message"] and err["param"] == "stream_state"
    assert_inference_ran_once(coord, sims, before)
    assert_no_leaks(coord, *sims)


def test_invalid_stream_state_is_the_sidecars_error_and_never_reruns_inference(
        proxy: FaultProxy, sims: Sims, coord: CoordinatorServer) -> None:
    """The real sidecar judges a corrupted ``stream_state``; the client gets its verdict and detail."""

    def corrupt(body: dict[str, Any]) -> dict[str, Any]:
        if isinstance(body.get("stream_state"), dict):
            body["stream_state"] = {**body["stream_state"], "prefix_offset": -1}
        return body

    result, before = derender_fails(coord, sims, proxy, Rewrite(corrupt), "mid-stream")
    assert isinstance(result, list)
    err = stream_error(result)
    assert err["code"] == 400 and err["type"] == "BadRequestError", err
    assert "stream_state" in err["message"] and "prefix_offset" in err["message"], err
    assert_inference_ran_once(coord, sims, before)
    assert_no_leaks(coord, *sims)


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("rule", [Status(404), Status(405, {"detail": "Method Not Allowed"}),
                                  Status(501, "Not Implemented")], ids=["bare 404", "405", "501"])
def test_derender_route_missing_is_a_response_stage_error(
        rule: Rule, when: str, proxy: FaultProxy, sims: Sims, coord: CoordinatorServer) -> None:
    result, before = derender_fails(coord, sims, proxy, rule, when)
    err = check_derender_failure(result, 502, "ResponseStageError")
    assert "derender" in err["message"]
    assert_inference_ran_once(coord, sims, before)
    assert_no_leaks(coord, *sims)


DERENDER_UNAVAILABLE: dict[str, tuple[Rule, int, str]] = {
    "connection cut": (Cut(), 502, "BadGatewayError"),
    "5xx": (Status(500, "Internal Server Error"), 502, "BadGatewayError"),
    "malformed body": (Malformed(), 502, "BadGatewayError"),
    "timeout": (Delay(RENDER_TIMEOUT_S + 3), 504, "GatewayTimeoutError"),
}


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("case", list(DERENDER_UNAVAILABLE))
def test_derender_unavailable_is_502_or_504_and_never_reruns_inference(
        case: str, when: str, proxy: FaultProxy, sims: Sims, coord: CoordinatorServer) -> None:
    rule, status, type_ = DERENDER_UNAVAILABLE[case]
    result, before = derender_fails(coord, sims, proxy, rule, when)
    check_derender_failure(result, status, type_)
    assert_inference_ran_once(coord, sims, before)
    assert_no_leaks(coord, *sims)


# --------------------------------------------------------------------------- client disconnect

def test_client_disconnect_mid_stream_aborts_the_engine_request(sims: Sims, coord: CoordinatorServer) -> None:
    aborted = sum(len(s.state()["aborted"]) for s in sims)
    with httpx.stream("POST", f"{coord.url}/v1/chat/completions", json=stream_chat(max_tokens=1000),
                      timeout=60) as r:
        for line in r.iter_lines():
            if '"content"' in line:
                break  # leave with the engine still generating
    assert wait_until(lambda: sum(len(s.state()["aborted"]) for s in sims) == aborted + 1, timeout=30)
    assert sum(s.state()["completed"] for s in sims) == 0
    assert_no_leaks(coord, *sims)


def test_client_disconnect_during_a_json_request_aborts_the_engine_request(
        sims: Sims, coord: CoordinatorServer) -> None:
    body = json.dumps(chat(max_tokens=1000)).encode()
    with socket.create_connection(("127.0.0.1", coord.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_until(lambda: any(s.state()["running"] for s in sims), timeout=30)
    # The client left while the engine generates.
    assert wait_until(lambda: sum(len(s.state()["aborted"]) for s in sims) == 1, timeout=30)
    assert sum(s.state()["completed"] for s in sims) == 0
    assert_no_leaks(coord, *sims)


def test_multi_prompt_client_disconnect_cancels_every_sibling(sims: Sims, coord: CoordinatorServer) -> None:
    body = {"model": SERVED, "prompt": ["Once upon a time", "The quick brown fox", "In a galaxy"],
            "max_tokens": 1000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{coord.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if '"text"' in line:
                break
    assert wait_until(lambda: sum(len(s.state()["aborted"]) for s in sims) == 3, timeout=30)
    assert_no_leaks(coord, *sims)

