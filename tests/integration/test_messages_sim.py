"""``/v1/messages`` on the real render sidecar and simulated token-only engines: credentials, a
client that leaves mid-stream, an engine that fails mid-stream, and nothing left held afterwards."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import SERVED, CoordinatorFactory
from tests.support import LONG_HISTORY, CoordinatorServer, served_by
from token_engine.simulator import SimConfig, SimulatedEngine

KEY = "k-msg"
BODY: dict[str, Any] = {"model": SERVED, "max_tokens": 200, "messages": [{"role": "user", "content": "Go on."}]}


@pytest.fixture
def sim() -> Iterator[SimulatedEngine]:
    with SimulatedEngine(SimConfig(model=SERVED, seed=3, decode_s_per_token=0.01)) as engine:
        yield engine


def released(coord: CoordinatorServer, sim: SimulatedEngine, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    c = coord.components
    while time.monotonic() < deadline:
        state = sim.state()
        if (coord.inflight == 0 and c.ledger.global_inflight == 0 and not state["running"]
                and all(e.inflight_requests == 0 for e in c.registry.engines)):
            return True
        time.sleep(0.05)
    return False


def test_x_api_key_and_bearer_are_accepted_a_wrong_key_is_a_401(
        render_sidecar: Any, sim: SimulatedEngine, coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url], server={"api_keys": [KEY]})
    small = {**BODY, "max_tokens": 4}
    ok = httpx.post(f"{coord.url}/v1/messages", json=small, timeout=30,
                    headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    bearer = httpx.post(f"{coord.url}/v1/messages", json=small, timeout=30,
                        headers={"authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 200
    for headers in ({"x-api-key": "wrong"}, {}):
        r = httpx.post(f"{coord.url}/v1/messages", json=small, timeout=30, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
        c = httpx.post(f"{coord.url}/v1/messages/count_tokens", json={"model": SERVED, "messages": BODY["messages"]},
                       timeout=30, headers=headers)
        assert c.status_code == 401


def test_a_client_that_leaves_mid_stream_releases_everything(
        render_sidecar: Any, sim: SimulatedEngine, coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url])
    seen = 0
    with httpx.stream("POST", f"{coord.url}/v1/messages", json={**BODY, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: content_block_delta"):
                seen += 1
                if seen == 3:
                    break
    assert seen == 3
    assert released(coord, sim), sim.state()
    assert sim.state()["aborted"], "the engine request was aborted, not left to run"


def test_an_engine_failing_mid_stream_ends_with_an_anthropic_error_event(
        render_sidecar: Any, sim: SimulatedEngine, coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url], resilience={"max_relays": 0})
    sim.set_faults(drop_after_tokens=5, calls=1)
    events: list[tuple[str, dict[str, Any]]] = []
    name = ""
    with httpx.stream("POST", f"{coord.url}/v1/messages", json={**BODY, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
    assert events[0][0] == "message_start"
    assert events[-1][0] == "error", events[-3:]
    err = events[-1][1]
    assert err["type"] == "error" and err["error"]["type"] in ("api_error", "overloaded_error")
    assert "message_stop" not in [n for n, _ in events]
    assert released(coord, sim)


def test_a_messages_conversation_places_where_its_chat_twin_does(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """Same token ids, same prefix index: after a Messages turn, its chat form goes to the same engine,
    and the next Messages turn of the conversation too (two idle engines, KV-affinity scheduling)."""
    with SimulatedEngine(SimConfig(model=SERVED, seed=1)) as a, SimulatedEngine(SimConfig(model=SERVED, seed=2)) as b:
        coord = coordinator_factory(render_sidecar.url, [a.url, b.url])
        sims = {"a": a, "b": b}

        def served(post: Any) -> str:
            return served_by(sims, post)

        history = LONG_HISTORY
        for round_ in range(3):   # three conversations; each must stick to its first engine
            body = {"model": SERVED, "max_tokens": 4, "system": f"Conversation {round_}. {history}",
                    "messages": [{"role": "user", "content": "Tell me more."}]}
            chat = httpx.post(f"{render_sidecar.url}/v1/messages/chat", json=body, timeout=30).json()

            def messages(b: dict[str, Any] = body) -> None:
                assert httpx.post(f"{coord.url}/v1/messages", json=b, timeout=30).status_code == 200

            def chat_twin(c: dict[str, Any] = chat) -> None:
                assert httpx.post(f"{coord.url}/v1/chat/completions", json=c, timeout=30).status_code == 200

            first = served(messages)
            assert served(chat_twin) == first
            follow = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "Sure."},
                                           {"role": "user", "content": "And then?"}]}
            assert served(lambda f=follow: messages(f)) == first
