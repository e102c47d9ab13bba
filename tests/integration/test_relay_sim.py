"""Mid-stream relay on simulated engines: a stream whose engine fails continues on another engine.

The simulators run in "context" mode (each token a function of the whole context before it, as with a
greedy real model), so a relayed stream must give exactly the text of an unfaulted one. The proof on
real vLLM engines killed with SIGKILL is `make relay-proof` (docs/relay.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import CoordinatorFactory
from tests.support import CoordinatorServer, sse_events, streamed_text
from token_engine.simulator import SimConfig, SimulatedEngine

SERVED = "smollm2-135m-instruct"


@pytest.fixture
def sims() -> Iterator[tuple[SimulatedEngine, SimulatedEngine]]:
    cfg = SimConfig(model=SERVED, mode="context", decode_s_per_token=0.003)
    with SimulatedEngine(cfg) as a, SimulatedEngine(cfg) as b:
        yield a, b


@pytest.fixture
def coord(render_sidecar: Any, sims: tuple[SimulatedEngine, SimulatedEngine],
          coordinator_factory: CoordinatorFactory) -> CoordinatorServer:
    return coordinator_factory(render_sidecar.url, [s.url for s in sims],
                               engine_client={"stream_idle_timeout_s": 1.0})


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 40, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "prompt": "Once upon a time, in a land far away, there lived a king who had three daughters and a", "max_tokens": 40, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}


def run(coord: CoordinatorServer, body: dict[str, Any], kind: str = "chat") -> list[Any]:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    return sse_events(httpx.post(f"{coord.url}{path}", json=body, timeout=60))


def served_by(sims: tuple[SimulatedEngine, SimulatedEngine], before: list[int]) -> SimulatedEngine:
    """The simulator that took the last request (its generate count grew)."""
    grown = [s for s, n in zip(sims, before, strict=True) if s.state()["generate_calls"] > n]
    assert len(grown) == 1, "exactly one engine should have served the baseline"
    return grown[0]


def calls(sims: tuple[SimulatedEngine, SimulatedEngine]) -> list[int]:
    return [s.state()["generate_calls"] for s in sims]


def relays(coord: CoordinatorServer) -> float:
    return coord.components.metrics.relays._value.get()


def check_one_continuous_stream(events: list[Any], baseline: list[Any], kind: str = "chat") -> None:
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert not any(isinstance(e, dict) and "error" in e for e in events), events
    assert streamed_text(events, kind) == streamed_text(baseline, kind)
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0].get("finish_reason")]
    assert finishes == ["length"]
    if kind == "chat":
        roles = [c for c in chunks if c["choices"][0].get("delta", {}).get("role")]
        assert len(roles) == 1
    assert events[-2]["usage"] == baseline[-2]["usage"]
    assert len({c["id"] for c in chunks}) == 1


@pytest.mark.parametrize("fault", [{"drop_after_tokens": 7}, {"error_after_tokens": 7},
                                   {"stall_after_tokens": 7}])
def test_engine_failure_mid_stream_is_relayed_without_a_seam(
        coord: CoordinatorServer, sims: tuple[SimulatedEngine, SimulatedEngine], fault: dict[str, int],
        caplog: pytest.LogCaptureFixture) -> None:
    before = calls(sims)
    baseline = run(coord, chat())
    victim = served_by(sims, before)
    victim.set_faults(calls=1, **fault)
    with caplog.at_level(logging.INFO, logger="coordinator"):
        events = run(coord, chat())  # prefix affinity sends it to the same engine first
    check_one_continuous_stream(events, baseline)
    assert relays(coord) == 1
    relay = [r for r in caplog.records if getattr(r, "event", None) == "relay"]
    assert len(relay) == 1 and relay[0].fields["result"] == "ok"  # type: ignore[attr-defined]
    assert relay[0].fields["from_engine"] == victim.url  # type: ignore[attr-defined]
    assert relay[0].fields["committed"] >= fault.popitem()[1] - 1  # type: ignore[attr-defined]
    assert coord.wait_idle() == 0
    assert coord.components.ledger.global_inflight == 0


def test_completions_relay_and_replay_request(coord: CoordinatorServer,
                                              sims: tuple[SimulatedEngine, SimulatedEngine]) -> None:
    """The replay carries prompt + the tokens already streamed and asks only for the rest."""
    before = calls(sims)
    baseline = run(coord, completion(), "completion")
    victim = served_by(sims, before)
    other = sims[1] if victim is sims[0] else sims[0]
    victim.set_faults(calls=1, drop_after_tokens=10)
    events = run(coord, completion(), "completion")
    check_one_continuous_stream(events, baseline, "completion")
    assert relays(coord) == 1
    replay = other.state()["history"][-1]
    first = victim.state()["history"][-1]
    assert replay["prompt_tokens"] == first["prompt_tokens"] + 10
    assert replay["sampling_params"]["max_tokens"] == 30


def test_relay_gives_up_after_max_relays(render_sidecar: Any, sims: tuple[SimulatedEngine, SimulatedEngine],
                                         coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [s.url for s in sims], resilience={"max_relays": 0})
    for s in sims:
        s.set_faults(calls=1, drop_after_tokens=5)
    events = run(coord, chat())
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 502
    assert relays(coord) == 0
    assert coord.wait_idle() == 0


def test_mid_stream_failure_feeds_the_breaker(render_sidecar: Any, sims: tuple[SimulatedEngine, SimulatedEngine],
                                              coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [s.url for s in sims], resilience={"breaker_failures": 1})
    before = calls(sims)
    run(coord, chat())
    victim = served_by(sims, before)
    victim.set_faults(calls=1, error_after_tokens=4)
    run(coord, chat())
    engine = coord.components.registry.get(victim.url)
    assert engine is not None and engine.breaker.state == "open"


def test_n2_stream_is_not_relayed_after_output(coord: CoordinatorServer,
                                               sims: tuple[SimulatedEngine, SimulatedEngine]) -> None:
    """Two choices share one engine request and their ledgers differ: no mid-stream replay."""
    for s in sims:
        s.set_faults(calls=1, drop_after_tokens=5)
    events = run(coord, chat(n=2, temperature=0.7, seed=3))
    assert events[-1] == "[DONE]" and "error" in events[-2]
    assert relays(coord) == 0
    assert coord.wait_idle() == 0


def test_n2_failure_before_any_output_is_retried_as_a_whole(
        coord: CoordinatorServer, sims: tuple[SimulatedEngine, SimulatedEngine]) -> None:
    body = chat(n=2, temperature=0.7, seed=3, max_tokens=10)
    before = calls(sims)
    baseline = run(coord, body)
    served_by(sims, before).set_faults(calls=1, drop_after_tokens=0)  # the 200, then no chunk
    retries = coord.components.metrics.retries._value.get()
    events = run(coord, body)
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events), events
    assert streamed_text(events) == streamed_text(baseline)
    # The stream counts as open only once its first chunk is in (engines/client.py), so this is a
    # retry before anything streamed, not a relay.
    assert coord.components.metrics.retries._value.get() == retries + 1 and relays(coord) == 0
    assert coord.wait_idle() == 0


def test_non_streaming_stop_string_request_is_relayed(
        coord: CoordinatorServer, sims: tuple[SimulatedEngine, SimulatedEngine]) -> None:
    """Non-streaming requests with stop strings stream internally; their relay is invisible too."""
    body = {**chat(stream=False, stop=["zzz-never"]), "stream_options": None}
    before = calls(sims)
    baseline = httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=60).json()
    served_by(sims, before).set_faults(calls=1, drop_after_tokens=6)
    out = httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=60).json()
    assert out["choices"][0]["message"]["content"] == baseline["choices"][0]["message"]["content"]
    assert out["usage"] == baseline["usage"]
    assert relays(coord) == 1


def test_handoff_relay_re_prefills_the_replay(render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """P/D: the relay runs the whole topology again; the prefill engine computes prompt + ledger."""
    mk = lambda role, eid: SimulatedEngine(SimConfig(model=SERVED, mode="context", kv_role=role,  # noqa: E731
                                                      engine_id=eid, decode_s_per_token=0.003))
    with mk("prefill", "p0") as p, mk("decode", "d0") as d0, mk("decode", "d1") as d1:
        coord = coordinator_factory(render_sidecar.url, [], topology={"pd_min_uncached_tokens": 0},
                                    engines=[{"url": p.url, "role": "prefill"}, {"url": d0.url, "role": "decode"},
                                             {"url": d1.url, "role": "decode"}])
        before = calls((d0, d1))
        baseline = run(coord, chat())
        victim = served_by((d0, d1), before)
        victim.set_faults(calls=1, drop_after_tokens=8)
        events = run(coord, chat())
        check_one_continuous_stream(events, baseline)
        prefills = p.state()["history"]
        assert prefills[-1]["prompt_tokens"] == prefills[-2]["prompt_tokens"] + 8
        assert relays(coord) == 1
        assert coord.wait_idle() == 0
