"""KV-affinity between two real CPU vLLM engines, seen from the engines' own prefix-cache counters.

A conversation with a long system prompt is replayed turn by turn while a second conversation runs
alongside. With affinity routing each conversation stays on one engine and that engine's
``vllm:prefix_cache_hits`` grows by (at least) the shared prefix on every later turn. Both index
sources are exercised: approximate (learned from routing) and precise (the engines' KV events).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import SERVED, VllmStack, make_settings
from tests.support import CoordinatorServer

pytestmark = pytest.mark.e2e

CPU_BLOCK = 128  # vLLM's KV block size on CPU: only full 128-token blocks are cached


def prefix_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name == "vllm:prefix_cache_hits":
            total += sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return total


def decisions(coord: CoordinatorServer) -> dict[str, float]:
    reg = coord.components.metrics.registry
    out: dict[str, float] = {}
    for fam in reg.collect():
        if fam.name == "coordinator_scheduling_decisions":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels["engine"]] = s.value
    return out


def system_prompt(tag: str) -> str:
    # ~700 tokens, distinct per conversation and per run (so no earlier test warmed the cache).
    facts = " ".join(f"Fact {i}: the {tag} archive stores record number {i * 7919 % 1000}." for i in range(60))
    return f"You are the {tag} archivist ({uuid.uuid4().hex}). {facts}"


def turn(coord: CoordinatorServer, messages: list[dict[str, str]]) -> tuple[str, str]:
    """One non-streaming turn; returns (engine that served it, assistant text)."""
    before = decisions(coord)
    r = httpx.post(f"{coord.url}/v1/chat/completions", timeout=120,
                   json={"model": SERVED, "messages": messages, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    after = decisions(coord)
    served = [e for e, v in after.items() if v > before.get(e, 0)]
    assert len(served) == 1
    return served[0], r.json()["choices"][0]["message"]["content"]


def wait_for_index(coord: CoordinatorServer, engine: str, timeout: float = 10.0) -> None:
    """Precise mode learns from the engine's KV events, which arrive shortly after the request."""
    index = coord.components.scheduler.index
    assert index is not None
    deadline = time.monotonic() + timeout
    while index.blocks(engine) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert index.blocks(engine) > 0, "no KV events reached the precise index"


@pytest.mark.parametrize("source", ["approximate", "precise"])
def test_conversations_stick_to_one_engine_and_hit_its_prefix_cache(vllm_stack: VllmStack,
                                                                    source: str) -> None:
    urls = [vllm_stack.engine.url, vllm_stack.engine2.url]
    engines: list[dict[str, Any]] = [{"url": u, "kv_events": vllm_stack.kv_events[u]} for u in urls]
    settings = make_settings(vllm_stack.render_url, [], engines=engines,
                             scheduling={"policy": "affinity",
                                         "prefix": {"source": source, "block_size": 16}})
    with CoordinatorServer(settings) as coord:
        convs = {tag: [{"role": "system", "content": system_prompt(tag)}] for tag in ("red", "blue")}
        home: dict[str, str] = {}
        hits_before = {u: prefix_hits(u) for u in urls}
        repeat_prompt_tokens: dict[str, int] = dict.fromkeys(urls, 0)
        for round_ in range(3):
            for tag, messages in convs.items():
                messages.append({"role": "user", "content": f"Question {round_}: which record is fact {round_}?"})
                engine, answer = turn(coord, messages)
                messages.append({"role": "assistant", "content": answer})
                if round_ == 0:
                    home[tag] = engine
                    if source == "precise":
                        wait_for_index(coord, engine)
                else:
                    assert engine == home[tag], f"{tag} moved from {home[tag]} to {engine} in round {round_}"
                    repeat_prompt_tokens[engine] += 1
        # The two conversations were spread over both engines (load breaks the first-turn tie).
        assert set(home.values()) == set(urls)
        for u in urls:
            gained = prefix_hits(u) - hits_before[u]
            # Each later turn re-uses at least the system prompt's full blocks (5 blocks of 128 tokens).
            assert gained >= repeat_prompt_tokens[u] * 5 * CPU_BLOCK, (u, gained)


def test_round_robin_scatters_the_same_conversation(vllm_stack: VllmStack) -> None:
    """The contrast: without affinity a conversation's turns alternate between engines."""
    urls = [vllm_stack.engine.url, vllm_stack.engine2.url]
    settings = make_settings(vllm_stack.render_url, urls, scheduling={"policy": "round_robin"})
    with CoordinatorServer(settings) as coord:
        messages = [{"role": "system", "content": system_prompt("green")}]
        served = []
        for round_ in range(2):
            messages.append({"role": "user", "content": f"Question {round_}?"})
            engine, answer = turn(coord, messages)
            messages.append({"role": "assistant", "content": answer})
            served.append(engine)
        assert served[0] != served[1]
