"""Structured outputs on engines that cannot run them: real render sidecar, simulated token-only engines.

The simulator is a ``--tokens-only`` engine: its ``/tokenize`` answers vLLM's "Tokenizer not
available" 400 and it refuses a grammar the way vLLM does (HTTP 200, then an error event). These tests
pin down what the client sees when no engine can honour the constraint, and when an engine refuses
one after its 200. Grammars that run are tested on real vLLM (tests/e2e/test_structured_real.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from coordinator.config import EngineSettings
from tests.conftest import SERVED, CoordinatorFactory
from tests.support import CoordinatorServer
from token_engine.simulator import SimConfig, SimulatedEngine

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
CONSTRAINTS: list[tuple[dict[str, Any], str]] = [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
     "response_format"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
]


@pytest.fixture
def sim() -> Iterator[SimulatedEngine]:
    with SimulatedEngine(SimConfig(model=SERVED, decode_s_per_token=0.002)) as eng:
        yield eng


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": "Name a person."}], "max_tokens": 8,
            **extra}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("constraint", "param"), CONSTRAINTS)
def test_a_grammar_no_engine_can_run_is_a_400_naming_the_field(
        render_sidecar: Any, sim: SimulatedEngine, coordinator_factory: CoordinatorFactory,
        constraint: dict[str, Any], param: str, stream: bool) -> None:
    """Learned, not configured: the token-only engine answered /tokenize with "no tokenizer", so the
    coordinator refuses before admission (never a 5xx, never the constraint silently dropped) and
    the engine never sees the request."""
    coord = coordinator_factory(render_sidecar.url, [sim.url])
    before = sim.state()["generate_calls"]
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(stream=stream, **constraint), timeout=30)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "BadRequestError" and "code" in err
    assert "tokenizer" in err["message"] and SERVED in err["message"]
    assert sim.state()["generate_calls"] == before
    assert coord.wait_idle() == 0
    ok = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30)
    assert ok.status_code == 200  # the rest of the model's traffic is untouched


def test_completions_and_forced_tool_calls_are_refused_alike(
        render_sidecar: Any, sim: SimulatedEngine, coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url])
    r = httpx.post(f"{coord.url}/v1/completions", timeout=30, json={
        "model": SERVED, "prompt": "Answer:", "max_tokens": 4, "structured_outputs": {"choice": ["a", "b"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    r = httpx.post(f"{coord.url}/v1/completions", timeout=30, json={
        "model": SERVED, "prompt": ["one", "two"], "max_tokens": 4, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_refusal_after_its_200_reaches_the_client_as_a_400_before_any_byte(
        render_sidecar: Any, sim: SimulatedEngine, coordinator_factory: CoordinatorFactory, stream: bool) -> None:
    """An operator who marks a token-only engine ``tokenizer: true`` gets vLLM's own refusal.
    Streamed, vLLM sends it as the first SSE event of a 200; the client must get what ``vllm serve``
    answers: HTTP 400 with the OpenAI error body, no 200, no event stream, and the engine is not
    blamed (a client error, not a failure: no retry elsewhere, the breaker untouched)."""
    coord: CoordinatorServer = coordinator_factory(
        render_sidecar.url, [], engines=[EngineSettings(url=sim.url, tokenizer=True)])
    r = httpx.post(f"{coord.url}/v1/chat/completions", timeout=30,
                   json=chat(stream=stream, response_format={"type": "json_object"}))
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert "Structured outputs requires a tokenizer" in err["message"] and err["type"] == "BadRequestError"
    assert sim.state()["generate_calls"] == 1  # tried once: a client error is not retried elsewhere
    assert coord.wait_idle() == 0
    for _ in range(6):  # breaker_failures is 5 by default: six refusals would open it if they counted
        assert httpx.post(f"{coord.url}/v1/chat/completions", timeout=30,
                          json=chat(stream=stream, response_format={"type": "json_object"})).status_code == 400
    ok = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(stream=stream), timeout=30)
    assert ok.status_code == 200


def test_an_engine_error_event_before_any_output_is_retried_on_another_engine(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """A 5xx error event as the first event means the engine failed before any output: nothing reached
    the client, so another engine takes the request."""
    with SimulatedEngine(SimConfig(model=SERVED)) as a, SimulatedEngine(SimConfig(model=SERVED)) as b:
        coord = coordinator_factory(render_sidecar.url, [a.url, b.url], scheduling={"policy": "round_robin"})
        for eng in (a, b):
            eng.set_faults(error_after_tokens=1)  # the first event is the error
        first = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(stream=True), timeout=30)
        assert first.status_code == 502  # both failed: the last engine's error
        b.set_faults()
        for _ in range(2):
            r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(stream=True), timeout=30)
            assert r.status_code == 200 and "[DONE]" in r.text
        assert coord.wait_idle() == 0


def test_bad_words_where_no_engine_loads_a_tokenizer_are_a_400_not_silently_ignored(
        render_sidecar: Any, sim: SimulatedEngine, coordinator_factory: CoordinatorFactory) -> None:
    """A token-only engine would drop them without a word (it cannot tokenize them)."""
    coord = coordinator_factory(render_sidecar.url, [sim.url])
    before = sim.state()["generate_calls"]
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(bad_words=["Paris"]), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text
    assert "tokenizer" in r.json()["error"]["message"]
    assert sim.state()["generate_calls"] == before
