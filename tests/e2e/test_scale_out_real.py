"""Two coordinator replicas agree on placement through the engines' KV events (docs/scale-out.md).

Two ``python -m coordinator`` processes, as two replicas of the coordinator Deployment would run,
sit in front of the same two real CPU engines with ``scheduling.prefix.source: precise``. They share
no state: each learns what the engines hold only from the engines' own KV events. A conversation
with a long system prompt sends each turn to the replica that did NOT serve the previous one; the
turn must still land on the engine holding the conversation's prefix, and that engine's own
``vllm:prefix_cache_hits`` must grow by at least the shared full blocks while the other engine's do
not. A second conversation runs alongside and lives on the other engine, so neither "always engine
0" nor load explains the placement: each replica sends each conversation to that conversation's
engine.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import SERVED, VllmStack
from tests.support import CoordinatorProcess

pytestmark = pytest.mark.e2e

CPU_BLOCK = 128  # vLLM's KV block size on CPU: only full 128-token blocks are cached
SETTLE_S = 0.5  # after a turn: KV events reach both replicas, engine counters update (docs/scale-out.md)
ROUNDS = 4


def counters(url: str, name: str, label: str | None = None) -> dict[str, float]:
    """A counter family from ``url``/metrics: summed per value of ``label`` (one key "" without)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        if fam.name == name:
            for s in fam.samples:
                if s.name.endswith("_total"):
                    key = s.labels.get(label, "") if label else ""
                    out[key] = out.get(key, 0.0) + s.value
    return out


def prefix_hits(engine: str) -> float:
    return counters(engine, "vllm:prefix_cache_hits").get("", 0.0)


def finished(engine: str) -> float:
    return counters(engine, "vllm:request_success").get("", 0.0)


def system_prompt(tag: str) -> str:
    # ~700 tokens (5 full CPU blocks), unique per run so no earlier test warmed the engines' caches.
    facts = " ".join(f"Fact {i}: the {tag} archive stores record number {i * 7919 % 1000}." for i in range(60))
    return f"You are the {tag} archivist ({uuid.uuid4().hex}). {facts}"


def turn(coord: CoordinatorProcess, engines: list[str], messages: list[dict[str, str]]) -> dict[str, Any]:
    """One non-streaming turn through ``coord``; which engine served it, by the replica's own decision
    counter and by the engines' own finished-request counters (they must agree), and each engine's
    prefix-cache hits for it."""
    decisions = counters(coord.url, "coordinator_scheduling_decisions", "engine")
    done = {e: finished(e) for e in engines}
    hits = {e: prefix_hits(e) for e in engines}
    prefix = counters(coord.url, "coordinator_prefix_hit_tokens").get("", 0.0)
    r = httpx.post(f"{coord.url}/v1/chat/completions", timeout=120,
                   json={"model": SERVED, "messages": messages, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    time.sleep(SETTLE_S)  # the engines' counters and the other replica's index catch up
    picked = [e for e, v in counters(coord.url, "coordinator_scheduling_decisions", "engine").items()
              if v > decisions.get(e, 0)]
    ran = [e for e in engines if finished(e) > done[e]]
    assert len(picked) == 1 and picked == ran, (picked, ran)
    return {"engine": picked[0], "text": r.json()["choices"][0]["message"]["content"],
            "hits": {e: prefix_hits(e) - hits[e] for e in engines},
            "index_hit_tokens": counters(coord.url, "coordinator_prefix_hit_tokens").get("", 0.0) - prefix}


def replica_config(stack: VllmStack) -> dict[str, Any]:
    engines = [stack.engine.url, stack.engine2.url]
    return {"render": {"url": stack.render_url},
            "engines": [{"url": u, "kv_events": stack.kv_events[u]} for u in engines],
            "models": [{"name": SERVED, "aliases": ["gpt-4o-mini"]}],
            "scheduling": {"policy": "affinity", "prefix": {"source": "precise", "block_size": 16}}}


def test_replicas_alternating_turns_keep_each_conversation_on_its_engine(vllm_stack: VllmStack,
                                                                         tmp_path: Path) -> None:
    engines = [vllm_stack.engine.url, vllm_stack.engine2.url]
    cfg = replica_config(vllm_stack)
    with CoordinatorProcess(cfg, tmp_path, "replica-a") as a, CoordinatorProcess(cfg, tmp_path, "replica-b") as b:
        time.sleep(1.0)  # ZMQ subscriptions join late: events published before they connect are lost
        replicas = {"A": a, "B": b}
        convs = {tag: [{"role": "system", "content": system_prompt(tag)}] for tag in ("red", "blue")}
        home: dict[str, str] = {}
        log: list[tuple[int, str, str, str, dict[str, float], float]] = []
        for round_ in range(ROUNDS):
            name = "AB"[round_ % 2]  # every turn goes to the replica that did not serve the last one
            for tag, messages in convs.items():
                messages.append({"role": "user", "content": f"Question {round_}: which record is fact {round_}?"})
                t = turn(replicas[name], engines, messages)
                messages.append({"role": "assistant", "content": t["text"]})
                log.append((round_, tag, name, t["engine"], t["hits"], t["index_hit_tokens"]))
                if round_ == 0:
                    home[tag] = t["engine"]
                else:
                    other = next(e for e in engines if e != home[tag])
                    assert t["engine"] == home[tag], f"{tag} moved to {t['engine']} in round {round_} via {name}"
                    # The engine re-used at least the system prompt's 5 full blocks; the other one nothing.
                    assert t["hits"][home[tag]] >= 5 * CPU_BLOCK, log[-1]
                    assert t["hits"][other] == 0, log[-1]
                    # The replica knew the prefix from its index (KV events), not by chance.
                    assert t["index_hit_tokens"] >= 5 * CPU_BLOCK, log[-1]
        # The control: the two conversations live on different engines, and each replica sent turns to
        # both engines, so a replica's choice follows the conversation, not a favourite engine.
        assert home["red"] != home["blue"]
        for name in "AB":
            assert {e for _, _, n, e, _, _ in log if n == name} == set(engines)
    short = {u: f"engine{i + 1}" for i, u in enumerate(engines)}
    print("\nround conversation replica engine hits(engine1) hits(engine2) replica-index-hit-tokens")
    for round_, tag, name, engine, hits, index_hits in log:
        print(f"{round_} {tag} {name} {short[engine]} {hits[engines[0]]:.0f} {hits[engines[1]]:.0f} "
              f"{index_hits:.0f}")
