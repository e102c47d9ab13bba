"""The topology matrix: every topology behaves the same to a client, on simulated engines.

Union (two union engines), handoff (a prefill and two decode engines), trigger (the same, with
layer-wise connectors: decode first, the prefill at its metaserver callback) and the hybrid fallback
(a P/D pair whose decode engine is draining, so two union engines serve) each run the same cases:
streaming and JSON, chat and completions, multi-prompt, a relay after an engine cut its stream, an
engine process stopped mid-stream, a client that leaves; and after each, nothing is held
(``/admin/accounting``) and no engine runs anything. The simulators run in ``mode: context`` (the
output is a function of the context), so every topology must give the text a union engine gives.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.conftest import SERVED, CoordinatorFactory
from tests.support import CoordinatorServer, sse_events, streamed_text, wait_until
from token_engine.simulator import SimConfig, SimulatedEngine

TOPOLOGIES = ["union", "handoff", "trigger", "hybrid"]
PATHS = {"union": "union", "handoff": "handoff", "trigger": "trigger", "hybrid": "fallback_union"}


@dataclass
class Fleet:
    name: str
    coord: CoordinatorServer
    engines: list[SimulatedEngine]
    servers: list[SimulatedEngine]   # the engines whose streams reach the client (union or decode)
    stopped: list[SimulatedEngine] = field(default_factory=list)

    def serving(self, before: list[int]) -> SimulatedEngine:
        grown = [s for s, n in zip(self.servers, before, strict=True) if s.state()["generate_calls"] > n]
        assert len(grown) == 1, grown
        return grown[0]

    def calls(self) -> list[int]:
        return [s.state()["generate_calls"] for s in self.servers]


def _sim(stack: ExitStack, **cfg: Any) -> SimulatedEngine:
    return stack.enter_context(SimulatedEngine(SimConfig(model=SERVED, mode="context", decode_s_per_token=0.004,
                                                         **cfg)))


@pytest.fixture(params=TOPOLOGIES)
def fleet(request: pytest.FixtureRequest, render_sidecar: Any,
          coordinator_factory: CoordinatorFactory) -> Iterator[Fleet]:
    name: str = request.param
    topology: dict[str, Any] = {"pd_min_uncached_tokens": 0}
    with ExitStack() as stack:
        if name == "union":
            servers = [_sim(stack), _sim(stack)]
            engines, config = servers, [{"url": s.url} for s in servers]
        elif name == "handoff":
            p = _sim(stack, kv_role="prefill", engine_id="p0")
            servers = [_sim(stack, kv_role="decode", engine_id=f"d{i}") for i in range(2)]
            engines = [p, *servers]
            config = [{"url": p.url, "role": "prefill"}, *({"url": s.url, "role": "decode"} for s in servers)]
        elif name == "trigger":
            p = _sim(stack, kv_role="prefill", kv_connector="layerwise", engine_id="p0")
            servers = [_sim(stack, kv_role="decode", kv_connector="layerwise", engine_id=f"d{i}")
                       for i in range(2)]
            engines = [p, *servers]
            config = [{"url": e.url, "role": role, "pd_protocol": "trigger"}
                      for e, role in zip(engines, ["prefill", "decode", "decode"], strict=True)]
            topology["trigger"] = {"port": 0}
        else:
            p = _sim(stack, kv_role="prefill", engine_id="p0")
            d = _sim(stack, kv_role="decode", engine_id="d0")
            servers = [_sim(stack), _sim(stack)]
            engines = [p, d, *servers]
            config = [{"url": p.url, "role": "prefill"}, {"url": d.url, "role": "decode", "drain": True},
                      *({"url": s.url} for s in servers)]
        coord = coordinator_factory(render_sidecar.url, [], engines=config, topology=topology,
                                    engine_client={"health_interval_s": 60})
        yield Fleet(name, coord, engines, servers)


@pytest.fixture
def reference(render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> Iterator[CoordinatorServer]:
    """A plain one-engine union coordinator: what every topology's text must equal."""
    with SimulatedEngine(SimConfig(model=SERVED, mode="context")) as engine:
        yield coordinator_factory(render_sidecar.url, [engine.url])


def chat(stream: bool, **extra: Any) -> dict[str, Any]:
    body = {"model": SERVED, "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": 24, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def completion(stream: bool, prompt: Any = "The sea is", **extra: Any) -> dict[str, Any]:
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 24, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def call(coord: CoordinatorServer, kind: str, body: dict[str, Any]) -> Any:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    r = httpx.post(f"{coord.url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return sse_events(r) if body["stream"] else r.json()


def text(answer: Any, kind: str) -> str | dict[int, str]:
    if isinstance(answer, list):
        return streamed_text(answer, kind)
    key = "message" if kind == "chat" else "text"
    return {c["index"]: (c[key]["content"] if kind == "chat" else c[key]) for c in answer["choices"]}


def held(coord: CoordinatorServer) -> int:
    body: dict[str, Any] = httpx.get(f"{coord.url}/admin/accounting", timeout=10).json()
    return int(body["held"])


def assert_nothing_held(fleet: Fleet) -> None:
    assert wait_until(lambda: held(fleet.coord) == 0, timeout=30)
    for e in fleet.engines:
        if e not in fleet.stopped:
            assert wait_until(lambda e=e: not e.state()["running"] and not e.state()["waiting"],  # type: ignore[misc]
                              timeout=30), e.state()


def decisions(fleet: Fleet) -> float:
    value = fleet.coord.components.metrics.registry.get_sample_value(
        "coordinator_pd_decisions_total", {"path": PATHS[fleet.name]})
    return float(value or 0)


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
def test_every_topology_answers_as_a_union_engine(fleet: Fleet, reference: CoordinatorServer, kind: str,
                                                  stream: bool) -> None:
    body = chat(stream) if kind == "chat" else completion(stream)
    got, want = call(fleet.coord, kind, body), call(reference, kind, body)
    assert text(got, kind) == text(want, kind)
    usage = got[-2]["usage"] if stream else got["usage"]
    assert usage == (want[-2]["usage"] if stream else want["usage"])
    assert decisions(fleet) == 1
    assert_nothing_held(fleet)


@pytest.mark.parametrize("stream", [False, True])
def test_multi_prompt_completions(fleet: Fleet, reference: CoordinatorServer, stream: bool) -> None:
    body = completion(stream, prompt=["The sea is", "Mountains are"])
    got, want = call(fleet.coord, "completion", body), call(reference, "completion", body)
    assert text(got, "completion") == text(want, "completion")
    assert len(text(got, "completion")) == 2 and decisions(fleet) == 2
    assert_nothing_held(fleet)


@pytest.mark.parametrize("fault", ["cut", "stopped"])
def test_an_engine_failing_mid_stream_is_relayed(fleet: Fleet, fault: str) -> None:
    """``cut``: the engine drops the connection after 6 tokens. ``stopped``: the engine process goes
    away while the client reads. Either way the client sees one stream with the unbroken text."""
    body = chat(True)
    before = fleet.calls()
    want = call(fleet.coord, "chat", body)
    victim = fleet.serving(before)
    if fault == "cut":
        victim.set_faults(drop_after_tokens=6)
        got = call(fleet.coord, "chat", body)
    else:
        victim.set_faults(stall_after_tokens=6)          # hold the stream open mid-way ...
        got = []
        with httpx.stream("POST", f"{fleet.coord.url}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    got.append(data if data == "[DONE]" else json.loads(data))
                    if len(got) == 3:
                        victim.stop()                    # ... and stop the engine under it
                        fleet.stopped.append(victim)
    assert got[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in got)
    assert streamed_text(got) == streamed_text(want) and got[-2]["usage"] == want[-2]["usage"]
    relays = fleet.coord.components.metrics.registry.get_sample_value("coordinator_relays_total")
    assert relays == 1
    assert_nothing_held(fleet)


def test_a_client_that_leaves_aborts_the_engine_request(fleet: Fleet) -> None:
    body = chat(True, max_tokens=1500)
    before = fleet.calls()
    with httpx.stream("POST", f"{fleet.coord.url}/v1/chat/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    victim = fleet.serving(before)
    assert wait_until(lambda: len(victim.state()["aborted"]) == 1, timeout=30)
    assert_nothing_held(fleet)
