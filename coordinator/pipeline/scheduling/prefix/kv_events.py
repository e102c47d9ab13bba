"""Precise prefix-index source: mirror vLLM's KV cache events into the ``PrefixIndex``.

An engine started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557"}'`` binds a ZMQ PUB socket and sends one multipart message per scheduler
step: ``[topic, seq (8-byte big-endian), msgpack(KVEventBatch)]``. We connect a SUB socket to it,
decode the batch and translate the engine's block hashes into ours.

Why translate instead of indexing the engine's hashes: vLLM's hashes depend on its build, hash
function and ``PYTHONHASHSEED``, and the coordinator must score a prompt without vLLM. Every
``BlockStored`` carries its token ids, so we re-hash them with :mod:`.hashing` and keep a map
engine hash → our hashes, which ``BlockRemoved`` (hashes only) needs.

The wire types are the contract's (``coordinator.contracts.kv_events``, vLLM 0.32's structs, which
the simulator publishes too): the batch is ``array_like`` (``[ts, events, data_parallel_rank]``),
each event a map tagged by its class name under ``"type"``. Unknown fields are ignored and unknown
event types are skipped, so newer engines keep working.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from coordinator.contracts.hashing import BlockHash, block_hashes, chain_seed, media_digest
from coordinator.contracts.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
)
from coordinator.pipeline.scheduling.prefix.index import PrefixIndex

log = logging.getLogger(__name__)

PRIMARY_MEDIA: frozenset[str | None] = frozenset({None, "GPU"})
"""Media that mean "the engine's own KV cache". vLLM's ``BlockPool`` reports ``"GPU"`` for its primary
pool on every platform, the CPU build included (its KV lives in host memory but the label stays);
``"CPU"``/``"cpu"``/``"STORAGE"`` come from offloading tiers, whose blocks must be loaded back before
reuse and whose events would otherwise mirror blocks that already left the primary cache."""


# --- decoding (the wire types are the shared contract's) ---------------------------------------------

class RawEventBatch(msgspec.Struct, array_like=True, gc=False):
    """``KVEventBatch`` with its events left undecoded, so one unknown event does not sink the batch."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _Tagged(msgspec.Struct):
    type: Any = None


_batch_decoder = msgspec.msgpack.Decoder(RawEventBatch)
_event_decoder = msgspec.msgpack.Decoder(KVEvent)
_tag_decoder = msgspec.msgpack.Decoder(_Tagged)


def decode_batch(payload: bytes) -> tuple[RawEventBatch, list[KVEvent]]:
    """Raises ``msgspec.DecodeError``/``ValidationError`` for a bad batch; bad events are logged, dropped."""
    batch = _batch_decoder.decode(payload)
    events: list[KVEvent] = []
    for raw in batch.events:
        try:
            events.append(_event_decoder.decode(raw))
        except msgspec.MsgspecError as exc:
            try:
                kind = _tag_decoder.decode(raw).type
            except msgspec.MsgspecError:
                kind = None
            _warn_once(f"skip:{kind!r}", "skipping undecodable KV event (type %r): %s", kind, exc)
    return batch, events


_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


# --- translation ---------------------------------------------------------------------------------

@dataclass
class MirrorStats:
    batches: int = 0
    bad_payloads: int = 0
    blocks_stored: int = 0           # engine blocks placed in the index
    blocks_removed: int = 0          # engine blocks taken out
    clears: int = 0
    unknown_parent: int = 0          # runs skipped: their parent was never seen (missed event, partial tail)
    unsupported_block_size: int = 0  # runs skipped: event block size is not a multiple of ours
    other_medium: int = 0            # events from an offload tier, ignored
    unhashable_blocks: int = 0       # blocks not indexed: multimodal / prompt-embeds keys we cannot hash
    engine_block_size: int | None = None  # the block size of the last BlockStored (128 on vLLM CPU)


_Key = tuple[int, ExternalBlockHash]  # (KV cache group, engine block hash)


class KvEventMirror:
    """One engine's KV events → ``index`` entries under ``engine``, in our hash space.

    A ``BlockStored`` run is placed after its parent's last hash of ours (or at the chain seed of
    ``model``/``lora_name`` + the cache salt for a root run) and re-hashed at our ``block_size``: an
    engine block of 128 tokens becomes 8 of our 16-token blocks, all recorded for its removal.
    Our hashes are reference-counted because two engine blocks can map to the same one of ours (KV
    cache groups of a hybrid model share hashes; a LoRA run under the base model's name).
    """

    def __init__(self, index: PrefixIndex, engine: str, model: str, block_size: int, *,
                 media: Iterable[str | None] = PRIMARY_MEDIA) -> None:
        self.index = index
        self.engine = engine
        self.model = model
        self.block_size = block_size
        self.media = frozenset(media)
        self.stats = MirrorStats()
        # engine block → (our hashes of it, our blocks from the prompt's start through it: the depth a
        # run continuing it starts at, which the chain's hash needs)
        self._ours: dict[_Key, tuple[list[BlockHash], int]] = {}
        self._refs: dict[BlockHash, int] = {}

    @property
    def engine_blocks(self) -> int:
        return len(self._ours)

    def apply_payload(self, payload: bytes) -> bool:
        """Decode one published payload and apply it; ``False`` (logged, counted) if it is garbage."""
        try:
            _, events = decode_batch(payload)
        except (msgspec.MsgspecError, TypeError, ValueError) as exc:
            self.stats.bad_payloads += 1
            log.warning("KV events from %s: undecodable payload (%d bytes): %s",
                        self.engine, len(payload), exc)
            return False
        self.stats.batches += 1
        self.apply(events)
        return True

    def apply(self, events: Sequence[KVEvent]) -> None:
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.stats.clears += 1
                self.reset()
            elif ev.medium not in self.media:
                self.stats.other_medium += 1
            elif isinstance(ev, BlockStored):
                self._stored(ev)
            else:
                self._removed(ev)

    def reset(self) -> None:
        """The engine's cache is gone (``AllBlocksCleared``, restart) or we stop listening."""
        self._ours.clear()
        self._refs.clear()
        self.index.clear(self.engine)

    def _stored(self, ev: BlockStored) -> None:
        group = ev.group_idx or 0
        self.stats.engine_block_size = ev.block_size
        if ev.block_size <= 0 or ev.block_size % self.block_size:
            self.stats.unsupported_block_size += 1
            _warn_once(f"bs:{self.engine}:{ev.block_size}",
                       "KV events from %s: block size %d is not a multiple of the index block size %d; "
                       "set scheduling.prefix.block_size to a divisor of it", self.engine, ev.block_size,
                       self.block_size)
            return
        if ev.parent_block_hash is not None:
            parent = self._ours.get((group, ev.parent_block_hash))
            if parent is None or not parent[0]:
                # Missed event, or a partial-tail entry whose parent sits inside an engine block.
                self.stats.unknown_parent += 1
                return
            seed, start = parent[0][-1], parent[1]
        else:
            first = ev.extra_keys[0] if ev.extra_keys else None
            seed, start = chain_seed(ev.lora_name or self.model, _cache_salt(first, ev.lora_name)), 0
        n = min(len(ev.block_hashes), len(ev.token_ids) // ev.block_size)
        media: list[tuple[int, int]] = []
        if ev.extra_keys:
            hashable = next((i for i, keys in enumerate(ev.extra_keys[:n]) if _opaque(keys)), n)
            self.stats.unhashable_blocks += n - hashable
            n = hashable
            media = _media(ev.extra_keys[:n], ev.block_size)
        if n == 0:
            return
        ours = block_hashes(ev.token_ids[:n * ev.block_size], self.block_size, seed, start, media)
        per = ev.block_size // self.block_size
        for i, eh in enumerate(ev.block_hashes[:n]):
            key = (group, eh)
            old = self._ours.get(key)
            if old is not None:  # re-reported (cache hit in "full" report mode): nothing new
                self._release(old[0])
            new = ours[i * per:(i + 1) * per]
            self._ours[key] = (new, start + (i + 1) * per)
            for h in new:
                self._refs[h] = self._refs.get(h, 0) + 1
        self.stats.blocks_stored += n
        # All of them, not only new refs: refreshes entries someone else (a registry clear) dropped.
        self.index.add(self.engine, ours, parent=seed if ev.parent_block_hash is not None else None)

    def _removed(self, ev: BlockRemoved) -> None:
        group = ev.group_idx or 0
        gone: list[BlockHash] = []
        for eh in ev.block_hashes:
            entry = self._ours.pop((group, eh), None)
            if entry is not None:
                self.stats.blocks_removed += 1
                gone += self._release(entry[0])
        if gone:
            self.index.remove(self.engine, gone)

    def _release(self, ours: list[BlockHash]) -> list[BlockHash]:
        """Drop one reference per hash; returns the hashes no engine block maps to any more."""
        free: list[BlockHash] = []
        for h in ours:
            left = self._refs.get(h, 0) - 1
            if left > 0:
                self._refs[h] = left
            else:
                self._refs.pop(h, None)
                free.append(h)
        return free


def _cache_salt(keys: Sequence[Any] | None, lora_name: str | None) -> str | None:
    """vLLM publishes a block's extra keys untagged, in order: LoRA name, ``[mm_id, offset]`` pairs,
    cache_salt (first block only), embeds digest (bytes). So the salt is the one string that is not
    the LoRA name."""
    strings = [k for k in keys or () if isinstance(k, str)]
    if lora_name is not None and strings and strings[0] == lora_name:
        strings = strings[1:]
    return strings[0] if strings else None


def _opaque(keys: Sequence[Any] | None) -> bool:
    """Prompt-embeds keys (bytes, or anything else we do not know): the engine's hash covers content
    that our hash cannot see, so indexing it would report matches that are not there."""
    return any(isinstance(k, bytes) or (isinstance(k, (list, tuple)) and _media_key(k) is None)
               for k in keys or ())


def _media_key(key: Sequence[Any]) -> tuple[str, int] | None:
    """``[mm_hash, offset in the block]``, vLLM's published form of a media item in a block."""
    if len(key) == 2 and isinstance(key[0], str) and isinstance(key[1], int):
        return key[0], key[1]
    return None


def _media(keys: Sequence[Sequence[Any] | None], block_size: int) -> list[tuple[int, int]]:
    """The items starting in these engine blocks (``hashing.Media``, offsets in the event's tokens); an
    item's key in the blocks it continues into has a negative offset and adds nothing (the chain
    carries it)."""
    out = []
    for i, block_keys in enumerate(keys):
        for k in block_keys or ():
            mk = _media_key(k) if isinstance(k, (list, tuple)) else None
            if mk is not None and mk[1] >= 0:
                out.append((i * block_size + mk[1], media_digest(mk[0])))
    return out


# --- ZMQ subscriber ------------------------------------------------------------------------------

class KvEventSubscriber:
    """SUB socket on one engine's publisher, applying every batch to ``mirror``.

    vLLM's ``tcp://*:PORT`` endpoint binds, so we connect (ZMQ reconnects by itself if the engine
    restarts). Sequence numbers are checked: a gap means lost batches, which are fetched from the
    engine's ``replay_endpoint`` (vLLM's ROUTER socket: send the first missing sequence number, get
    the buffered batches and an end marker) when one is configured; otherwise, or if the replay comes
    back short, the gap is logged and counted and the index may hold stale blocks or miss some until
    they are evicted or re-stored. A sequence that goes backwards means the publisher restarted, so
    the engine's cache is empty and we reset the mirror.
    """

    END_SEQ = (-1).to_bytes(8, "big", signed=True)
    REPLAY_TIMEOUT_S = 2.0
    BATCH_S = 0.002  # the most one engine's batches hold the gate (and the event loop) at a time

    def __init__(self, endpoint: str, mirror: KvEventMirror, topic: str = "", *,
                 context: zmq.asyncio.Context | None = None, replay_endpoint: str | None = None,
                 gate: asyncio.Lock | None = None) -> None:
        """``gate``: shared by every engine's subscriber (``PreciseIndexSource``), so that only one
        applies events at a time."""
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.replayed = 0
        self.mirror = mirror
        self.topic = topic
        self.last_seq: int | None = None
        self.gaps = 0
        self.missed = 0
        self.restarts = 0
        self.bad_frames = 0
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._gate = gate if gate is not None else asyncio.Lock()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Connect and start receiving; needs a running event loop."""
        if self._task is not None:
            return
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sock.connect(self.endpoint)
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(
            self._run(sock), name=f"kv-events {self.mirror.engine}")

    async def stop(self) -> None:
        """Stop receiving and forget this engine's blocks (nothing keeps them current any more)."""
        await self.stop_quietly()
        self.mirror.reset()

    async def stop_quietly(self) -> None:
        """Disconnect but keep the mirror and the sequence position (a later ``start`` resumes, and
        replays what it missed)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def _run(self, sock: zmq.asyncio.Socket) -> None:
        """Receive, then apply under the shared gate: one engine's batches at a time, as many as are
        waiting for up to ``BATCH_S``. With hundreds of engines publishing, a decision then waits for
        at most one such batch, not for every engine's message of this loop turn."""
        held: list[bytes] | None = None
        while True:
            frames = held if held is not None else await sock.recv_multipart()
            held = None
            await self._replay_before(frames)
            async with self._gate:
                deadline = time.perf_counter() + self.BATCH_S
                self._apply(frames)
                while time.perf_counter() < deadline and cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN:
                    frames = await sock.recv_multipart()  # ready: completes without waiting
                    if self._gap_to_replay(frames):
                        held = frames  # replayed outside the gate first
                        break
                    self._apply(frames)

    def _gap_to_replay(self, frames: Sequence[bytes]) -> bool:
        last = self.last_seq
        return (self.replay_endpoint is not None and last is not None and len(frames) == 3
                and len(frames[1]) == 8 and int.from_bytes(frames[1], "big") > last + 1)

    async def _replay_before(self, frames: Sequence[bytes]) -> None:
        if self._gap_to_replay(frames):
            assert self.last_seq is not None
            try:
                await self.replay(self.last_seq + 1, int.from_bytes(frames[1], "big"))
            except Exception:  # a failed replay leaves the gap for ``handle`` to count
                log.exception("KV events from %s: replay failed", self.mirror.engine)

    def _apply(self, frames: Sequence[bytes]) -> None:
        try:
            self.handle(frames)
        except Exception:  # one bad batch must not end the subscription
            log.exception("KV events from %s: failed to apply a batch", self.mirror.engine)

    async def replay(self, first: int, stop: int) -> int:
        """Fetch batches ``first`` … ``stop - 1`` from the engine's replay socket and apply them in
        order; returns how many were applied (a short replay leaves a gap for ``handle`` to count)."""
        assert self.replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        applied = 0
        try:
            await sock.send_multipart([b"", first.to_bytes(8, "big")])
            while True:
                async with asyncio.timeout(self.REPLAY_TIMEOUT_S):
                    frames = await sock.recv_multipart()
                body = frames[1:] if frames and frames[0] == b"" else frames
                if len(body) != 3 or body[1] == self.END_SEQ:
                    break
                seq = int.from_bytes(body[1], "big")
                if self.last_seq is not None and seq == self.last_seq + 1 and seq < stop:
                    self.handle(body)
                    applied += 1
        except TimeoutError:
            log.warning("KV events from %s: replay from %s timed out", self.mirror.engine,
                        self.replay_endpoint)
        finally:
            sock.close(linger=0)
        self.replayed += applied
        return applied

    def handle(self, frames: Sequence[bytes]) -> None:
        """One multipart message ``[topic, seq, payload]``."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.bad_frames += 1
            log.warning("KV events from %s: ignoring a message of %d frames", self.mirror.engine, len(frames))
            return
        seq = int.from_bytes(frames[1], "big")
        last = self.last_seq
        if last is not None and seq != last + 1:
            if seq <= last:
                self.restarts += 1
                log.warning("KV events from %s: sequence went back %d → %d; publisher restarted, "
                            "resetting its blocks", self.mirror.engine, last, seq)
                self.mirror.reset()
            else:
                self.gaps += 1
                self.missed += seq - last - 1
                log.warning("KV events from %s: missed %d batches (%d → %d); the prefix index may be "
                            "stale for this engine", self.mirror.engine, seq - last - 1, last, seq)
        self.last_seq = seq
        self.mirror.apply_payload(frames[2])


# --- one subscriber per engine -------------------------------------------------------------------

class PreciseIndexSource:
    """Keeps one ``KvEventSubscriber`` per engine that publishes KV events (``EngineSettings.kv_events``).

    The index key is the engine URL, as for the approximate source. ``model_of`` names an engine's
    model when ``attach`` is not told (it seeds the hash chain, so it must be the name requests use).
    """

    def __init__(self, index: PrefixIndex, model_of: Callable[[str], str], block_size: int, *,
                 topic: str = "", context: zmq.asyncio.Context | None = None) -> None:
        self.index = index
        self.model_of = model_of
        self.block_size = block_size
        self.topic = topic
        self._ctx = context
        self.subscribers: dict[str, KvEventSubscriber] = {}
        self.gate = asyncio.Lock()  # one intake at a time over all engines (see KvEventSubscriber._run)

    async def attach(self, engine_url: str, endpoint: str, model: str | None = None,
                     replay: str | None = None) -> KvEventSubscriber:
        """Idempotent for the same endpoints and model; a changed one replaces the subscriber."""
        endpoint = connect_endpoint(endpoint, engine_url)
        replay = connect_endpoint(replay, engine_url) if replay else None
        model = model or self.model_of(engine_url)
        sub = self.subscribers.get(engine_url)
        if sub is not None:
            if sub.endpoint == endpoint and sub.mirror.model == model and sub.replay_endpoint == replay:
                return sub
            await self.detach(engine_url)
        mirror = KvEventMirror(self.index, engine_url, model, self.block_size)
        sub = KvEventSubscriber(endpoint, mirror, self.topic, context=self._ctx, replay_endpoint=replay,
                                gate=self.gate)
        sub.start()
        self.subscribers[engine_url] = sub
        log.info("precise prefix index: %s ← KV events at %s", engine_url, endpoint)
        return sub

    async def detach(self, engine_url: str) -> None:
        sub = self.subscribers.pop(engine_url, None)
        if sub is not None:
            await sub.stop()

    async def stop_all(self) -> None:
        for url in list(self.subscribers):
            await self.detach(url)


def connect_endpoint(endpoint: str, engine_url: str) -> str:
    """``tcp://*:5557`` / ``tcp://0.0.0.0:5557`` (the engine's own bind address, often copied into our
    config) cannot be connected to: use the engine URL's host instead."""
    parts = urlsplit(endpoint)
    if parts.scheme == "tcp" and parts.hostname in ("*", "0.0.0.0", "::") and parts.port is not None:
        host = urlsplit(engine_url).hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"tcp://{host}:{parts.port}"
    return endpoint
