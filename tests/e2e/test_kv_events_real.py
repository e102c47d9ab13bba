"""The precise prefix index fed by a real CPU vLLM engine's KV events.

It subscribes to the session's second token-only engine (which publishes its KV events over ZMQ) for
the duration of the test.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from coordinator.contracts.hashing import block_hashes, chain_seed
from coordinator.pipeline.scheduling.prefix import kv_events
from coordinator.pipeline.scheduling.prefix.feeds import KvEventSubscriber
from coordinator.pipeline.scheduling.prefix.index import PrefixIndex
from coordinator.pipeline.scheduling.prefix.source import PreciseIndexSource
from tests.conftest import SERVED, VllmStack
from tests.integration.test_workers import pod
from tests.support import wait_until

pytestmark = pytest.mark.e2e

BS = 16  # the coordinator's index block size; the CPU engine's KV blocks are 128 tokens


def tokens(seed: int, n: int = 700) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 40000) for _ in range(n)]


def ours(prompt: list[int], salt: str | None = None) -> list[int]:
    return block_hashes(prompt, BS, chain_seed(SERVED, salt))


@pytest.fixture(scope="module")
def kv_engine(vllm_stack: VllmStack) -> tuple[Any, str]:
    """The session's second token-only engine, which publishes its KV events over ZMQ (topic "kv"),
    and that endpoint. Its cache may hold other tests' blocks; every prompt here is fresh random ids."""
    engine = vllm_stack.engine2
    return engine, vllm_stack.kv_events[engine.url]


async def generate(client: httpx.AsyncClient, url: str, prompt: list[int], rid: str, **extra: Any) -> None:
    body = {"request_id": rid, "model": SERVED, "token_ids": prompt,
            "sampling_params": {"max_tokens": 2, "temperature": 0}, **extra}
    resp = await client.post(f"{url}/inference/v1/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text


async def until(cond: Callable[[], bool], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.05)
    return cond()


async def joined(client: httpx.AsyncClient, url: str, sub: KvEventSubscriber) -> None:
    """Wait out ZMQ's slow joiner: send fresh prompts until one of their events arrives."""
    for i in range(10):
        await generate(client, url, tokens(1000 + i, 200), f"kv-warmup-{i}")
        if await until(lambda: sub.mirror.stats.batches > 0, within=2.0):
            return
    pytest.fail("no KV event batch reached the subscriber")


async def test_real_engine_events_drive_the_index(kv_engine: tuple[Any, str]) -> None:
    engine, endpoint = kv_engine
    index = PrefixIndex()
    source = PreciseIndexSource(index, lambda url: SERVED, BS, topic="kv")
    try:
        sub = await source.attach(engine.url, endpoint)
        mirror = sub.mirror
        async with httpx.AsyncClient() as client:
            await joined(client, engine.url, sub)
            assert sub.own_reader and sub.connects == 1   # vLLM's libzmq PUB, read by our ZMTP reader

            prompt = tokens(1)
            await generate(client, engine.url, prompt, "kv-1")
            assert await until(lambda: engine.url in index.match(ours(prompt)))
            ebs = mirror.stats.engine_block_size
            assert ebs is not None and ebs % BS == 0, ebs
            full = len(prompt) // ebs * ebs // BS  # 5 engine blocks of 128 → 40 of ours
            assert index.match(ours(prompt)) == {engine.url: full}
            assert index.match(ours(tokens(2))) == {}
            assert index.match(ours(prompt, salt="tenant1")) == {}

            # Shares 300 tokens with ``prompt``: the engine stores only the new blocks, chained to
            # the last shared one, so the run is placed through its parent.
            branch = prompt[:300] + tokens(3, 400)
            await generate(client, engine.url, branch, "kv-2")
            assert await until(lambda: index.match(ours(branch)).get(engine.url, 0) == full)
            assert mirror.stats.unknown_parent == 0
            # vLLM's own batches (extra keys None per block, one removal event per block) are read
            # and applied by the one C call, not decoded in Python (docs/scheduling.md).
            assert kv_events.NATIVE_MIRROR and mirror.stats.direct_batches >= 2, mirror.stats

            # cache_salt is in the first block's extra_keys and seeds a separate chain.
            await generate(client, engine.url, prompt, "kv-3", cache_salt="tenant1")
            assert await until(lambda: index.match(ours(prompt, salt="tenant1")) == {engine.url: full})
            assert index.match(ours(prompt)) == {engine.url: full}

            assert sub.gaps == 0 and sub.bad_frames == 0 and mirror.stats.bad_payloads == 0
            assert mirror.stats.other_medium == 0  # the CPU engine labels its primary pool "GPU"
    finally:
        await source.stop_all()
    assert index.blocks(engine.url) == 0


def test_the_pods_indexer_mirrors_a_real_engine(vllm_stack: VllmStack, kv_engine: tuple[Any, str],
                                                 tmp_path: Path) -> None:
    """Two workers and the pod's KV indexer (precise source) in front of the real engine: a request
    through the pod leaves its prompt's blocks in the indexer, mirrored from vLLM's own KV events; the
    workers only told it the endpoint."""
    engine, endpoint = kv_engine
    prompt = tokens(99)
    with pod(tmp_path, vllm_stack.render_url, engine.url,
             engines=[{"url": engine.url, "kv_events": endpoint}],
             scheduling={"prefix": {"source": "precise"}}) as p:

        def index() -> dict[str, Any]:
            state = httpx.get(f"{p.url}/ready", timeout=10).json()["prefix_index"]
            assert isinstance(state, dict), state
            return state

        assert wait_until(lambda: index()["feeds"] == 1, timeout=20)
        before = index()["blocks_stored"]
        r = httpx.post(f"{p.url}/v1/completions", timeout=120,
                       json={"model": SERVED, "prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        # 700 prompt tokens: 5 full engine blocks of 128, each 8 of the index's 16-token blocks.
        assert wait_until(lambda: index()["blocks_stored"] >= before + 5, timeout=20), index()
        state = index()
        assert state["blocks"] >= 40 and state["gaps"] == 0 and state["source"] == "precise"
