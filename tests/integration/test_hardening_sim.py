"""No client request can crash or hang anything: real render sidecar + simulated engines.

The simulated engine dies on an out-of-vocabulary prompt id exactly like a real ``--tokens-only``
vLLM engine (500 EngineDeadError, then gone), so these tests show what a poisoned request would
cost a fleet. The real-engine version of the headline case is in tests/e2e/test_engine_fuzz.py.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from tests.conftest import SERVED, CoordinatorFactory
from tests.support import CoordinatorServer
from token_engine.simulator import SimConfig, SimulatedEngine

VOCAB = 49152  # SmolLM2-135M-Instruct; the coordinator learns it from the sidecar's model folder


@pytest.fixture
def sim() -> Iterator[SimulatedEngine]:
    with SimulatedEngine(SimConfig(model=SERVED, decode_s_per_token=0.001)) as eng:
        yield eng


@pytest.fixture
def coord(render_sidecar: Any, sim: SimulatedEngine, coordinator_factory: CoordinatorFactory) -> CoordinatorServer:
    return coordinator_factory(render_sidecar.url, [sim.url], limits={"header_timeout_s": 0.5,
                                                                      "body_timeout_s": 0.5})


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 5, **extra}


def post(coord: CoordinatorServer, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(f"{coord.url}{path}", json=body, timeout=30, **kw)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    if param is not None:
        assert err["param"] == param, err
    return dict(err)


# ------------------------------------------------------------------------ token ids never reach engines
@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": [70368744177663], "max_tokens": 16}, "prompt"),          # the request that killed engines
    ({"prompt": [VOCAB], "max_tokens": 4}, "prompt"),
    ({"prompt": [[1, 2], [3, VOCAB + 7]], "max_tokens": 4}, "prompt"),
    ({"prompt": [-5], "max_tokens": 4}, "prompt"),
    ({"prompt": "hi", "stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"prompt": "hi", "allowed_token_ids": [VOCAB]}, "allowed_token_ids"),
    ({"prompt": "hi", "logit_bias": {str(VOCAB): 5}}, "logit_bias"),
])
def test_out_of_vocabulary_ids_are_400_and_the_engine_never_sees_them(
        coord: CoordinatorServer, sim: SimulatedEngine, body: dict[str, Any], param: str) -> None:
    err = assert_openai_error(post(coord, "/v1/completions", {"model": SERVED, **body}), 400, param)
    assert "out of vocabulary" in err["message"]
    assert sim.state()["generate_calls"] == 0
    ok = post(coord, "/v1/completions", {"model": SERVED, "prompt": [1, VOCAB - 1], "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_a_poisonous_request_costs_at_most_two_engines(render_sidecar: Any,
                                                      coordinator_factory: CoordinatorFactory) -> None:
    """Engines whose vocabulary is smaller than the coordinator believes (a model-version mismatch)
    die on every prompt. Retries stop after one engine death, so a third engine survives."""
    with ExitStack() as stack:
        engines = [stack.enter_context(SimulatedEngine(SimConfig(model=SERVED, vocab_size=100, seed=i)))
                   for i in range(3)]
        coord = coordinator_factory(render_sidecar.url, [e.url for e in engines],
                                    scheduling={"policy": "round_robin"}, resilience={"retries": 5},
                                    engine_client={"health_interval_s": 60})
        r = post(coord, "/v1/chat/completions", chat())
        assert_openai_error(r, 502)
        dead = [e for e in engines if httpx.get(f"{e.url}/health").status_code != 200]
        assert len(dead) == 2
        samples = coord.components.metrics.registry.get_sample_value("coordinator_engine_deaths_total")
        assert samples == 2


# ------------------------------------------------------------------------ parser limits and slow clients
def test_deep_nesting_is_400_and_the_connection_keeps_serving(coord: CoordinatorServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", coord.port, timeout=30)
    nested = "[" * 10_000 + "]" * 10_000
    deep = f'{{"model": "{SERVED}", "messages": {nested}}}'
    conn.request("POST", "/v1/chat/completions", body=deep, headers={"content-type": "application/json"})
    first = conn.getresponse()
    body = json.loads(first.read())
    assert first.status == 400 and "deeper than" in body["error"]["message"]
    sock = conn.sock
    conn.request("POST", "/v1/chat/completions", body=json.dumps(chat()),
                 headers={"content-type": "application/json"})
    second = conn.getresponse()
    assert second.status == 200 and json.loads(second.read())["choices"][0]["message"]["content"]
    assert conn.sock is sock  # the same keep-alive connection
    conn.close()


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_trickled_headers_get_408_and_the_connection_is_closed(coord: CoordinatorServer) -> None:
    with socket.create_connection(("127.0.0.1", coord.port), timeout=20) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and then nothing more
        reply = _read_until_closed(s)
    assert reply.startswith(b"HTTP/1.1 408") and b'"code":408' in reply
    with socket.create_connection(("127.0.0.1", coord.port), timeout=20) as s:
        reply = _read_until_closed(s)  # connected, silent
    assert reply.startswith(b"HTTP/1.1 408")


def test_trickled_body_gets_408(coord: CoordinatorServer, sim: SimulatedEngine) -> None:
    with socket.create_connection(("127.0.0.1", coord.port), timeout=20) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 500\r\n\r\n{\"model\":")
        reply = s.recv(65536)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert json.loads(body)["error"]["type"] == "RequestTimeout"
    assert coord.wait_idle() == 0 and sim.state()["generate_calls"] == 0


def test_default_max_tokens_caps_requests_that_set_none(render_sidecar: Any, sim: SimulatedEngine,
                                                        coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url], limits={"default_max_tokens": 7})
    body = chat(ignore_eos=True)
    del body["max_tokens"]
    assert post(coord, "/v1/chat/completions", body).json()["usage"]["completion_tokens"] == 7
    explicit = post(coord, "/v1/chat/completions", chat(ignore_eos=True, max_tokens=9)).json()
    assert explicit["usage"]["completion_tokens"] == 9  # a client's own value is not capped


# ------------------------------------------------------------------------ strict mode, models, errors
def test_sdk_and_framework_defaults_are_accepted(coord: CoordinatorServer) -> None:
    r = post(coord, "/v1/chat/completions", chat(store=False, metadata={"team": "a"}, service_tier="auto",
                                                 user="u", parallel_tool_calls=True, stop=None, seed=None))
    assert r.status_code == 200, r.text
    r = post(coord, "/v1/completions", {"model": SERVED, "prompt": "Hi", "max_tokens": 2, "echo": False,
                                        "best_of": 1, "suffix": None, "logprobs": None})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("body", "param"), [
    (chat(model=None), "model"),
    (chat(messages=[{"role": "bogus", "content": "hi"}]), "messages[0].role"),
    (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (chat(store=True), "store"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
          tool_choice="auto"), "tool_choice"),
])
def test_client_mistakes_are_400s_in_the_users_terms(coord: CoordinatorServer, body: dict[str, Any],
                                                    param: str) -> None:
    err = assert_openai_error(post(coord, "/v1/chat/completions", body), 400, param)
    assert "--" not in err["message"] and "validation error" not in err["message"]
    assert "body." not in err["message"]


def test_models_retrieve(coord: CoordinatorServer) -> None:
    for name in (SERVED, "gpt-4o-mini"):
        card = httpx.get(f"{coord.url}/v1/models/{name}").json()
        assert card["id"] == name and card["object"] == "model" and isinstance(card["created"], int)
    assert_openai_error(httpx.get(f"{coord.url}/v1/models/nope"), 404, "model")


@pytest.mark.parametrize("header", ["x" * 500, "bad id with spaces", "quote\"s", "ü"])
def test_unsafe_request_ids_are_replaced_and_the_header_says_so(coord: CoordinatorServer, sim: SimulatedEngine,
                                                                header: str) -> None:
    r = post(coord, "/v1/chat/completions", chat(), headers={"X-Request-Id": header.encode("utf-8")})
    used = r.headers["x-request-id"]
    assert r.status_code == 200 and used != header and len(used) <= 128
    assert r.json()["id"] == f"chatcmpl-{used}"
    engine_id = sim.state()["history"][-1]["request_id"]
    assert used in engine_id and engine_id.isascii()  # the engine sees the safe id too


def test_header_deadline_does_not_reach_into_websocket_sessions(coord: CoordinatorServer) -> None:
    """The slowloris deadline (0.5 s here) guards HTTP headers only: an NNRP WebSocket session that
    outlives it keeps working (a late 408 written into the stream used to end every session)."""
    import asyncio

    from coordinator.nnrp.client import NnrpClient

    async def main() -> None:
        url = coord.url.replace("http://", "ws://") + "/nnrp/v1"
        async with await NnrpClient.connect(url) as client:
            await asyncio.sleep(1.5)
            assert (await client.ping(7))["type"] == "pong"
            events = await (await client.chat(chat(stream=True))).collect()
            assert events[-1]["type"] == "response.completed", events

    asyncio.run(main())
