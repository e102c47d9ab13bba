"""``limits.context_budget_mode``: a budget that does not fit is a 400 (off) or clamped to what fits (on),
against the real render sidecar (max_model_len 2048) and simulated engines that record what they got."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import MAX_MODEL_LEN, SERVED, CoordinatorFactory
from tests.support import CoordinatorServer, sse_events, streamed_text
from token_engine.simulator import SimConfig, SimulatedEngine

ON = {"context_budget_mode": "on"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def sim() -> Iterator[SimulatedEngine]:
    with SimulatedEngine(SimConfig(model=SERVED, max_model_len=MAX_MODEL_LEN)) as eng:
        yield eng


def sent(engine: SimulatedEngine) -> list[dict[str, Any]]:
    return engine.state()["history"]


def post(coord: CoordinatorServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{coord.url}{path}", json={"model": SERVED, **body}, timeout=60)


def test_off_keeps_openais_rule(render_sidecar: Any, sim: SimulatedEngine,
                                coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url])
    r = post(coord, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 5000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert sent(sim) == []


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("stream", [False, True])
def test_on_clamps_a_chat_budget_to_what_fits(render_sidecar: Any, sim: SimulatedEngine,
                                              coordinator_factory: CoordinatorFactory, field: str,
                                              stream: bool) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url], limits=ON)
    r = post(coord, "/v1/chat/completions", {"messages": QUESTION, field: 5000, "stream": stream,
                                            "stream_options": {"include_usage": True} if stream else None})
    assert r.status_code == 200, r.text
    usage = sse_events(r)[-2]["usage"] if stream else r.json()["usage"]
    got = sent(sim)[-1]
    assert got["sampling_params"]["max_tokens"] == MAX_MODEL_LEN - usage["prompt_tokens"]
    assert got["prompt_tokens"] == usage["prompt_tokens"]
    if stream:
        assert streamed_text(sse_events(r))


def test_on_never_raises_or_invents_a_budget(render_sidecar: Any, sim: SimulatedEngine,
                                             coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url], limits=ON)
    assert post(coord, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 7}).status_code == 200
    assert sent(sim)[-1]["sampling_params"]["max_tokens"] == 7
    r = post(coord, "/v1/completions", {"prompt": "The capital of France is"})
    assert r.status_code == 200
    assert sent(sim)[-1]["sampling_params"]["max_tokens"] == 16  # the completions default, as off


def test_on_clamps_multi_prompt_completions_to_the_longest_prompt(
        render_sidecar: Any, sim: SimulatedEngine, coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url], limits=ON)
    short, long = "Hi", "The history of the city of Paris " * 20
    r = post(coord, "/v1/completions", {"prompt": [short, long], "max_tokens": 4000})
    assert r.status_code == 200, r.text
    calls = sent(sim)[-2:]
    longest = max(c["prompt_tokens"] for c in calls)
    assert longest > min(c["prompt_tokens"] for c in calls)
    assert [c["sampling_params"]["max_tokens"] for c in calls] == [MAX_MODEL_LEN - longest] * 2


def test_on_holds_to_the_shortest_engine_of_a_pd_pair(render_sidecar: Any,
                                                      coordinator_factory: CoordinatorFactory) -> None:
    """P and D sized apart: the budget is what fits the shorter one."""
    with (SimulatedEngine(SimConfig(model=SERVED, kv_role="prefill", engine_id="p0", max_model_len=1024)) as p,
          SimulatedEngine(SimConfig(model=SERVED, kv_role="decode", engine_id="d0")) as d):
        coord = coordinator_factory(
            render_sidecar.url, [], limits=ON, topology={"pd_min_uncached_tokens": 0},
            engines=[{"url": p.url, "role": "prefill", "max_model_len": 1024}, {"url": d.url, "role": "decode"}])
        r = post(coord, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1500})
        assert r.status_code == 200, r.text
        prompt = r.json()["usage"]["prompt_tokens"]
        assert sent(d)[-1]["sampling_params"]["max_tokens"] == 1024 - prompt
        assert sent(p)[-1]["sampling_params"]["max_tokens"] == 1
        off = coordinator_factory(
            render_sidecar.url, [], topology={"pd_min_uncached_tokens": 0},
            engines=[{"url": p.url, "role": "prefill", "max_model_len": 1024}, {"url": d.url, "role": "decode"}])
        refused = post(off, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1500})
        assert refused.status_code == 400 and "1024" in refused.json()["error"]["message"]


def test_on_leaves_a_prompt_that_fills_the_context_to_the_engine(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """Nothing fits: the request goes as it is and the engine's refusal (a 400) reaches the client."""
    with SimulatedEngine(SimConfig(model=SERVED, max_model_len=64)) as small:
        coord = coordinator_factory(render_sidecar.url, [],
                                    engines=[{"url": small.url, "max_model_len": 64}], limits=ON)
        r = post(coord, "/v1/completions", {"prompt": "word " * 100, "max_tokens": 10})
        assert r.status_code == 400, r.text
        assert "maximum model length" in r.json()["error"]["message"]
        assert sent(small)[-1]["sampling_params"]["max_tokens"] == 10  # sent unclamped, refused there
        assert coord.wait_idle() == 0


def test_on_logs_requested_and_effective(render_sidecar: Any, sim: SimulatedEngine,
                                         coordinator_factory: CoordinatorFactory,
                                         caplog: pytest.LogCaptureFixture) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url], limits=ON)
    with caplog.at_level(logging.INFO, logger="coordinator"):
        r = post(coord, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 5000})
    prompt = r.json()["usage"]["prompt_tokens"]
    line = f"requested 5000 output tokens, effective {MAX_MODEL_LEN - prompt} (prompt {prompt} tokens"
    assert any(line in rec.getMessage() for rec in caplog.records)
