"""The pod's KV indexer and a worker's line to it, in one event loop over a real unix socket: what a
worker learns is in the next match (its own and another worker's), lessons the indexer has not seen
yet still count, and a line with nobody at the other end answers None at once or after its timeout,
never later."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from coordinator.config import PrefixIndexSettings
from coordinator.contracts.hashing import block_hashes, chain_seed
from coordinator.contracts.indexer import (
    MAX_FRAME,
    Attach,
    Detach,
    Learn,
    Match,
    Matched,
    decode_request,
    frame,
    frame_size,
    parse_address,
)
from coordinator.indexer.server import IndexServer
from coordinator.indexer.service import IndexService
from coordinator.pipeline.scheduling.prefix.memory import PrefixMemory
from coordinator.pipeline.scheduling.prefix.remote import RemoteIndex

SEED = chain_seed("m")
SHORT = block_hashes(list(range(1000, 1096)), 16, SEED)        # 6 blocks
LONG = block_hashes(list(range(1000, 1144)), 16, SEED)         # the same 6, then 3 more


def test_frames_round_trip_and_bounds() -> None:
    body = frame(Learn("http://e1", LONG))
    assert frame_size(body[:4]) == len(body) - 4
    assert decode_request(body[4:]) == Learn("http://e1", LONG)   # 64-bit hashes travel as they are
    with pytest.raises(ValueError, match="limit"):
        frame_size((MAX_FRAME + 1).to_bytes(4, "big"))
    with pytest.raises(msgspec.ValidationError):
        decode_request(msgspec.msgpack.encode({"op": "drop_everything"}))
    assert parse_address("unix:/run/x.sock") == ("unix", "/run/x.sock", 0)
    assert parse_address("tcp://indexer:5590") == ("tcp", "indexer", 5590)
    with pytest.raises(ValueError):
        parse_address("http://indexer:5590")


@contextlib.asynccontextmanager
async def indexer(tmp_path: Path) -> AsyncIterator[tuple[IndexServer, str]]:
    """An indexer served on this test's own loop."""
    address = f"unix:{tmp_path / 'indexer.sock'}"
    server = IndexServer(IndexService(PrefixIndexSettings()), [address])
    await server.start()
    try:
        yield server, address
    finally:
        await server.stop()


async def _line(address: str, timeout_s: float = 1.0) -> RemoteIndex:
    up = asyncio.Event()
    line = RemoteIndex(address, timeout_s=timeout_s, on_change=lambda now: up.set() if now else None)
    line.start()
    await asyncio.wait_for(up.wait(), 10)
    return line


async def test_every_workers_lessons_reach_every_worker(tmp_path: Path) -> None:
    async with indexer(tmp_path) as (_, address):
        lines = [await _line(address) for _ in range(2)]
        a, b = (PrefixMemory(None, None, learn=False, remote=line) for line in lines)
        try:
            a.learn("http://e1", SHORT)
            a.flush()
            # Answered on a's connection after its lesson (one connection's messages run in order).
            assert await lines[0].status() is not None
            view = await b.view(LONG)
            assert view is not None and view.matched == {"http://e1": 6} and "http://e1" in view.continuing
            assert b.lookup(LONG, view) == ({"http://e1": 6}, frozenset({"http://e1"}))

            # A lesson of b's own that the indexer had not received when b asked still counts.
            view = await b.view(LONG)
            b.learn("http://e2", LONG)
            b.flush()
            matched, _ = b.lookup(LONG, view)
            assert matched == {"http://e1": 6, "http://e2": 9}

            a.forget("http://e1")                      # an engine left: gone for everyone
            stats = await lines[0].status()
            assert stats is not None and stats.source == "approximate" and stats.engines == 1
            view = await b.view(LONG)
            assert view is not None and view.matched == {"http://e2": 9}
        finally:
            for line in lines:
                await line.aclose()


async def test_every_workers_decisions_count_in_the_pods_shares(tmp_path: Path) -> None:
    """The indexer counts every worker's lessons per engine over the bounded-load window and answers a
    match with the counts; a worker adds its own decisions the indexer had not heard of yet."""
    async with indexer(tmp_path) as (_, address):
        lines = [await _line(address) for _ in range(2)]
        a, b = (PrefixMemory(None, None, learn=False, remote=line) for line in lines)
        try:
            a.learn("http://e1", SHORT, cold=True)
            for _ in range(2):
                a.learn("http://e1", SHORT)
            a.learn("http://e2", LONG)
            a.flush()
            assert await lines[0].status() is not None
            view = await b.view(LONG)
            assert view is not None and view.recent == {"http://e1": 3, "http://e2": 1}
            assert view.founded == {"http://e1": 1}
            b.learn("http://e2", LONG, cold=True)       # after b asked: the indexer's count lacks it
            shares = b.pod_shares(view)
            assert shares is not None and shares.decisions == {"http://e1": 3, "http://e2": 2}
            assert shares.founded == {"http://e1": 1, "http://e2": 1}
            assert b.pod_shares(None) is None           # no answer: the picker counts its own
        finally:
            for line in lines:
                await line.aclose()


async def test_the_pods_shares_forget_decisions_past_the_window() -> None:
    service = IndexService(PrefixIndexSettings(), window_s=0.05)
    await service.handle(Learn("http://e1", SHORT))
    await service.handle(Learn("http://e2", SHORT, cold=True))
    assert service.recent() == ({"http://e1": 1, "http://e2": 1}, {"http://e2": 1})
    await asyncio.sleep(0.1)
    assert service.recent() == ({}, {})


async def test_no_indexer_no_wait(tmp_path: Path) -> None:
    """Nobody listening: a match answers None at once, and the memory falls back to its own lessons."""
    line = RemoteIndex(f"unix:{tmp_path / 'nobody.sock'}", timeout_s=5.0)
    line.start()
    memory = PrefixMemory(None, None, learn=False, remote=line)
    try:
        began = time.monotonic()
        assert await memory.view(LONG) is None
        assert time.monotonic() - began < 1.0 and line.unanswered == 1
        memory.learn("http://e1", SHORT)
        memory.flush()
        assert memory.lookup(LONG, None)[0] == {"http://e1": 6}   # its own recent decisions still count
        assert line.last_error is not None
    finally:
        await line.aclose()


async def test_a_silent_indexer_costs_at_most_the_timeout(tmp_path: Path) -> None:
    """An indexer that accepts but never answers (stalled): the match gives up after ``timeout_s``."""
    path = tmp_path / "silent.sock"

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(-1)

    silent = await asyncio.start_unix_server(hold, path=str(path))
    line = await _line(f"unix:{path}", timeout_s=0.2)
    try:
        began = time.monotonic()
        assert await line.match(LONG) is None
        waited = time.monotonic() - began
        assert 0.2 <= waited < 2.0 and line.unanswered == 1
    finally:
        await line.aclose()
        silent.close()


async def test_the_service_answers_a_match_with_its_id() -> None:
    service = IndexService(PrefixIndexSettings())
    await service.handle(Learn("http://e1", SHORT))
    reply = await service.handle(Match(7, LONG))
    assert isinstance(reply, Matched) and reply.id == 7
    assert [(m.engine, m.blocks, m.continues) for m in reply.engines] == [("http://e1", 6, True)]


async def test_a_feed_stops_only_when_no_worker_wants_it() -> None:
    """Precise source: two workers asked for an engine's feed; one worker's detach (its own admin call,
    a discovery lag) leaves it running for the other. A worker that died sent no detach: its feeds go
    on for its successor, and a later detach stops such an orphan."""
    service = IndexService(PrefixIndexSettings(source="precise"))
    assert service.feeds is not None
    attach = Attach("http://e1:8000", "tcp://127.0.0.1:9", "m", None)   # nobody publishes there: fine
    try:
        await service.handle(attach, "worker-0")
        await service.handle(attach, "worker-1")
        await service.handle(Detach("http://e1:8000"), "worker-0")
        assert "http://e1:8000" in service.feeds.subscribers
        await service.handle(Detach("http://e1:8000"), "worker-1")
        assert "http://e1:8000" not in service.feeds.subscribers

        await service.handle(attach, "worker-2")
        service.gone("worker-2")                          # died without a word
        assert "http://e1:8000" in service.feeds.subscribers
        await service.handle(Detach("http://e1:8000"), "worker-3")
        assert "http://e1:8000" not in service.feeds.subscribers
    finally:
        await service.aclose()


async def test_offloaded_prefixes_reach_the_worker_with_their_tier(tmp_path: Path) -> None:
    """The pod's indexer mirrors an engine's CPU-tier KV events (vLLM's encoding) in its tier index and
    answers a match with them; the worker weighs them with its own ``tiers`` weights."""
    kv = pytest.importorskip("vllm.distributed.kv_events")
    from coordinator.pipeline.scheduling.prefix.kv_events import KvEventMirror

    address = f"unix:{tmp_path / 'indexer.sock'}"
    service = IndexService(PrefixIndexSettings(source="precise"))
    server = IndexServer(service, [address])
    await server.start()
    tokens = list(range(1000, 1144))                              # LONG's 9 blocks
    mirror = KvEventMirror(service.index, "http://e1", "m", 16, tiers=service.memory.tiers)
    engine_hashes = [i.to_bytes(32, "big") for i in range(1, 10)]
    assert mirror.apply_payload(msgspec.msgpack.encode(kv.KVEventBatch(ts=time.time(), events=[
        kv.BlockStored(block_hashes=engine_hashes[:6], parent_block_hash=None, token_ids=tokens[:96],
                       block_size=16, lora_id=None, medium="GPU", lora_name=None),
        kv.BlockStored(block_hashes=engine_hashes, parent_block_hash=None, token_ids=tokens,
                       block_size=16, lora_id=None, medium="CPU", lora_name=None)])))
    line = await _line(address)
    memory = PrefixMemory(None, None, learn=False, remote=line, tier_weights={"CPU": 0.5})
    try:
        view = await memory.view(LONG)
        assert view is not None and view.tiers == {"http://e1": {"CPU": 9}}
        matched, _ = memory.lookup(LONG, view)
        assert matched == {"http://e1": 6}
        assert memory.offloaded(LONG, matched, view) == {"http://e1": 0.5 * 3}
        assert (await line.status()).tier_blocks == {"CPU": 9, "STORAGE": 0}
    finally:
        await line.aclose()
        await server.stop()


async def test_an_ha_pair_answers_from_the_standby_with_everything_it_was_told(tmp_path: Path) -> None:
    """A line with a standby tells both indexers every lesson and feed; with the first one gone, or
    stalled, the standby answers the same match, and nothing goes unanswered."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    async with indexer(tmp_path / "a") as (first, a), indexer(tmp_path / "b") as (_, b):
        changes: list[bool] = []
        line = RemoteIndex(a, timeout_s=0.5, standby=b, on_change=changes.append)
        line.start()
        memory = PrefixMemory(None, None, learn=False, remote=line)
        try:
            for _ in range(200):
                if all(line.lines.values()):
                    break
                await asyncio.sleep(0.05)
            assert line.lines == {a: True, b: True} and changes == [True]
            memory.learn("http://e1", SHORT)
            memory.flush()
            view = await memory.view(LONG)
            assert view is not None and view.matched == {"http://e1": 6} and line.answered_by == a

            await first.stop()   # the first is gone: the standby, told the same lesson, answers
            for _ in range(200):
                if not line.lines[a]:
                    break
                await asyncio.sleep(0.05)
            assert line.up and line.lines == {a: False, b: True} and changes == [True]
            view = await memory.view(LONG)
            assert view is not None and view.matched == {"http://e1": 6} and line.answered_by == b
            assert line.unanswered == 0
            stats = await line.status()
            assert stats is not None and stats.engines == 1
        finally:
            await line.aclose()


async def test_a_stalled_first_indexer_hands_the_next_match_to_the_standby(tmp_path: Path) -> None:
    """The first indexer accepts but never answers: one match waits out the timeout, the next asks
    the standby at once."""
    path = tmp_path / "silent.sock"

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(-1)

    silent = await asyncio.start_unix_server(hold, path=str(path))
    async with indexer(tmp_path) as (_, standby):
        line = RemoteIndex(f"unix:{path}", timeout_s=0.2, standby=standby)
        line.start()
        try:
            for _ in range(200):
                if all(line.lines.values()):
                    break
                await asyncio.sleep(0.05)
            line.learn("http://e1", SHORT)
            assert await line.match(LONG) is None and line.unanswered == 1   # the first one, stalled
            reply = await line.match(LONG)   # asked of the standby, not of the stalled one again
            assert reply is not None and line.answered_by == standby and line.unanswered == 1
        finally:
            await line.aclose()
            silent.close()
