"""The precise prefix-index source: vLLM-encoded KV events → our ``PrefixIndex``.

Payloads are built with vLLM's own event classes, so a change in vLLM's wire format breaks these
tests rather than production.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import socket
import time
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from coordinator.contracts.hashing import block_hashes, chain_seed, media_digest
from coordinator.pipeline.scheduling.prefix.feeds import KvEventSubscriber
from coordinator.pipeline.scheduling.prefix.index import PrefixIndex
from coordinator.pipeline.scheduling.prefix.kv_events import KvEventMirror
from coordinator.pipeline.scheduling.prefix.source import PreciseIndexSource
from coordinator.pipeline.scheduling.prefix.translation import PyTranslation

kv = pytest.importorskip("vllm.distributed.kv_events")

MODEL = "m"
ENGINE = "http://e1:8000"
BS = 16
PROMPT = [20 + (i * 37) % 30000 for i in range(300)]
OTHER = [40 + (i * 11) % 30000 for i in range(300)]
ENC = msgspec.msgpack.Encoder()


def ours(tokens: list[int], salt: str | None = None, model: str = MODEL) -> list[int]:
    return block_hashes(tokens, BS, chain_seed(model, salt))


def eh(tokens: list[int], tag: str = "") -> bytes:
    """A stand-in for vLLM's sha256 block hash (the mirror never recomputes it)."""
    return hashlib.sha256(f"{tag}{tokens}".encode()).digest()


def stored(tokens: list[int], hashes: list[Any], parent: Any = None, block_size: int = BS,
           medium: str | None = "GPU", lora_name: str | None = None,
           extra_keys: list[Any] | None = None, **more: Any) -> Any:
    return kv.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                          block_size=block_size, lora_id=None, medium=medium, lora_name=lora_name,
                          extra_keys=extra_keys, group_idx=0, kv_cache_spec_kind="full_attention", **more)


def removed(hashes: list[Any], medium: str | None = "GPU") -> Any:
    return kv.BlockRemoved(block_hashes=hashes, medium=medium, group_idx=0)


def payload(*events: Any) -> bytes:
    return ENC.encode(kv.KVEventBatch(ts=time.time(), events=list(events)))


def run_of(tokens: list[int], block_size: int, start: int = 0, tag: str = "") -> tuple[list[int], list[bytes]]:
    """Tokens of the full engine blocks from block ``start`` on, and their (fake) engine hashes."""
    n = len(tokens) // block_size
    return (tokens[start * block_size:n * block_size],
            [eh(tokens[:(i + 1) * block_size], tag) for i in range(start, n)])


@pytest.fixture
def index() -> PrefixIndex:
    return PrefixIndex()


@pytest.fixture
def mirror(index: PrefixIndex) -> KvEventMirror:
    return KvEventMirror(index, ENGINE, MODEL, BS)


def test_stored_removed_cleared(index: PrefixIndex, mirror: KvEventMirror) -> None:
    toks, hs = run_of(PROMPT, BS)  # 18 blocks
    assert index.match(ours(PROMPT)) == {}
    assert mirror.apply_payload(payload(stored(toks, hs)))
    assert index.match(ours(PROMPT)) == {ENGINE: 18}
    assert index.match(ours(OTHER)) == {}

    mirror.apply_payload(payload(removed(hs[10:])))  # LRU evicts the tail first
    assert index.match(ours(PROMPT)) == {ENGINE: 10}
    assert mirror.engine_blocks == 10

    mirror.apply_payload(payload(kv.AllBlocksCleared()))
    assert index.match(ours(PROMPT)) == {}
    assert mirror.engine_blocks == 0 and index.blocks(ENGINE) == 0


def test_chained_runs_follow_the_parent(index: PrefixIndex, mirror: KvEventMirror) -> None:
    toks, hs = run_of(PROMPT, BS)
    mirror.apply_payload(payload(stored(toks[:5 * BS], hs[:5])))
    mirror.apply_payload(payload(stored(toks[5 * BS:], hs[5:], parent=hs[4])))
    assert index.match(ours(PROMPT)) == {ENGINE: 18}

    # A branch: shares 3 blocks with PROMPT, then diverges (parent = engine block 3).
    branch = PROMPT[:3 * BS] + OTHER[:5 * BS]
    btoks, bhs = run_of(branch, BS, start=3, tag="b")
    mirror.apply_payload(payload(stored(btoks, bhs, parent=hs[2])))
    assert index.match(ours(branch)) == {ENGINE: 8}
    assert index.match(ours(PROMPT)) == {ENGINE: 18}


def test_cache_salt_separates_tenants(index: PrefixIndex, mirror: KvEventMirror) -> None:
    toks, hs = run_of(PROMPT, BS, tag="salted")
    keys: list[Any] = [("tenant1",)] + [None] * (len(hs) - 1)
    mirror.apply_payload(payload(stored(toks, hs, extra_keys=keys)))
    assert index.match(ours(PROMPT, salt="tenant1")) == {ENGINE: 18}
    assert index.match(ours(PROMPT)) == {}
    assert index.match(ours(PROMPT, salt="tenant2")) == {}


def test_lora_runs_are_seeded_with_the_adapter_name(index: PrefixIndex, mirror: KvEventMirror) -> None:
    toks, hs = run_of(PROMPT, BS, tag="lora")
    keys: list[Any] = [("sql-lora", "tenant1")] + [("sql-lora",)] * (len(hs) - 1)
    mirror.apply_payload(payload(stored(toks, hs, lora_name="sql-lora", extra_keys=keys)))
    assert index.match(ours(PROMPT, salt="tenant1", model="sql-lora")) == {ENGINE: 18}
    assert index.match(ours(PROMPT, salt="tenant1")) == {}
    assert index.match(ours(PROMPT, model="sql-lora")) == {}


def test_engine_blocks_of_128_become_eight_of_ours(index: PrefixIndex, mirror: KvEventMirror) -> None:
    prompt = [20 + (i * 37) % 30000 for i in range(700)]
    toks, hs = run_of(prompt, 128)
    assert len(hs) == 5
    mirror.apply_payload(payload(stored(toks, hs, block_size=128)))
    assert index.match(ours(prompt)) == {ENGINE: 40}
    assert index.blocks(ENGINE) == 40

    mirror.apply_payload(payload(removed([hs[-1]])))
    assert index.match(ours(prompt)) == {ENGINE: 32}
    assert index.blocks(ENGINE) == 32

    # A prompt sharing 300 tokens matches 18 of our blocks (288 tokens), though the engine can only
    # reuse its 2 full blocks (256 tokens): a finer index overclaims by less than one engine block.
    assert index.match(ours(prompt[:300] + OTHER)) == {ENGINE: 18}


def test_block_size_not_a_multiple_is_skipped(index: PrefixIndex, mirror: KvEventMirror) -> None:
    toks, hs = run_of(PROMPT, 24)
    mirror.apply_payload(payload(stored(toks, hs, block_size=24)))
    assert index.blocks(ENGINE) == 0
    assert mirror.stats.unsupported_block_size == 1


def test_unknown_parent_is_skipped_and_counted(index: PrefixIndex, mirror: KvEventMirror) -> None:
    toks, hs = run_of(PROMPT, BS)
    mirror.apply_payload(payload(stored(toks[5 * BS:], hs[5:], parent=hs[4])))
    assert index.blocks(ENGINE) == 0
    assert mirror.stats.unknown_parent == 1
    mirror.apply_payload(payload(removed(hs)))  # removing blocks we never placed is harmless
    assert mirror.stats.blocks_removed == 0


def test_offload_tier_events_are_ignored_without_a_tier_index(index: PrefixIndex,
                                                                mirror: KvEventMirror) -> None:
    toks, hs = run_of(PROMPT, BS)
    mirror.apply_payload(payload(stored(toks, hs, medium="CPU")))
    assert index.blocks(ENGINE) == 0
    mirror.apply_payload(payload(stored(toks, hs, medium=None)))
    assert index.match(ours(PROMPT)) == {ENGINE: 18}
    mirror.apply_payload(payload(removed(hs, medium="CPU")))  # the offload copy left; ours did not
    assert index.match(ours(PROMPT)) == {ENGINE: 18}
    assert mirror.stats.other_medium == 2


def test_offload_tiers_have_indexes_of_their_own(index: PrefixIndex) -> None:
    """vLLM's offloading connector reports a CPU copy of the same engine blocks (same hashes, its own
    parent and tokens): it lands in the CPU tier's index, continues runs the GPU reported, and leaves
    the GPU's index alone when either copy is evicted."""
    cpu, storage = PrefixIndex(), PrefixIndex()
    mirror = KvEventMirror(index, ENGINE, MODEL, BS, tiers={"CPU": cpu, "STORAGE": storage})
    toks, hs = run_of(PROMPT, BS)  # 18 blocks
    mirror.apply_payload(payload(stored(toks[:6 * BS], hs[:6])))                         # GPU: 6
    mirror.apply_payload(payload(stored(toks[:6 * BS], hs[:6], medium="CPU"),              # CPU: 18,
                                 stored(toks[6 * BS:], hs[6:], parent=hs[5], medium="cpu",    # any case,
                                        locality="LOCAL", ownership="tier-1")))  # a secondary tier's fields
    assert index.match(ours(PROMPT)) == {ENGINE: 6}
    assert cpu.match(ours(PROMPT)) == {ENGINE: 18}
    assert storage.match(ours(PROMPT)) == {}
    # A storage run whose parent only the GPU and CPU reported: re-hashed from that parent.
    longer = PROMPT + OTHER[:4 * BS]
    ltoks, lhs = run_of(longer, BS, start=18, tag="l")
    mirror.apply_payload(payload(stored(ltoks, lhs, parent=hs[17], medium="STORAGE")))
    assert storage.match(ours(longer)) == {} and storage.blocks(ENGINE) == 4  # not a leading run there
    assert mirror.stats.tier_blocks_stored == 22 and mirror.stats.blocks_stored == 6

    mirror.apply_payload(payload(removed(hs[3:6])))                # the GPU evicts; the CPU copy stays
    assert index.match(ours(PROMPT)) == {ENGINE: 3}
    assert cpu.match(ours(PROMPT)) == {ENGINE: 18}
    mirror.apply_payload(payload(removed(hs[12:], medium="CPU")))  # the CPU tier evicts its tail
    assert cpu.match(ours(PROMPT)) == {ENGINE: 12}
    assert index.match(ours(PROMPT)) == {ENGINE: 3}

    mirror.apply_payload(payload(kv.AllBlocksCleared()))           # a reset empties every medium
    assert index.blocks(ENGINE) == cpu.blocks(ENGINE) == storage.blocks(ENGINE) == 0


def test_offload_placeholders_without_tokens_are_counted_not_indexed(index: PrefixIndex,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Without ``self_describing_kv_events`` vLLM's offloading connector publishes each chunk's hash
    with no tokens and block size 0: nothing to re-hash, and not a misconfiguration to warn about."""
    cpu = PrefixIndex()
    mirror = KvEventMirror(index, ENGINE, MODEL, BS, tiers={"CPU": cpu})
    mirror.apply_payload(payload(stored([], [eh(PROMPT)], block_size=0, medium="CPU")))
    assert cpu.blocks(ENGINE) == 0 and mirror.stats.no_tokens == 1
    assert mirror.stats.unsupported_block_size == 0 and "block size" not in caplog.text


def mm_keys(n_blocks: int, block_size: int, items: list[tuple[str, int, int]]) -> list[Any]:
    """vLLM's published extra keys: ``(mm_hash, offset - block start)`` in every block an item
    (hash, offset, length) overlaps, in offset order."""
    keys: list[Any] = []
    for b in range(n_blocks):
        start, end = b * block_size, (b + 1) * block_size
        here = tuple((h, off - start) for h, off, length in items if off < end and off + length > start)
        keys.append(here or None)
    return keys


@pytest.mark.parametrize("engine_block", [BS, 4 * BS])
def test_image_blocks_match_the_same_image_only(index: PrefixIndex, engine_block: int) -> None:
    """A prompt with an image (placeholder at 40, 64 tokens) is indexed from the engine's events: the
    render-side hashes of the same prompt with the same image match every block; with another image
    only the blocks before it (the image starts in block 2)."""
    mirror = KvEventMirror(index, ENGINE, MODEL, BS)
    toks, hs = run_of(PROMPT, engine_block)
    image = [("img-a", 40, 64)]
    mirror.apply_payload(payload(stored(toks, hs, block_size=engine_block,
                                        extra_keys=mm_keys(len(hs), engine_block, image))))
    seed = chain_seed(MODEL)
    full = len(toks) // BS
    same = block_hashes(PROMPT, BS, seed, media=[(40, media_digest("img-a"))])
    other = block_hashes(PROMPT, BS, seed, media=[(40, media_digest("img-b"))])
    assert index.match(same) == {ENGINE: full}
    assert index.match(other) == {ENGINE: 2}
    assert index.match(ours(PROMPT)) == {ENGINE: 2}  # the text alone is not the image
    assert mirror.stats.unhashable_blocks == 0


def test_prompt_embeds_blocks_are_not_indexed(index: PrefixIndex, mirror: KvEventMirror) -> None:
    toks, hs = run_of(PROMPT, BS)
    keys: list[Any] = [None, None, (b"embeds-digest",)] + [None] * (len(hs) - 3)
    mirror.apply_payload(payload(stored(toks, hs, extra_keys=keys)))
    assert index.match(ours(PROMPT)) == {ENGINE: 2}
    assert mirror.stats.unhashable_blocks == 16


def test_int_hashes_and_re_reports(index: PrefixIndex, mirror: KvEventMirror) -> None:
    toks, _ = run_of(PROMPT, BS)
    hs = list(range(1000, 1018))
    mirror.apply_payload(payload(stored(toks, hs)))
    mirror.apply_payload(payload(stored(toks, hs)))  # "full" report mode re-sends cache hits
    mirror.apply_payload(payload(removed(hs)))
    assert index.blocks(ENGINE) == 0 and mirror.engine_blocks == 0


def test_shared_hash_of_ours_survives_until_its_last_engine_block_goes(
        index: PrefixIndex, mirror: KvEventMirror) -> None:
    toks, hs = run_of(PROMPT, BS)
    lora_hs = [eh(toks[:i], "lora") for i in range(len(hs))]  # a LoRA run the engine keys apart
    mirror.apply_payload(payload(stored(toks, hs)))
    mirror.apply_payload(payload(stored(toks, lora_hs, lora_name=MODEL, extra_keys=[(MODEL,)] * len(hs))))
    mirror.apply_payload(payload(removed(hs)))
    assert index.match(ours(PROMPT)) == {ENGINE: 18}
    mirror.apply_payload(payload(removed(lora_hs)))
    assert index.match(ours(PROMPT)) == {}


def test_garbage_and_unknown_events(index: PrefixIndex, mirror: KvEventMirror) -> None:
    assert not mirror.apply_payload(b"\xff\x00 not msgpack")
    assert not mirror.apply_payload(ENC.encode({"ts": 1}))
    assert mirror.stats.bad_payloads == 2

    toks, hs = run_of(PROMPT, BS)
    good = msgspec.msgpack.decode(ENC.encode(stored(toks, hs)))
    good["some_future_field"] = [1, 2]
    batch = [time.time(), [{"type": "BlockMoved", "x": 1}, {"type": "BlockStored"}, good], 0]
    assert mirror.apply_payload(ENC.encode(batch))
    assert index.match(ours(PROMPT)) == {ENGINE: 18}


def test_sequence_gaps_and_publisher_restarts(index: PrefixIndex, mirror: KvEventMirror) -> None:
    sub = KvEventSubscriber("tcp://127.0.0.1:1", mirror)
    toks, hs = run_of(PROMPT, BS)

    def msg(seq: int, *events: Any) -> list[bytes]:
        return [b"kv", seq.to_bytes(8, "big"), payload(*events)]

    sub.handle(msg(4, stored(toks, hs)))
    sub.handle(msg(5))
    sub.handle(msg(9))
    assert (sub.gaps, sub.missed, sub.last_seq) == (1, 3, 9)
    assert index.match(ours(PROMPT)) == {ENGINE: 18}  # kept: stale beats blind

    sub.handle(msg(0))  # a restarted engine starts over at 0 with an empty cache
    assert sub.restarts == 1 and index.blocks(ENGINE) == 0

    sub.handle([b"kv", b"short"])
    sub.handle([b"kv", b"12345678", b"\xc1garbage"])
    assert sub.bad_frames == 1 and mirror.stats.bad_payloads == 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_for(cond: Any, publish: Any = None, within: float = 5.0) -> bool:
    """Poll ``cond``; republish meanwhile, because a fresh SUB misses what was sent before it joined."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if cond():
            return True
        if publish is not None:
            await publish()
        await asyncio.sleep(0.02)
    return bool(cond())


READERS = pytest.mark.parametrize("reader", ["zmtp", "libzmq"])
"""Every feed test runs with our own ZMTP reader (the default) and with libzmq's SUB socket."""


@READERS
async def test_zmq_round_trip(reader: str) -> None:
    index = PrefixIndex()
    ctx = zmq.asyncio.Context()
    port = free_port()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://*:{port}")
    source = PreciseIndexSource(index, lambda url: MODEL, BS, topic="kv", context=ctx, reader=reader)
    seq = 0
    toks, hs = run_of(PROMPT, BS)

    async def send(*events: Any, topic: bytes = b"kv") -> None:
        nonlocal seq
        await pub.send_multipart([topic, seq.to_bytes(8, "big"), payload(*events)])
        seq += topic == b"kv"

    try:
        sub = await source.attach(ENGINE, f"tcp://*:{port}")  # our own config may copy the bind address
        assert sub.endpoint == f"tcp://e1:{port}"
        await source.detach(ENGINE)
        sub = await source.attach(ENGINE, f"tcp://127.0.0.1:{port}")
        assert await source.attach(ENGINE, f"tcp://127.0.0.1:{port}") is sub
        assert sub.own_reader == (reader == "zmtp")

        assert await wait_for(lambda: index.match(ours(PROMPT)) == {ENGINE: 18}, lambda: send(stored(toks, hs)))
        await send(stored(toks, hs), topic=b"other")  # another topic: filtered by the SUB socket
        await send(removed(hs[9:]))
        assert await wait_for(lambda: index.match(ours(PROMPT)) == {ENGINE: 9})
        assert sub.gaps == 0

        # Malformed messages (four frames, then two) are counted and skipped; the feed goes on.
        await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload(removed(hs)), b"extra"])
        await pub.send_multipart([b"kv", seq.to_bytes(8, "big")])
        assert await wait_for(lambda: index.match(ours(PROMPT)) == {ENGINE: 4}, lambda: send(removed(hs[4:])))
        assert sub.bad_frames >= 2

        await source.stop_all()
        assert index.blocks(ENGINE) == 0 and not sub.running and source.subscribers == {}
    finally:
        await source.stop_all()
        pub.close(linger=0)
        ctx.term()


@READERS
async def test_missed_batches_are_replayed_from_vllms_replay_socket(reader: str) -> None:
    """vLLM's own publisher (PUB + ROUTER replay buffer): batches published while the subscriber was
    away are fetched from the replay socket before the next live batch is applied, so the index ends
    up exactly as if nothing had been missed."""
    index = PrefixIndex()
    port, replay_port = free_port(), free_port()
    publisher = kv.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}",
                                     topic="kv")
    ctx = zmq.asyncio.Context()
    mirror = KvEventMirror(index, ENGINE, MODEL, BS)
    sub = KvEventSubscriber(f"tcp://127.0.0.1:{port}", mirror, "kv", context=ctx,
                            replay_endpoint=f"tcp://127.0.0.1:{replay_port}", reader=reader)
    a_toks, a_hs = run_of(PROMPT, BS)
    b_toks, b_hs = run_of(OTHER, BS)
    try:
        sub.start()

        async def publish_empty() -> None:  # a fresh SUB misses what was sent before it joined
            publisher.publish(kv.KVEventBatch(ts=time.time(), events=[]))

        assert await wait_for(lambda: sub.last_seq is not None, publish_empty)
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=[stored(a_toks, a_hs)]))
        assert await wait_for(lambda: index.match(ours(PROMPT)) == {ENGINE: 18})
        seen = sub.last_seq
        assert seen is not None
        await sub.stop_quietly()                            # away: the next two batches are missed
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=[stored(b_toks, b_hs)]))
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=[removed(a_hs[9:])]))
        await asyncio.sleep(0.2)
        sub.start()
        await asyncio.sleep(0.3)                            # let the SUB socket join again

        assert await wait_for(lambda: (sub.last_seq or 0) >= seen + 3, publish_empty)
        assert sub.replayed == 2 and sub.gaps == 0
        assert index.match(ours(OTHER)) == {ENGINE: 18}    # stored while away, replayed
        assert index.match(ours(PROMPT)) == {ENGINE: 9}    # removed while away, replayed
    finally:
        await sub.stop()
        publisher.shutdown()
        ctx.term()


def test_the_native_translation_holds_exactly_what_the_python_form_holds() -> None:
    """The mirror's translation table in C (``_mirror.c``) against ``PyTranslation`` on one random
    history: runs stored at 1 and 8 of our blocks per engine block in two KV cache groups, blocks
    reported again, hashes of ours shared by several engine blocks (hybrid groups, LoRA runs under the
    base name), removals of known and unknown blocks, clears. After every step both map the same
    engine blocks to the same hashes and depths, count the same engine blocks per hash, free the same
    hashes on removal and find the same parents."""
    from coordinator.pipeline.scheduling.prefix import kv_events as module

    assert module.NATIVE_MIRROR, "the _mirror extension was not built (is a C compiler installed?)"
    c, py = module._Translation(), PyTranslation()
    assert type(c) is not type(py)
    rng = random.Random(5)
    pool = [rng.randrange(-(2**63), 2**63) for _ in range(60)]   # few hashes of ours: many shared
    known: list[int] = []
    for step in range(1500):
        roll = rng.random()
        group = rng.choice([0, 0, 1])
        if roll < 0.5:
            per = rng.choice([1, 8])
            n = rng.randrange(1, 6)
            engine_hashes = [rng.choice(known) if known and rng.random() < 0.2 else rng.randrange(2**64)
                             for _ in range(n)]
            ours = [rng.choice(pool) if rng.random() < 0.3 else rng.randrange(-(2**63), 2**63)
                    for _ in range(n * per)]
            start = rng.randrange(0, 10_000)
            known += engine_hashes
            for t in (c, py):
                t.store(group, engine_hashes, ours, per, start)
        elif roll < 0.95:
            gone = [*rng.sample(known, min(len(known), rng.randrange(6))), rng.randrange(2**64)]
            (found_c, freed_c), (found_py, freed_py) = c.remove(group, gone), py.remove(group, iter(gone))
            assert found_c == found_py and set(freed_c) == set(freed_py), step
        else:
            c.clear()
            py.clear()
        assert c.state() == py.state() and len(c) == len(py), step
        probe = rng.choice(known) if known else 0
        assert c.parent(group, probe) == py.parent(group, probe), step
    assert len(c) > 0 and any(n > 1 for n in c.state()[1].values())


def test_the_native_translation_keys_sha256_hashes_by_their_low_64_bits() -> None:
    """vLLM publishes sha256 bytes when its int hashes are off: a run continuing such a parent finds it."""
    from coordinator.pipeline.scheduling.prefix import kv_events as module

    t = module._Translation()
    digest = bytes(range(32))
    t.store(0, [digest], [11, 12], 2, 0)
    assert t.parent(0, digest) == (12, 2) and t.parent(1, digest) is None
    assert t.remove(0, [bytes(32)]) == (0, []) and t.remove(0, [digest]) == (1, [11, 12]) and len(t) == 0


def test_the_batch_path_applies_exactly_what_the_event_path_applies() -> None:
    """``apply_payload``'s one C call per batch (``Translation.apply_batch``: vLLM's msgpack read in
    place) against the msgspec decode and event-by-event apply it replaces, on one random history of
    published batches: root and continued runs at 1 and 2 of our blocks per engine block, unknown
    parents, re-reported blocks, partial tails, more or fewer hashes than full blocks, empty runs, removals of
    known and unknown blocks, clears, two KV cache groups, vLLM's optional fields, an index trimmed by
    its capacity, offload tiers (their own indexes and translations, parents found across media, a
    medium named in lower case, one no tier keeps); and batches the C reader must decline untouched
    (LoRA, a medium that is not ASCII, extra keys,
    bytes or negative hashes, a block size that is not a multiple of ours, an unknown field or event,
    truncated or trailing bytes, garbage); evictions as vLLM sends them, one BlockRemoved per block
    (applied in one pass where they follow each other in one medium and group). After every batch both hold the same index (LRU order and
    times, owners, leaves), the same translation and the same counters."""
    from dataclasses import replace

    from coordinator.pipeline.scheduling.prefix import kv_events as module

    assert module.NATIVE_MIRROR, "the _mirror extension was not built (is a C compiler installed?)"
    clock = iter(range(1, 10**6))
    now = [0.0]

    def tick() -> float:
        return now[0]

    def mirror_with_tiers() -> tuple[KvEventMirror, list[PrefixIndex]]:
        indexes = [PrefixIndex(capacity_blocks=40, clock=tick), PrefixIndex(clock=tick),
                   PrefixIndex(capacity_blocks=30, clock=tick)]
        return KvEventMirror(indexes[0], ENGINE, MODEL, BS,
                             tiers={"CPU": indexes[1], "STORAGE": indexes[2]}), indexes

    (direct, direct_ixs), (ref, ref_ixs) = mirror_with_tiers(), mirror_with_tiers()
    direct_ix = direct_ixs[0]
    assert direct._direct is not None
    ref._direct = None
    rng = random.Random(17)
    known: list[int] = []
    tokens_pool = [rng.randrange(50_000) for _ in range(4096)]
    peak = 0

    def run(bs: int) -> dict[str, Any]:
        blocks = rng.randrange(0, 5)
        at = rng.randrange(0, 3000)
        tokens = tokens_pool[at:at + blocks * bs + rng.choice([0, 0, 0, 5])]   # sometimes a partial tail
        hashes = [rng.choice(known) if known and rng.random() < 0.15 else rng.randrange(2**64)
                  for _ in range(max(0, blocks + rng.choice([-1, 0, 0, 1])))]
        known.extend(hashes)
        parent = None if rng.random() < 0.3 else (
            rng.choice(known) if known and rng.random() < 0.85 else rng.randrange(2**64))
        event: dict[str, Any] = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                                 "token_ids": tokens, "block_size": bs, "lora_id": None,
                                 "medium": rng.choice(["GPU", "GPU", "GPU", None, "CPU", "cpu", "STORAGE",
                                                       "disk"]), "lora_name": None}
        for key, value in (("group_idx", rng.choice([0, 1, None])), ("kv_cache_spec_kind", "full_attention"),
                           ("extra_keys", [None] * len(hashes)),
                           ("kv_cache_spec_sliding_window", None), ("locality", "local"),
                           ("session_id", None)):
            if rng.random() < 0.4:
                event[key] = value
        return event

    def gone() -> dict[str, Any]:
        hashes = [*rng.sample(known, min(len(known), rng.randrange(5))), rng.randrange(2**64)]
        event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": hashes,
                                 "medium": rng.choice(["GPU", "GPU", "GPU", None, "CPU", "STORAGE", "disk"])}
        if rng.random() < 0.5:
            event["group_idx"] = rng.choice([0, 1])
        return event

    declined = [
        lambda e: e.update(lora_name="adapter", lora_id=3), lambda e: e.update(medium="CPÜ"),
        lambda e: e.update(extra_keys=[["img", 0]] * len(e["block_hashes"])),
        lambda e: e.update(extra_keys=[None, "salt"]),
        lambda e: e.update(block_hashes=[h.to_bytes(8, "big") for h in e["block_hashes"]]),
        lambda e: e.update(parent_block_hash=-5), lambda e: e.update(block_size=24),
        lambda e: e.update(surprise=1), lambda e: e.update(type="BlockMoved"),
    ]
    for step in range(1500):
        now[0] = float(next(clock))
        roll = rng.random()
        events: list[dict[str, Any]] = []
        for _ in range(rng.randrange(1, 4)):
            events.append(run(rng.choice([BS, BS, 2 * BS])) if rng.random() < 0.6 else gone())
        if rng.random() < 0.3:   # an eviction as vLLM sends it: one BlockRemoved per block, mostly alike
            medium, group = rng.choice(["GPU", "GPU", "CPU", None]), rng.choice([0, 0, 1])
            recent = known[-40:]   # mostly still held
            for h in [*rng.sample(recent, min(len(recent), rng.randrange(2, 7))), rng.randrange(2**64)]:
                evicted = {"type": "BlockRemoved", "block_hashes": [h], "group_idx": group,
                           "medium": medium if rng.random() < 0.8 else rng.choice(["CPU", "STORAGE", "GPU"])}
                if rng.random() < 0.1:
                    evicted["group_idx"] = 1 - group
                if rng.random() < 0.2 and known:   # now and then two blocks in one
                    evicted["block_hashes"] = [h, rng.choice(recent)]
                events.append(evicted)
        if roll < 0.03:
            events.append({"type": "AllBlocksCleared"})
        elif roll < 0.15:
            rng.choice(declined)(events[0])
        body = ENC.encode([time.time(), events, rng.choice([None, 0])][:rng.choice([2, 3])])
        if 0.15 <= roll < 0.18:
            body = rng.choice([body[:-3], body + b"\x00", b"\xc1garbage"])
        direct.apply_payload(body)
        ref.apply_payload(body)
        assert [ix.state() for ix in direct_ixs] == [ix.state() for ix in ref_ixs], step
        assert ([at.trans.state() for at in direct._all]   # type: ignore[union-attr]
                == [at.trans.state() for at in ref._all]), step
        assert replace(direct.stats, direct_batches=0) == ref.stats, step
        peak = max(peak, direct_ix.blocks(ENGINE))
    s = direct.stats
    assert ref.stats.direct_batches == 0 and 1500 * 0.7 < s.direct_batches < 1500 * 0.9, s
    assert s.blocks_stored and s.blocks_removed and s.clears and s.unknown_parent and s.bad_payloads, s
    assert s.unsupported_block_size and s.other_medium and s.tier_blocks_stored and s.no_tokens, s
    assert peak == 40   # the capacity trimmed it


@pytest.mark.parametrize(("reader", "gathered"), [("libzmq", False), ("zmtp", False), ("zmtp", True)])
async def test_the_native_drain_ends_where_the_python_receive_ends(reader: str, gathered: bool) -> None:
    """Two subscribers on one publisher, one receiving in C (``_mirror.drain``: libzmq's frames read
    and applied in place, or ``_mirror.Feed.drain``: our reader's bytes parsed and applied in place;
    Python handed whatever is not the next common batch) and one receiving in Python: after a stream of ordinary batches (offload tiers included), a batch only Python decodes,
    messages of four and of two frames, garbage, a sequence gap and a publisher restart, both hold the
    same indexes and translations and count the same gaps, restarts and bad messages. ``gathered``:
    both in one ``Gatherer``, whose sweep drains the C one's feed for it (``_mirror.sweep``) and hands
    its Python drain only what the sweep stopped at."""
    from dataclasses import replace

    from coordinator.pipeline.scheduling.prefix import libzmq_receive
    from coordinator.pipeline.scheduling.prefix.gather import Gatherer

    assert libzmq_receive.NATIVE_DRAIN, "the native drain is off (no _mirror extension, or libzmq not found)"
    ctx = zmq.asyncio.Context()
    port = free_port()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    gatherer = Gatherer(asyncio.get_running_loop(), 0.005) if gathered else None

    def subscriber(native: bool) -> tuple[KvEventSubscriber, list[PrefixIndex]]:
        indexes = [PrefixIndex(capacity_blocks=80), PrefixIndex(), PrefixIndex()]
        mirror = KvEventMirror(indexes[0], ENGINE, MODEL, BS, tiers={"CPU": indexes[1], "STORAGE": indexes[2]})
        sub = KvEventSubscriber(f"tcp://127.0.0.1:{port}", mirror, "kv", context=ctx, reader=reader,
                                gatherer=gatherer)
        sub.native_drain = native
        return sub, indexes

    (c_sub, c_ix), (py_sub, py_ix) = subscriber(True), subscriber(False)
    assert c_sub.native_drain and not py_sub.native_drain
    python_drains = 0
    drain = c_sub._drain

    def counted() -> None:
        nonlocal python_drains
        python_drains += 1
        drain()

    c_sub._drain = counted  # type: ignore[method-assign]
    rng = random.Random(23)
    known: list[int] = []
    seq = 0

    async def send(*frames: bytes) -> None:
        await pub.send_multipart(list(frames))

    def batch() -> bytes:
        events: list[Any] = []
        for _ in range(rng.randrange(1, 4)):
            medium = rng.choice(["GPU", "GPU", "CPU", "STORAGE"])
            if rng.random() < 0.6 or not known:
                at = rng.randrange(0, 200)
                hashes = [rng.randrange(2**64) for _ in range(rng.randrange(1, 5))]
                parent = rng.choice(known) if known and rng.random() < 0.7 else None
                known.extend(hashes)
                events.append(kv.BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                             token_ids=PROMPT[at:at + len(hashes) * BS], block_size=BS,
                                             lora_id=None, medium=medium, lora_name=None))
            else:
                events.append(kv.BlockRemoved(block_hashes=rng.sample(known, min(3, len(known))), medium=medium))
        return payload(*events)

    async def ordinary(n: int) -> None:
        nonlocal seq
        for _ in range(n):
            await send(b"kv", seq.to_bytes(8, "big"), batch())
            seq += 1

    try:
        c_sub.start()
        py_sub.start()

        async def hello() -> None:   # fresh SUB sockets miss what was sent before they joined
            nonlocal seq
            await send(b"kv", seq.to_bytes(8, "big"), payload())
            seq += 1

        assert await wait_for(lambda: c_sub.last_seq is not None and py_sub.last_seq is not None, hello)
        await hello()
        await ordinary(80)
        assert await wait_for(lambda: c_sub.last_seq == seq - 1)   # the burst is in (past one drain's budget)
        await asyncio.sleep(0.05)
        before = python_drains
        for _ in range(20):   # one plain batch per sweep: the sweep applies it, no Python drain runs
            await ordinary(1)
            await asyncio.sleep(0.02)
        spaced = python_drains - before
        await send(b"kv", seq.to_bytes(8, "big"), payload(stored(PROMPT[:64], [1, 2, 3, 4], lora_name="a")))
        seq += 1
        await ordinary(10)
        await send(b"kv", seq.to_bytes(8, "big"), payload(removed([1])), b"extra")   # four frames
        await ordinary(5)
        await send(b"kv", seq.to_bytes(8, "big"))                                 # two frames
        await ordinary(10)
        await send(b"kv", seq.to_bytes(8, "big"), b"\xc1 not msgpack")
        seq += 4                                                                   # three batches lost
        await ordinary(10)
        seq = 0                                                                    # the publisher restarted
        await ordinary(40)
        final = seq - 1
        assert await wait_for(lambda: c_sub.last_seq == final and py_sub.last_seq == final, within=10.0)
        def shape(ix: PrefixIndex) -> Any:   # the state without last-use times (each took its own clock)
            lru, owners, leaves, shared = ix.state()
            return {e: [h for h, _ in blocks] for e, blocks in lru.items()}, owners, leaves, shared

        assert [shape(ix) for ix in c_ix] == [shape(ix) for ix in py_ix]
        assert ([at.trans.state() for at in c_sub.mirror._all]   # type: ignore[union-attr]
                == [at.trans.state() for at in py_sub.mirror._all])
        ignore = {"batches": 0, "direct_batches": 0}
        assert replace(c_sub.mirror.stats, **ignore) == replace(py_sub.mirror.stats, **ignore)
        counters = ("gaps", "missed", "restarts", "bad_frames", "duplicates")
        assert [getattr(c_sub, k) for k in counters] == [getattr(py_sub, k) for k in counters]
        assert c_sub.gaps >= 1 and c_sub.restarts == 1 and c_sub.bad_frames >= 2
        s = c_sub.mirror.stats
        assert s.bad_payloads >= 1 and s.tier_blocks_stored and s.blocks_removed
        assert s.direct_batches >= 100 and py_sub.mirror.stats.direct_batches >= 100   # Python's path: one call
        assert c_ix[0].blocks(ENGINE) > 0
        if gathered:   # the sweep drained the plain batches in C; Python saw what it stopped at
            assert gatherer is not None and gatherer.sweeps >= 20 and spaced == 0
        else:
            assert spaced >= 20
    finally:
        await c_sub.stop()
        await py_sub.stop()
        if gatherer is not None:
            gatherer.close()
        pub.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(("reader", "gathered"), [("libzmq", False), ("zmtp", False), ("zmtp", True)])
async def test_a_failing_native_drain_falls_back_to_the_python_receive(reader: str, gathered: bool,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """If the C drain raises (out of memory, a libzmq error), the feed logs it, receives in Python from
    then on, and the batches keep reaching the index; in the gathered sweep too, where the exception
    is met for all the feeds in one C call and raised to the feed's own drain."""
    from coordinator.pipeline.scheduling.prefix import libzmq_receive
    from coordinator.pipeline.scheduling.prefix.gather import Gatherer

    assert libzmq_receive.NATIVE_DRAIN
    ctx = zmq.asyncio.Context()
    port = free_port()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    index = PrefixIndex()
    gatherer = Gatherer(asyncio.get_running_loop(), 0.01, index.now) if gathered else None
    sub = KvEventSubscriber(f"tcp://127.0.0.1:{port}", KvEventMirror(index, ENGINE, MODEL, BS), "kv", context=ctx,
                            reader=reader, gatherer=gatherer)
    assert sub.native_drain

    def broken(*args: Any) -> Any:
        raise MemoryError("no room")

    seq = 0

    async def send(*events: Any) -> None:
        nonlocal seq
        await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload(*events)])
        seq += 1

    toks, hs = run_of(PROMPT, BS)
    try:
        sub.start()
        assert await wait_for(lambda: sub.last_seq is not None, send)
        if sub._feed is not None:   # our reader's feed: its drain in C meets a buffer it cannot use
            sub._feed.buffer = None
        else:
            sub.mirror.drain = broken  # type: ignore[method-assign]
        await send(stored(toks, hs))
        assert await wait_for(lambda: index.match(ours(PROMPT)) == {ENGINE: 18})
        assert not sub.native_drain and sub.gaps == 0
        assert "the native drain failed" in caplog.text
        if gatherer is not None:
            assert gatherer.sweeps > 0
    finally:
        if gatherer is not None:
            gatherer.close()
        await sub.stop()
        pub.close(linger=0)
        ctx.term()


@READERS
async def test_gathered_feeds_apply_every_batch_with_one_wake_up_per_interval(reader: str) -> None:
    """With ``gather_s`` the feeds share one ``Gatherer``: the first batch wakes it, the next sweep
    drains every feed with news. Eight engines' batches all reach the index, in far fewer sweeps than
    batches (sent a few milliseconds apart, each would wake a feed of its own); a detached feed is no longer drained; ``stop_all`` closes the gatherer."""
    from coordinator.pipeline.scheduling.prefix.gather import Gatherer

    assert Gatherer.available()
    index = PrefixIndex()
    ctx = zmq.asyncio.Context()
    pubs, engines = [], [f"http://e{i}:8000" for i in range(8)]
    source = PreciseIndexSource(index, lambda url: MODEL, BS, topic="kv", context=ctx, gather_s=0.1,
                                reader=reader)
    seqs = [0] * len(engines)

    async def send(i: int, *events: Any) -> None:
        await pubs[i].send_multipart([b"kv", seqs[i].to_bytes(8, "big"), payload(*events)])
        seqs[i] += 1

    async def hello() -> None:   # fresh SUB sockets miss what was sent before they joined
        for i in range(len(engines)):
            await send(i)

    try:
        for engine in engines:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            port = pub.bind_to_random_port("tcp://127.0.0.1")
            pubs.append(pub)
            await source.attach(engine, f"tcp://127.0.0.1:{port}")
        gatherer = source.gatherer
        assert gatherer is not None and all(s._gatherer is gatherer for s in source.subscribers.values())
        assert await wait_for(lambda: all(s.last_seq is not None for s in source.subscribers.values()), hello)
        toks, hs = run_of(PROMPT, BS)
        sweeps, sent = gatherer.sweeps, 0
        for k in range(0, len(hs), 2):   # each engine stores the prompt two blocks a batch
            for i in range(len(engines)):
                await send(i, stored(toks[k * BS:(k + 2) * BS], hs[k:k + 2], parent=hs[k - 1] if k else None))
                sent += 1
                await asyncio.sleep(0.002)
        assert await wait_for(lambda: index.match(ours(PROMPT)) == dict.fromkeys(engines, len(hs)))
        assert gatherer.sweeps - sweeps < sent / 4, (gatherer.sweeps - sweeps, sent)
        assert all(s.gaps == 0 for s in source.subscribers.values())

        await source.detach(engines[0])   # its blocks are forgotten; what it sends is not applied
        await send(0, stored(toks[:BS], hs[:1]))
        await send(1, removed(hs[4:]))
        assert await wait_for(lambda: index.match(ours(PROMPT)) == {engines[1]: 4}
                              | dict.fromkeys(engines[2:], len(hs)))
        await source.stop_all()
        assert source.gatherer is None and index.blocks(engines[1]) == 0
    finally:
        await source.stop_all()
        for pub in pubs:
            pub.close(linger=0)
        ctx.term()
