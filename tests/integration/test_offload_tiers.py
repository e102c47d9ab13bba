"""Offload tiers (``scheduling.prefix.tiers``): an engine that evicted conversations from its KV cache
but still holds them in its CPU offload tier (vLLM's OffloadingConnector, here the simulator's, over
real ZMQ) gets their next turns, which it loads back instead of computing again. Without the tiers
the same turns look new to the coordinator, which spreads new prefixes over the engines."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from coordinator.contracts.hashing import block_hashes, chain_seed
from tests.conftest import SERVED, CoordinatorFactory
from tests.support import wait_until
from token_engine.simulator import SimConfig, SimulatedEngine

BS = 16
TURN = 160          # tokens a turn adds: 10 blocks
GPU_BLOCKS = 24     # each engine's own cache: a turn and a half of other prompts evict a conversation
CPU_BLOCKS = 2000   # its CPU tier keeps everything here


def _prompt(conversation: int, turns: int) -> list[int]:
    return [100 + (conversation * 7919 + i * 31) % 20000 for i in range(TURN * turns)]


def _turn(url: str, conversation: int, turn: int) -> None:
    r = httpx.post(f"{url}/v1/completions", timeout=60, headers={"x-request-id": f"c{conversation}-t{turn}"},
                   json={"model": SERVED, "prompt": _prompt(conversation, turn), "max_tokens": 2,
                         "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text


def _generate(engine: SimulatedEngine, token_ids: list[int]) -> None:
    r = httpx.post(f"{engine.url}/inference/v1/generate", timeout=30,
                   json={"token_ids": token_ids, "sampling_params": {"max_tokens": 1}})
    assert r.status_code == 200, r.text


def _ran_on(engines: list[SimulatedEngine], rid: str) -> str:
    where = [e.url for e in engines for h in e.state()["history"] if h["request_id"].endswith(rid)
             or f"{rid}-" in h["request_id"]]
    assert len(where) == 1, (rid, where)
    return where[0]


def test_a_conversation_offloaded_to_cpu_goes_back_to_the_engine_holding_it(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    with ExitStack() as stack:
        engines = [stack.enter_context(SimulatedEngine(SimConfig(
            model=SERVED, seed=i, decode_s_per_token=0.002, block_size=BS, capacity_blocks=GPU_BLOCKS,
            offload_blocks=CPU_BLOCKS, kv_events_endpoint="tcp://*:0"))) for i in range(2)]
        feeds = [{"url": e.url, "kv_events": e.state()["kv_events"]["endpoint"].replace("*", "127.0.0.1")}
                 for e in engines]
        coord = coordinator_factory(str(render_sidecar.url), [], engines=feeds, scheduling={
            "prefix": {"source": "precise", "block_size": BS}})
        memory = coord.components.scheduler.memory
        assert set(memory.tiers) == {"CPU", "STORAGE"}
        seed = chain_seed(SERVED)
        conversations = range(4)
        holder, other = engines
        index = memory.index
        assert index is not None
        # ZMQ drops what is published before the coordinator's subscription arrives: warm it up.
        assert wait_until(lambda: _generate(holder, list(range(50, 50 + TURN))) or index.blocks(holder.url) > 0,
                          timeout=10), "the coordinator never heard the engine's KV events"
        # The conversations' first turns ran on one engine (another coordinator replica, an earlier
        # life of this one: only the engine's KV events tell this coordinator), then other work
        # filled its cache: the conversations left it for its CPU tier.
        for c in conversations:
            _generate(holder, _prompt(c, 1))
        for k in range(3):
            _generate(holder, [30000 + k * TURN + t for t in range(TURN)])
        home = dict.fromkeys(conversations, holder.url)

        def offloaded_only() -> bool:
            chains = {c: block_hashes(_prompt(c, 1), BS, seed) for c in conversations}
            return all(index.match(chains[c]).get(home[c], 0) == 0
                       and memory.tiers["CPU"].match(chains[c]).get(home[c]) == TURN // BS
                       for c in conversations)

        assert wait_until(offloaded_only, timeout=10), "the engines' GPU and CPU events"
        loaded = {e.url: e.state()["prefix_cache"]["offload_hits"] for e in engines}
        for c in conversations:
            _turn(coord.url, c, 2)
        assert {c: _ran_on(engines, f"c{c}-t2") for c in conversations} == home
        gained = holder.state()["prefix_cache"]["offload_hits"] - loaded[holder.url]
        assert gained >= len(conversations) * (TURN - BS), gained   # loaded back, not recomputed
        assert other.state()["history"] == []
        held = {s.labels["index"]: s.value
                for family in text_string_to_metric_families(httpx.get(f"{coord.url}/metrics", timeout=10).text)
                for s in family.samples
                if s.name == "coordinator_prefix_index_blocks" and s.labels["engine"] == holder.url}
        assert held["tier_cpu"] >= len(conversations) * TURN // BS and 0 < held["index"] <= GPU_BLOCKS
