"""The simulator's KV cache events must be exactly what a vLLM 0.32 engine with `--kv-events-config` sends.

Decoding goes through vLLM's own `msgspec.msgpack.Decoder(type=KVEventBatch)`, so a field renamed,
reordered or retyped on our side fails here; the content is checked against the simulator's cache.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from coordinator.contracts.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    external_hash,
    is_bind_endpoint,
)
from token_engine.simulator import SimConfig, build_app
from token_engine.simulator.__main__ import parse_args
from token_engine.simulator.prefix_cache import PrefixCache, block_hashes

GEN = "/inference/v1/generate"


@pytest.fixture(scope="module")
def vllm_kv() -> Any:
    return pytest.importorskip("vllm.distributed.kv_events")


def ext(tokens: list[int], salt: str | None = None, bs: int = 4) -> list[int]:
    return [int(external_hash(h, True)) for h in block_hashes(tokens, bs, salt)]


class Subscriber:
    """A SUB socket that hands back `(topic, seq, batch decoded by vLLM, raw payload)`."""

    def __init__(self, decoder: msgspec.msgpack.Decoder[Any], topic: bytes = b"kv") -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.decoder = decoder

    def recv(self, timeout_s: float = 3.0) -> tuple[bytes, int, Any, bytes]:
        assert self.sock.poll(int(timeout_s * 1000)), "no KV event batch arrived"
        frames = self.sock.recv_multipart()
        assert len(frames) == 3
        topic, seq, payload = frames
        assert len(seq) == 8
        return topic, int.from_bytes(seq, "big"), self.decoder.decode(payload), payload

    def events(self) -> list[Any]:
        return list(self.recv()[2].events)

    def close(self) -> None:
        self.sock.close(linger=0)


@asynccontextmanager
async def sim_with_subscriber(
    config: SimConfig, vllm_kv: Any, *, connect: bool = True
) -> AsyncIterator[tuple[httpx.AsyncClient, Subscriber]]:
    """An in-process simulator plus a subscriber that has provably joined (slow-joiner handshake)."""
    app = build_app(config)
    sub = Subscriber(msgspec.msgpack.Decoder(type=vllm_kv.KVEventBatch))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim")
    try:
        if connect:
            sub.sock.connect((await client.get("/sim/state")).json()["kv_events"]["endpoint"])
        # PUB drops what it sends before the subscription arrives: reset (AllBlocksCleared) until one
        # gets through, then skip the rest of the handshake's batches.
        resets = 0
        deadline = time.monotonic() + 5
        while not sub.sock.poll(100):
            assert time.monotonic() < deadline, "subscriber never joined"
            await client.post("/sim/reset_prefix_cache")
            resets += 1
        while True:
            _, seq, batch, _ = sub.recv()
            assert [type(e).__name__ for e in batch.events] == ["AllBlocksCleared"]
            if seq == resets - 1:
                break
        yield client, sub
    finally:
        await client.aclose()
        sub.close()
        app.state.sim.close()


async def generate(c: httpx.AsyncClient, tokens: list[int], **extra: Any) -> dict[str, Any]:
    r = await c.post(GEN, json={"token_ids": tokens, "sampling_params": {"max_tokens": 1}, **extra})
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


async def test_events_decode_with_vllm_and_follow_the_cache(vllm_kv: Any) -> None:
    cfg = SimConfig(kv_events_endpoint="tcp://*:0", block_size=4, capacity_blocks=6)
    async with sim_with_subscriber(cfg, vllm_kv) as (c, sub):
        a = list(range(100, 110))  # 2 full blocks + 2 tokens
        await generate(c, a)
        topic, _, batch, raw = sub.recv()
        assert topic == b"kv" and batch.data_parallel_rank == 0 and batch.ts == pytest.approx(time.time(), abs=5)
        [stored] = batch.events
        assert isinstance(stored, vllm_kv.BlockStored)
        assert stored.block_hashes == ext(a) and stored.parent_block_hash is None
        assert stored.token_ids == a[:8] and stored.block_size == 4
        assert (stored.medium, stored.lora_id, stored.lora_name, stored.group_idx) == ("GPU", None, None, 0)
        assert stored.extra_keys == [None, None]  # one entry per block, as vLLM's to_event_extra_keys
        # The raw payload is vLLM's layout: [ts, [{"type": "BlockStored", ...}], dp_rank], defaults omitted.
        generic = msgspec.msgpack.decode(raw)
        assert len(generic) == 3 and generic[2] == 0
        assert list(generic[1][0]) == [
            "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
            "lora_name", "extra_keys", "group_idx",
        ]  # fmt: skip

        # A longer prompt sharing a's blocks stores only its new run, chained to a's last block.
        b = [*a[:8], *range(200, 208)]
        await generate(c, b)
        [stored] = sub.events()
        assert stored.block_hashes == ext(b)[2:] and stored.parent_block_hash == ext(a)[1]
        assert stored.token_ids == b[8:16] and stored.extra_keys == [None, None]

        # Capacity 6: 4 cached + 3 new evicts one block, b's tail first (a parent outlives its children).
        d = list(range(300, 312))
        await generate(c, d)
        removed, stored = sub.events()
        assert isinstance(removed, vllm_kv.BlockRemoved)
        assert removed.block_hashes == [ext(b)[3]] and (removed.medium, removed.group_idx) == ("GPU", 0)
        assert stored.block_hashes == ext(d) and stored.parent_block_hash is None
        state = (await c.get("/sim/state")).json()
        assert state["prefix_cache"]["blocks"] == 6 and state["prefix_cache"]["evictions"] == 1

        # A cache hit stores nothing new; the salted first block carries the salt in extra_keys.
        await generate(c, d)
        await generate(c, d[:8], cache_salt="tenant-1")
        removed1, removed2, stored = sub.events()
        assert {removed1.block_hashes[0], removed2.block_hashes[0]} == {ext(b)[2], ext(a)[1]}
        assert stored.block_hashes == ext(d[:8], "tenant-1") != ext(d[:8])
        assert stored.extra_keys == [("tenant-1",), None]

        await c.post("/sim/reset_prefix_cache")
        [cleared] = sub.events()
        assert isinstance(cleared, vllm_kv.AllBlocksCleared)
        assert not sub.sock.poll(100)  # nothing else was published


async def test_a_cpu_offload_tier_publishes_its_own_events_and_serves_evicted_prefixes(vllm_kv: Any) -> None:
    """``offload_blocks``: vLLM's OffloadingConnector with self-describing events. Every computed block
    is stored to the CPU tier too (medium CPU, same hashes, tokens and parents); a prefix the GPU
    evicted is loaded back from it (cached, and cheaper than a prefill), and the tier evicts its own."""
    cfg = SimConfig(kv_events_endpoint="tcp://*:0", block_size=4, capacity_blocks=3, offload_blocks=5,
                    enable_prompt_tokens_details=True, prefill_s_per_token=0.0)
    async with sim_with_subscriber(cfg, vllm_kv) as (c, sub):
        a = list(range(100, 113))                   # 3 full blocks
        await generate(c, a)
        gpu, cpu = sub.events()
        assert (gpu.medium, cpu.medium) == ("GPU", "CPU")
        assert cpu.block_hashes == gpu.block_hashes == ext(a) and cpu.parent_block_hash is None
        assert cpu.token_ids == a[:12] and cpu.block_size == 4

        b = list(range(300, 309))                   # 2 blocks: the GPU evicts 2 of a's, the CPU keeps all
        await generate(c, b)
        assert [(type(e).__name__, e.medium) for e in sub.events()] == [
            ("BlockRemoved", "GPU"), ("BlockRemoved", "GPU"), ("BlockStored", "GPU"), ("BlockStored", "CPU")]
        state = (await c.get("/sim/state")).json()["prefix_cache"]
        assert (state["blocks"], state["offload_blocks"]) == (3, 5)

        out = await generate(c, [*a, 7])             # a's blocks come back from the CPU tier
        assert out["choices"][0] is not None
        state = (await c.get("/sim/state")).json()["prefix_cache"]
        assert state["offload_hits"] == 8            # a's first block stayed on the GPU; two were loaded
        events = sub.events()
        assert [e.medium for e in events if isinstance(e, vllm_kv.BlockStored)] == ["GPU"]  # CPU has them
        assert all(e.medium == "GPU" for e in events if isinstance(e, vllm_kv.BlockRemoved))

        d = list(range(500, 513))                   # 3 new blocks: the CPU tier (5) evicts its oldest
        await generate(c, d)
        cpu_removed = [e for e in sub.events() if isinstance(e, vllm_kv.BlockRemoved) and e.medium == "CPU"]
        assert len(cpu_removed) == 1 and set(cpu_removed[0].block_hashes) <= set(ext(a) + ext(b))


def test_the_cpu_tier_serves_evicted_prefixes_without_kv_events_too() -> None:
    """The tier is the engine's, not the events': an engine that publishes nothing still loads back."""
    cache = PrefixCache(4, 2, offload_blocks=8)
    a, b = list(range(100, 109)), list(range(300, 309))       # 2 full blocks each
    cache.insert(a)
    cache.insert(b)                                           # the GPU (2 blocks) evicts a's
    assert cache.lookup(a) == 8 and cache.last_loaded == 8    # both of a's blocks come from the tier
    assert cache.stats.hits == 0 and cache.stats.offload_hits == 8 and cache.offloaded_len == 4


async def test_a_consumer_can_rebuild_the_cache_from_events(vllm_kv: Any) -> None:
    """Replaying stored/removed events gives exactly the simulator's cache, and every stored run's parent
    is a block the consumer already knows (so it can follow parent_block_hash)."""
    cfg = SimConfig(kv_events_endpoint="tcp://*:0", block_size=4, capacity_blocks=10)
    async with sim_with_subscriber(cfg, vllm_kv) as (c, sub):
        shared = list(range(500, 516))
        prompts = [[*shared, *range(1000 * i, 1000 * i + 9)] for i in range(1, 6)]
        for p in prompts:
            await generate(c, p)
        known: dict[int, int | None] = {}  # hash -> parent
        tokens: dict[int, list[int]] = {}
        for _ in prompts:
            for e in sub.events():
                if isinstance(e, vllm_kv.BlockStored):
                    assert e.parent_block_hash is None or e.parent_block_hash in known
                    parent = e.parent_block_hash
                    for i, h in enumerate(e.block_hashes):
                        known[h], tokens[h] = parent, e.token_ids[4 * i : 4 * i + 4]
                        parent = h
                else:
                    for h in e.block_hashes:
                        assert h in known
                        del known[h]
        cache = app_cache(c)
        assert set(known) == {int(external_hash(h, True)) for h in cache._blocks}
        # The shared prefix survived every eviction, and its chain reads back as its tokens.
        h = ext(shared)[-1]
        chain: list[int] = []
        while h is not None:
            chain[:0] = tokens[h]
            h = known[h]
        assert chain == shared


def app_cache(c: httpx.AsyncClient) -> PrefixCache:
    transport = c._transport
    assert isinstance(transport, httpx.ASGITransport)
    cache: PrefixCache = transport.app.state.sim.engine.prefix_cache  # type: ignore[attr-defined]
    return cache


async def test_connect_endpoint_bytes_hashes_and_replay(vllm_kv: Any) -> None:
    """`tcp://host:port` connects (the subscriber binds); hashes can be raw sha256 bytes; the replay
    ROUTER resends buffered batches from a sequence number, then END_SEQ."""
    sub = Subscriber(msgspec.msgpack.Decoder(type=vllm_kv.KVEventBatch), topic=b"")
    sub.sock.bind("tcp://127.0.0.1:*")
    endpoint = sub.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    cfg = SimConfig(
        kv_events_endpoint=endpoint, kv_events_replay_endpoint="tcp://*:0", kv_events_int_hashes=False,
        kv_events_topic="", block_size=4,
    )  # fmt: skip
    assert not is_bind_endpoint(endpoint) and is_bind_endpoint("tcp://*:5557")
    app = build_app(cfg)
    try:
        sim = app.state.sim
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim") as c:
            deadline = time.monotonic() + 5
            while not sub.sock.poll(100):
                assert time.monotonic() < deadline
                await c.post("/sim/reset_prefix_cache")
            prompt = list(range(40, 48))
            await generate(c, prompt)
            while True:
                topic, seq, batch, payload = sub.recv()
                if isinstance(batch.events[0], vllm_kv.BlockStored):
                    break
            assert topic == b"" and batch.events[0].block_hashes == block_hashes(prompt, 4)
            assert all(isinstance(h, bytes) and len(h) == 32 for h in batch.events[0].block_hashes)

            dealer = zmq.Context.instance().socket(zmq.DEALER)
            try:
                dealer.connect(sim.kv_events.replay_endpoint)
                dealer.send_multipart([b"", seq.to_bytes(8, "big")])
                assert dealer.poll(3000)
                assert dealer.recv_multipart() == [b"", b"", seq.to_bytes(8, "big"), payload]
                assert dealer.poll(3000)
                assert dealer.recv_multipart() == [b"", b"", END_SEQ, b""]
            finally:
                dealer.close(linger=0)
    finally:
        sub.close()
        app.state.sim.close()


def test_no_endpoint_means_no_publisher_and_events_are_batched_per_operation() -> None:
    assert build_app(SimConfig()).state.sim.kv_events is None
    batches: list[list[KVEvent]] = []
    cache = PrefixCache(block_size=2, capacity_blocks=3, on_events=batches.append)
    cache.insert([1, 2, 3, 4])
    cache.insert([9, 9, 8, 8, 7, 7])  # 5 blocks for 3 slots: old ones go first, then the new tail
    assert len(batches) == 2
    kinds = [type(e).__name__ for e in batches[1]]
    assert kinds == ["BlockRemoved", "BlockRemoved", "BlockStored"]
    assert len(cache) == 3 and cache.lookup([9, 9, 8, 8, 7, 7, 0]) == 6
    # A prompt longer than the whole cache: stored, then its own tail evicted, in that order.
    batches.clear()
    cache.insert(list(range(10)))
    kinds = [type(e).__name__ for e in batches[0]]
    assert kinds == ["BlockRemoved"] * 3 + ["BlockStored"] + ["BlockRemoved"] * 2
    stored = batches[0][3]
    assert isinstance(stored, BlockStored) and len(stored.block_hashes) == 5
    assert [e.block_hashes[0] for e in batches[0][4:] if isinstance(e, BlockRemoved)] == [
        stored.block_hashes[4],
        stored.block_hashes[3],
    ]
    cache.clear()
    assert isinstance(batches[-1][0], AllBlocksCleared)
    # A disabled cache publishes nothing, as vLLM without prefix caching.
    off: list[list[KVEvent]] = []
    PrefixCache(2, 3, enabled=False, on_events=off.append).insert([1, 2])
    assert off == []


def test_cli_takes_vllms_kv_events_config() -> None:
    _, cfg = parse_args(
        ["--kv-events-config", '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","topic":"kv"}']
    )
    assert (cfg.kv_events_endpoint, cfg.kv_events_topic, cfg.kv_events_replay_endpoint) == ("tcp://*:5557", "kv", None)
    _, cfg = parse_args(["--kv-events-config", '{"enable_kv_cache_events":true}'])
    assert (cfg.kv_events_endpoint, cfg.kv_events_topic) == ("tcp://*:5557", "")  # vLLM's defaults
    _, cfg = parse_args(["--kv-events-config", '{"enable_kv_cache_events":false,"endpoint":"tcp://*:1"}'])
    assert cfg.kv_events_endpoint is None



def test_structs_encode_byte_for_byte_like_vllms(vllm_kv: Any) -> None:
    from coordinator.contracts import kv_events as sim_kv

    enc = msgspec.msgpack.Encoder()
    stored = dict(block_hashes=[1, b"x" * 32], parent_block_hash=7, token_ids=[1, 2], block_size=2,
                  lora_id=None, medium="GPU", lora_name=None, extra_keys=[("salt",), None], group_idx=0)  # fmt: skip
    removed = dict(block_hashes=[3], medium="GPU", group_idx=0)
    for name, kw in (("BlockStored", stored), ("BlockRemoved", removed), ("AllBlocksCleared", {})):
        assert enc.encode(getattr(sim_kv, name)(**kw)) == enc.encode(getattr(vllm_kv, name)(**kw)), name
    ours = sim_kv.KVEventBatch(ts=1.5, events=[sim_kv.AllBlocksCleared()], data_parallel_rank=0)
    theirs = vllm_kv.KVEventBatch(ts=1.5, events=[vllm_kv.AllBlocksCleared()], data_parallel_rank=0)
    assert enc.encode(ours) == enc.encode(theirs)
