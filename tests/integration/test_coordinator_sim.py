"""Coordinator + real render sidecar + simulated engines: failures, cleanup, ids, auth.

The simulated engine speaks vLLM's wire format (checked against the real engine in
tests/e2e/test_simulator_wire.py) and lets a test inject engine faults and watch aborts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from coordinator.config import EngineSettings
from tests.conftest import SERVED, CoordinatorFactory
from tests.support import CoordinatorServer, free_port, sse_events, streamed_text, wait_until
from token_engine.simulator import SimConfig, SimulatedEngine


@pytest.fixture
def sim() -> Iterator[SimulatedEngine]:
    with SimulatedEngine(SimConfig(model=SERVED, decode_s_per_token=0.002)) as eng:
        yield eng


@pytest.fixture
def coord(render_sidecar: Any, sim: SimulatedEngine, coordinator_factory: CoordinatorFactory) -> CoordinatorServer:
    return coordinator_factory(render_sidecar.url, [sim.url])


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 20, **extra}


def test_stream_and_nonstream_agree_and_usage_is_right(coord: CoordinatorServer) -> None:
    full = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30).json()
    events = sse_events(httpx.post(f"{coord.url}/v1/chat/completions", timeout=30,
                                   json=chat(stream=True, stream_options={"include_usage": True})))
    assert streamed_text(events)[0] == full["choices"][0]["message"]["content"] != ""
    assert full["usage"]["completion_tokens"] == 20 == events[-2]["usage"]["completion_tokens"]
    assert full["choices"][0]["finish_reason"] == "length"
    assert full["id"].startswith("chatcmpl-") and all(e["id"] == events[0]["id"] for e in events[:-1])


def test_request_id_is_propagated_and_returned(coord: CoordinatorServer, sim: SimulatedEngine) -> None:
    with httpx.Client(timeout=30) as c, c.stream("POST", f"{coord.url}/v1/chat/completions",
                                                 json=chat(max_tokens=500, stream=True),
                                                 headers={"X-Request-Id": "trace-42"}) as r:
        assert r.headers["x-request-id"] == "trace-42"
        running = sim.state()["running"]
        assert len(running) == 1 and running[0].startswith("generate-tokens-chatcmpl-trace-42")
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), headers={"X-Request-Id": "trace-43"})
    assert r.headers["x-request-id"] == "trace-43" and r.json()["id"] == "chatcmpl-trace-43"


def test_streaming_client_disconnect_aborts_engine_and_releases(coord: CoordinatorServer,
                                                                 sim: SimulatedEngine) -> None:
    with httpx.Client(timeout=30) as c, c.stream("POST", f"{coord.url}/v1/chat/completions",
                                                 json=chat(max_tokens=1000, stream=True)) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    assert wait_until(lambda: sim.state()["running"] == [] and len(sim.state()["aborted"]) == 1)
    assert coord.wait_idle() == 0


def test_nonstreaming_client_disconnect_aborts_engine_and_releases(coord: CoordinatorServer,
                                                                    sim: SimulatedEngine) -> None:
    sim.set_faults(delay_headers_s=0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{coord.url}/v1/chat/completions", json=chat(max_tokens=1500), timeout=0.5)
    assert wait_until(lambda: sim.state()["running"] == [] and len(sim.state()["aborted"]) == 1)
    assert coord.wait_idle() == 0


def test_an_engine_without_the_abort_route_is_aborted_by_closing_its_streams(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """An engine that serves generate but not ``/inference/v1/abort_requests`` (404): the first abort
    teaches the coordinator, later disconnects send no call, and every request still ends on the engine
    (the closed connection aborts it) with nothing held in the coordinator."""
    with SimulatedEngine(SimConfig(model=SERVED, decode_s_per_token=0.002, abort_route=False)) as eng:
        coord = coordinator_factory(render_sidecar.url, [eng.url])
        (engine,) = coord.components.registry.engines
        for n in (1, 2):
            with httpx.Client(timeout=30) as c, c.stream("POST", f"{coord.url}/v1/chat/completions",
                                                         json=chat(max_tokens=1000, stream=True)) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i > 4:
                        break
            assert wait_until(lambda n=n: eng.state()["running"] == [] and len(eng.state()["aborted"]) == n)
            assert coord.wait_idle() == 0
            assert wait_until(lambda: engine.abort_route is False)
        eng.set_faults(delay_headers_s=0)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{coord.url}/v1/chat/completions", json=chat(max_tokens=1500), timeout=0.5)
        assert wait_until(lambda: eng.state()["running"] == [] and len(eng.state()["aborted"]) == 3)
        assert coord.wait_idle() == 0
        metrics = httpx.get(f"{coord.url}/metrics").text
        calls = [line for line in metrics.splitlines() if line.startswith("coordinator_engine_aborts_total")]
        assert calls == ['coordinator_engine_aborts_total{result="refused"} 1.0'], calls


@pytest.mark.parametrize(("fault", "status", "etype"), [
    ({"fail_next": 1, "fail_status": 503}, 503, None),          # engine admission control passes through
    ({"fail_next": 1, "fail_status": 400, "fail_body": {"error": {"message": "bad ids", "type": "BadRequestError",
                                                                  "param": None, "code": 400}}}, 400, "BadRequestError"),
    ({"fail_next": 1, "fail_status": 500}, 502, "BadGatewayError"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_engine_failures_before_first_byte_are_json_errors(coord: CoordinatorServer, sim: SimulatedEngine,
                                                            fault: dict, status: int, etype: str | None,
                                                            stream: bool) -> None:
    sim.set_faults(**fault)
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(stream=stream), timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and (etype is None or err["type"] == etype)
    assert coord.wait_idle() == 0


@pytest.mark.parametrize(("fault", "code"), [
    ({"error_after_tokens": 3}, 502),
    ({"drop_after_tokens": 3}, 502),
])
def test_engine_failure_after_first_byte_is_an_sse_error_then_done(coord: CoordinatorServer,
                                                                   sim: SimulatedEngine, fault: dict,
                                                                   code: int) -> None:
    sim.set_faults(**fault)
    events = sse_events(httpx.post(f"{coord.url}/v1/chat/completions", json=chat(stream=True), timeout=30))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert "error" in events[-2] and events[-2]["error"]["code"] == code
    assert any("choices" in e for e in events[:-2]), "content before the failure must have been streamed"
    assert coord.wait_idle() == 0


def test_stalled_engine_stream_times_out_with_504(render_sidecar: Any, sim: SimulatedEngine,
                                                 coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url], engine_client={"stream_idle_timeout_s": 0.5,
                                                                            "total_timeout_s": 0.5})
    sim.set_faults(stall_after_tokens=2)
    events = sse_events(httpx.post(f"{coord.url}/v1/chat/completions", json=chat(stream=True), timeout=30))
    assert events[-2]["error"]["code"] == 504 and events[-1] == "[DONE]"
    sim.set_faults(delay_headers_s=3)
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30)
    assert r.status_code == 504 and r.json()["error"]["type"] == "GatewayTimeoutError"
    assert coord.wait_idle() == 0


def test_multi_prompt_open_failure_closes_the_other_streams(coord: CoordinatorServer,
                                                            sim: SimulatedEngine) -> None:
    sim.set_faults(fail_next=1, fail_status=500)
    body = {"model": SERVED, "prompt": ["a b c", "d e f", "g h i"], "max_tokens": 500, "stream": True}
    r = httpx.post(f"{coord.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 502 and r.headers["content-type"].startswith("application/json")
    assert wait_until(lambda: sim.state()["running"] == [])
    assert coord.wait_idle() == 0


def test_multi_prompt_midstream_failure_cancels_siblings(coord: CoordinatorServer, sim: SimulatedEngine) -> None:
    sim.set_faults(drop_after_tokens=5, calls=1)
    body = {"model": SERVED, "prompt": ["a b c", "d e f", "g h i"], "max_tokens": 800, "stream": True}
    events = sse_events(httpx.post(f"{coord.url}/v1/completions", json=body, timeout=30))
    assert "error" in events[-2] and events[-1] == "[DONE]"
    assert wait_until(lambda: sim.state()["running"] == [])
    # The dropped one counts as aborted by the engine too; none may run to completion.
    assert len(sim.state()["aborted"]) == 3 and sim.state()["completed"] == 0
    assert coord.wait_idle() == 0


def test_engine_failing_health_probes_leaves_rotation(render_sidecar: Any, sim: SimulatedEngine,
                                                      coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url], engine_client={"health_interval_s": 0.1},
                                resilience={"breaker_failures": 1})
    sim.set_faults(health_dead=True)
    assert wait_until(lambda: not coord.components.registry.any_healthy())
    # Unhealthy by probes only: still tried (panic routing); the engine's 500 opens its breaker.
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30)
    assert r.status_code == 502
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    sim.clear_faults()
    assert wait_until(lambda: coord.components.registry.any_healthy())
    assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30).status_code == 200


def test_no_healthy_engine_is_503(render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [f"http://127.0.0.1:{free_port()}"],
                                resilience={"breaker_failures": 1})
    assert wait_until(lambda: not coord.components.registry.any_healthy())
    # Probes alone do not refuse (panic routing): the refused connection opens the breaker.
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30)
    assert r.status_code == 502
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    assert httpx.get(f"{coord.url}/ready").status_code == 503


def test_render_sidecar_down_is_502_and_not_ready(sim: SimulatedEngine,
                                                  coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(f"http://127.0.0.1:{free_port()}", [sim.url],
                                models=[{"name": SERVED, "aliases": ["gpt-4o-mini"], "max_model_len": 2048}])
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30)
    assert r.status_code == 502 and "render" in r.json()["error"]["message"]
    ready = httpx.get(f"{coord.url}/ready")
    assert ready.status_code == 503 and ready.json()["render"] is False
    assert coord.wait_idle() == 0


def test_api_keys_are_required_when_configured(render_sidecar: Any, sim: SimulatedEngine,
                                               coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url], server={"api_keys": ["k-123"]})
    url = f"{coord.url}/v1/chat/completions"
    assert httpx.post(url, json=chat()).status_code == 401
    r = httpx.post(url, json=chat(), headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(f"{coord.url}/v1/models").status_code == 401
    assert httpx.post(url, json=chat(), headers={"Authorization": "Bearer k-123"}).status_code == 200


def test_engines_behind_api_key_get_the_coordinators_credential_never_the_clients(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """An engine run with ``--api-key``: generate, stream and abort carry ``engines[].api_key``; the
    client's own key never reaches it, and a missing credential is a 502 naming the setting (the
    client did nothing wrong, so not the engine's 401)."""
    with SimulatedEngine(SimConfig(model=SERVED, api_key="engine-secret", decode_s_per_token=0.002)) as eng:
        good = coordinator_factory(render_sidecar.url, [], server={"api_keys": ["client-key"]},
                                   engines=[EngineSettings(url=eng.url, api_key="engine-secret")])
        auth = {"Authorization": "Bearer client-key"}
        url = f"{good.url}/v1/chat/completions"
        assert httpx.post(url, json=chat(), headers=auth, timeout=30).status_code == 200
        r = httpx.post(url, json=chat(stream=True), headers=auth, timeout=30)
        assert r.status_code == 200 and "[DONE]" in r.text
        with httpx.Client(timeout=30) as c, c.stream("POST", url, json=chat(max_tokens=1000, stream=True),
                                                     headers=auth) as resp:
            for i, _ in enumerate(resp.iter_lines()):
                if i > 4:
                    break
        assert wait_until(lambda: eng.state()["running"] == [] and len(eng.state()["aborted"]) == 1)
        aborts = good.components.metrics.engine_aborts
        assert wait_until(lambda: aborts.labels("accepted")._value.get() == 1)  # the abort call got in
        assert aborts.labels("refused")._value.get() == 0
        bad = coordinator_factory(render_sidecar.url, [eng.url])
        r = httpx.post(f"{bad.url}/v1/chat/completions", json=chat(), timeout=30)
        assert r.status_code == 502 and "engines[].api_key" in r.json()["error"]["message"], r.text


def test_compat_mode_ignores_unsupported_fields(render_sidecar: Any, sim: SimulatedEngine,
                                                coordinator_factory: CoordinatorFactory) -> None:
    strict = coordinator_factory(render_sidecar.url, [sim.url])
    compat = coordinator_factory(render_sidecar.url, [sim.url], server={"request_mode": "compat"})
    for body, param in [(chat(store=True, metadata={"a": "b"}), "store"),
                        (chat(prediction={"type": "content", "content": "x"}), "prediction")]:
        r = httpx.post(f"{strict.url}/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
        assert httpx.post(f"{compat.url}/v1/chat/completions", json=body).status_code == 200


def test_engine_always_gets_an_explicit_max_tokens(coord: CoordinatorServer, sim: SimulatedEngine) -> None:
    # Completions' default is 16, which vLLM omits when serialising; the engine would then generate to
    # the end of the context.
    r = httpx.post(f"{coord.url}/v1/completions", json={"model": SERVED, "prompt": "x y z"}, timeout=30).json()
    assert r["usage"]["completion_tokens"] == 16 and r["choices"][0]["finish_reason"] == "length"


def test_metrics_show_inflight_requests(coord: CoordinatorServer) -> None:
    text = httpx.get(f"{coord.url}/metrics").text
    assert "coordinator_inflight_requests 0.0" in text
