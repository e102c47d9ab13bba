"""``/v1/responses`` on the real render sidecar and simulated token-only engines: the chat form renders
to vLLM's ``/v1/responses/render`` token ids and sampling, a client that leaves mid-stream, an engine
that fails mid-stream, credentials, KV-affinity placement, and nothing left held afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import SERVED, CoordinatorFactory
from tests.integration.test_messages_sim import released
from tests.support import LONG_HISTORY, served_by
from token_engine.simulator import SimConfig, SimulatedEngine

BODY: dict[str, Any] = {"model": SERVED, "max_output_tokens": 200, "input": "Go on."}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}

CONVERSATIONS: dict[str, dict[str, Any]] = {
    "plain": {"model": SERVED, "input": "Hello!"},
    "instructions-and-parts": {
        "model": SERVED, "instructions": "Be brief.", "max_output_tokens": 20, "temperature": 0,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
                  {"type": "message", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": "Blue.", "annotations": []}]},
                  {"role": "user", "content": "Another?"}]},
    "tool-round-trip": {
        "model": SERVED, "tools": [WEATHER], "tool_choice": "none", "top_p": 0.9, "seed": 7,
        "input": [{"role": "user", "content": "Weather in Paris?"},
                  {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                   "arguments": "{\"city\": \"Paris\"}"},
                  {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"}]},
    "partial-assistant": {
        "model": SERVED, "input": [{"role": "user", "content": "Count to five."},
                                   {"type": "message", "role": "assistant", "status": "incomplete",
                                    "content": [{"type": "output_text", "text": "1, 2,", "annotations": []}]}]},
}


@pytest.mark.parametrize("case", list(CONVERSATIONS))
def test_chat_form_renders_to_the_responses_render(render_sidecar: Any, case: str) -> None:
    """What the coordinator schedules and the engine runs is what native vLLM would run."""
    body = CONVERSATIONS[case]
    with httpx.Client(base_url=str(render_sidecar.url), timeout=60) as client:
        form = client.post("/v1/responses/chat", json=body)
        assert form.status_code == 200, form.text
        chat = form.json()["chat"]
        ours = client.post("/v1/chat/completions/render", json=chat)
        native = client.post("/v1/responses/render", json=body)
    assert ours.status_code == native.status_code == 200, (ours.text, native.text)
    assert ours.json()["token_ids"] == native.json()["token_ids"]
    sampling = {k: v for k, v in ours.json()["sampling_params"].items() if k != "extra_args"}
    assert sampling == {k: v for k, v in native.json()["sampling_params"].items() if k != "extra_args"}
    response = form.json()["response"]
    assert response["object"] == "response" and response["status"] == "in_progress"
    assert response["instructions"] == body.get("instructions")


def test_the_conversion_refuses_what_a_stateless_tool_less_path_cannot_do(render_sidecar: Any) -> None:
    cases = [({"previous_response_id": "resp_1"}, "previous_response_id"), ({"background": True}, "background"),
             ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0].type"),
             ({"truncation": "auto"}, "truncation"),
             ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
              "tool_choice"),
             ({"input": None}, "input")]
    for extra, param in cases:
        r = httpx.post(f"{render_sidecar.url}/v1/responses/chat", json={**BODY, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, r.text


@pytest.fixture
def sim() -> Iterator[SimulatedEngine]:
    with SimulatedEngine(SimConfig(model=SERVED, seed=3, decode_s_per_token=0.01)) as engine:
        yield engine


def _events(r: httpx.Response, stop_after_deltas: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    name = ""
    for line in r.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            out.append((name, json.loads(line[len("data: "):])))
            deltas = sum(1 for n, _ in out if n == "response.output_text.delta")
            if stop_after_deltas is not None and deltas == stop_after_deltas:
                break
    return out


def test_stream_and_body_agree_and_release(render_sidecar: Any, sim: SimulatedEngine,
                                           coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url])
    small = {**BODY, "max_output_tokens": 12, "temperature": 0}
    body = httpx.post(f"{coord.url}/v1/responses", json=small, timeout=30).json()
    with httpx.stream("POST", f"{coord.url}/v1/responses", json={**small, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        events = _events(r)
    completed = events[-1][1]["response"]
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert text == completed["output"][0]["content"][0]["text"] == body["output"][0]["content"][0]["text"]
    assert completed["usage"] == body["usage"] and body["usage"]["output_tokens"] == 12
    assert body["status"] == completed["status"] == "incomplete"  # 12 tokens of a longer answer
    assert released(coord, sim)


def test_a_client_that_leaves_mid_stream_releases_everything(
        render_sidecar: Any, sim: SimulatedEngine, coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url])
    with httpx.stream("POST", f"{coord.url}/v1/responses", json={**BODY, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        events = _events(r, stop_after_deltas=3)
    assert [n for n, _ in events][:2] == ["response.created", "response.in_progress"]
    assert released(coord, sim), sim.state()
    assert sim.state()["aborted"], "the engine request was aborted, not left to run"


def test_an_engine_failing_mid_stream_ends_with_an_error_event(
        render_sidecar: Any, sim: SimulatedEngine, coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url], resilience={"max_relays": 0})
    sim.set_faults(drop_after_tokens=5, calls=1)
    with httpx.stream("POST", f"{coord.url}/v1/responses", json={**BODY, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        events = _events(r)
    assert events[0][0] == "response.created"
    assert events[-1][0] == "error", events[-3:]
    assert events[-1][1]["message"] and events[-1][1]["sequence_number"] == len(events) - 1
    assert "response.completed" not in [n for n, _ in events]
    assert released(coord, sim)


def test_bearer_keys_apply(render_sidecar: Any, sim: SimulatedEngine,
                           coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url], server={"api_keys": ["k-resp"]})
    small = {**BODY, "max_output_tokens": 4}
    ok = httpx.post(f"{coord.url}/v1/responses", json=small, timeout=30, headers={"authorization": "Bearer k-resp"})
    assert ok.status_code == 200 and ok.json()["object"] == "response"
    r = httpx.post(f"{coord.url}/v1/responses", json=small, timeout=30)
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_a_responses_conversation_places_where_its_chat_twin_does(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """Same token ids, same prefix index: a Responses turn, its chat form and the conversation's next
    turn all go to the same engine (two idle engines, KV-affinity scheduling)."""
    with SimulatedEngine(SimConfig(model=SERVED, seed=1)) as a, SimulatedEngine(SimConfig(model=SERVED, seed=2)) as b:
        coord = coordinator_factory(render_sidecar.url, [a.url, b.url])
        sims = {"a": a, "b": b}

        def served(post: Any) -> str:
            return served_by(sims, post)

        history = LONG_HISTORY
        for round_ in range(3):
            body = {"model": SERVED, "max_output_tokens": 4, "instructions": f"Conversation {round_}. {history}",
                    "input": [{"role": "user", "content": "Tell me more."}]}
            chat = httpx.post(f"{render_sidecar.url}/v1/responses/chat", json=body, timeout=30).json()["chat"]

            def responses(b: dict[str, Any] = body) -> None:
                assert httpx.post(f"{coord.url}/v1/responses", json=b, timeout=30).status_code == 200

            def chat_twin(c: dict[str, Any] = chat) -> None:
                assert httpx.post(f"{coord.url}/v1/chat/completions", json=c, timeout=30).status_code == 200

            first = served(responses)
            assert served(chat_twin) == first
            follow = {**body, "input": [*body["input"], {"role": "assistant", "content": "Sure."},
                                        {"role": "user", "content": "And then?"}]}
            assert served(lambda f=follow: responses(f)) == first
