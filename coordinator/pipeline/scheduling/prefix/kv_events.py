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

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from coordinator.contracts.hashing import PURE_PYTHON, BlockHash, block_hashes, chain_seed, media_digest
from coordinator.contracts.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    KVEventBatch,
)
from coordinator.pipeline.scheduling.prefix.index import PrefixIndex
from coordinator.pipeline.scheduling.prefix.translation import PyTranslation

try:  # the translation table in C (``_mirror.c``); else ``translation.PyTranslation``
    if PURE_PYTHON:
        raise ImportError("LLMC_PURE_PYTHON=1")
    from coordinator.pipeline.scheduling.prefix import _mirror as _native
except ImportError:
    _native = None  # type: ignore[assignment]

NATIVE_MIRROR = _native is not None
"""Whether mirrors keep their translation tables in C (``_mirror.c``)."""


def sweep(ready: list[tuple[int, int]], feeds: dict[int, Any], now: float) -> list[int]:
    """Drain in one C call every ready feed of ``feeds`` (``_mirror.Feed`` by descriptor) that is live;
    the descriptors Python must drain itself (``_mirror.sweep``). Needs ``_mirror``: feeds exist only
    with it (``KvEventMirror.stream_feed``)."""
    assert _native is not None
    return _native.sweep(ready, feeds, now)


def bind_libzmq(addresses: Sequence[int]) -> bool:
    """Give ``KvEventMirror.drain`` libzmq's functions (``libzmq_receive`` finds them); False without
    ``_mirror``."""
    if _native is None:
        return False
    _native.bind_zmq(*addresses)
    return True

log = logging.getLogger(__name__)

PRIMARY_MEDIA: frozenset[str | None] = frozenset({None, "GPU"})
"""Media that mean "the engine's own KV cache". vLLM's ``BlockPool`` reports ``"GPU"`` for its primary
pool on every platform, the CPU build included (its KV lives in host memory but the label stays);
``"CPU"``/``"cpu"``/``"STORAGE"`` come from offloading tiers, whose blocks must be loaded back before
reuse and whose events would otherwise mirror blocks that already left the primary cache. Those go to
a tier's own index, when one is given (``KvEventMirror``'s ``tiers``)."""


def tier_name(medium: str | None) -> str:
    """An offload tier's key in ``scheduling.prefix.tiers``: vLLM says ``"CPU"``/``"STORAGE"``, some
    connectors lower case."""
    return (medium or "").upper()


# --- decoding (the wire types are the shared contract's) ---------------------------------------------

class RawEventBatch(msgspec.Struct, array_like=True, gc=False):
    """``KVEventBatch`` with its events left undecoded, so one unknown event does not sink the batch."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _Tagged(msgspec.Struct):
    type: Any = None


_whole_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_batch_decoder = msgspec.msgpack.Decoder(RawEventBatch)
_event_decoder = msgspec.msgpack.Decoder(KVEvent)
_tag_decoder = msgspec.msgpack.Decoder(_Tagged)


def decode_batch(payload: bytes) -> list[KVEvent]:
    """Raises ``msgspec.DecodeError``/``ValidationError`` for a bad batch; bad events are logged, dropped.

    A batch is decoded whole first (one call: the intake decodes thousands a second); only a batch
    that fails so is taken apart event by event, so that one unknown event does not sink the rest."""
    try:
        return _whole_decoder.decode(payload).events
    except msgspec.MsgspecError:
        pass
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
    return events


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
    other_medium: int = 0            # events from a medium that is neither primary nor a kept tier
    tier_blocks_stored: int = 0      # engine blocks placed in an offload tier's index
    no_tokens: int = 0               # stored runs without token ids (an offload tier's placeholders)
    unhashable_blocks: int = 0       # blocks not indexed: multimodal / prompt-embeds keys we cannot hash
    engine_block_size: int | None = None  # the block size of the last BlockStored (128 on vLLM CPU)
    direct_batches: int = 0          # of ``batches``, applied in one C call (``apply_payload``)


_Translation = PyTranslation if _native is None else _native.Translation


class _Medium:
    """One medium's blocks of one engine: where they are indexed, and the translation its removals
    need (``KvEventMirror``)."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.trans = _Translation()

    def clear(self, engine: str) -> None:
        self.trans.clear()
        self.index.clear(engine)


class KvEventMirror:
    """One engine's KV events → ``index`` entries under ``engine``, in our hash space.

    A ``BlockStored`` run is placed after its parent's last hash of ours (or at the chain seed of
    ``model``/``lora_name`` + the cache salt for a root run) and re-hashed at our ``block_size``: an
    engine block of 128 tokens becomes 8 of our 16-token blocks, all recorded for its removal.

    Events of an offload tier (``medium`` CPU or STORAGE, vLLM's offloading connectors) go to that
    tier's index in ``tiers`` (keyed by ``tier_name``), or are counted and dropped when it has none.
    An engine hash names the same tokens in every medium, so a tier's run may continue a parent the
    primary cache reported, and the other way round.

    The per-block work is in C (``_mirror.c``, the index's ``_index.c``) or C-level passes over whole
    runs, no Python bytecode per block: at 256 engines the intake is tens of thousands of blocks a
    second (docs/scheduling.md, "The pod's KV index"). A hash of ours leaves the index only with the
    last engine block that maps to it (``translation.PyTranslation``).
    """

    def __init__(self, index: PrefixIndex, engine: str, model: str, block_size: int, *,
                 media: Iterable[str | None] = PRIMARY_MEDIA,
                 tiers: Mapping[str, PrefixIndex] | None = None) -> None:
        self.index = index
        self.engine = engine
        self.model = model
        self.block_size = block_size
        self.media = frozenset(media)
        self._stats = MirrorStats()
        self._feeds: list[_native.Feed] = []   # our reader's feeds, whose drains count in C
        self._primary = _Medium(index)
        self._tiers = {name: _Medium(ix) for name, ix in (tiers or {}).items()}
        self._all = [self._primary, *self._tiers.values()]
        self._root = chain_seed(model)
        self._direct = self._direct_media()

    def _direct_media(self) -> tuple[_native.Medium, ...] | None:
        """What ``_mirror.apply_batch`` writes a batch to, when every medium's index takes direct writes
        (native, no TTL) and the primary media are vLLM's labels; else None: batches take Python."""
        if not NATIVE_MIRROR or self.media != PRIMARY_MEDIA:
            return None
        media: list[_native.Medium] = []
        for name, at in [(None, self._primary), *self._tiers.items()]:
            writes = at.index.direct_writes()
            if writes is None:
                return None
            media.append((name, at.trans, *writes))
        return tuple(media)

    @property
    def stats(self) -> MirrorStats:
        """What the mirror did, with what its feeds' drains in C applied since the last look."""
        for feed in self._feeds:
            batches, counts = feed.take_counts()
            if batches:
                self._count_direct(batches, counts)
        return self._stats

    @property
    def engine_blocks(self) -> int:
        return len(self._primary.trans)

    def apply_payload(self, payload: bytes) -> bool:
        """Decode one published payload and apply it; ``False`` (logged, counted) if it is garbage.

        The common batch (no LoRA or media; vLLM's int hashes; any medium) is read and applied by
        ``_mirror.c`` in one call when the indexes are native; any other batch, or one that call
        declines (it changes nothing then), is decoded here and applied event by event: the
        reference."""
        if self._direct is not None:
            done = _native.apply_batch(payload, self._direct, self.engine, self.block_size, self._root,
                                       self.index.now())
            if done is not None:
                self._count_direct(1, done)
                return True
        try:
            events = decode_batch(payload)
        except (msgspec.MsgspecError, TypeError, ValueError) as exc:
            self.stats.bad_payloads += 1
            log.warning("KV events from %s: undecodable payload (%d bytes): %s",
                        self.engine, len(payload), exc)
            return False
        self.stats.batches += 1
        self.apply(events)
        return True

    @property
    def drains(self) -> bool:
        """Whether ``drain`` can receive for this mirror (its batches go to C: ``_direct_media``)."""
        return self._direct is not None

    def drain(self, socket: int, last_seq: int, max_messages: int) -> tuple[int, list[bytes] | None, bool]:
        """Receive and apply, in C (``_mirror.drain``), the messages waiting on the libzmq socket
        ``socket`` that continue ``last_seq`` and are the common batch. Returns the last sequence number
        applied, the message it stopped at (received, not applied: the caller handles it) and whether
        more are waiting."""
        assert self._direct is not None
        last, applied, counts, held, more = _native.drain(socket, last_seq, max_messages, self._direct,
                                                          self.engine, self.block_size, self._root,
                                                          self.index.now())
        if applied:
            self._count_direct(applied, counts)
        return last, held, more

    def stream_feed(self, max_messages: int) -> _native.Feed:
        """A feed for our ZMTP reader whose messages are taken, parsed and applied in C
        (``_mirror.Feed``, drained alone or in the gathered sweep, ``_mirror.sweep``), at most
        ``max_messages`` a drain; what its drains apply counts in ``stats``."""
        assert self._direct is not None
        feed = _native.Feed(self._direct, self.engine, self.block_size, self._root, max_messages)
        self._feeds.append(feed)
        return feed

    def _count_direct(self, batches: int, counts: tuple[int, int, int, int, int, int, int, int]) -> None:
        stats = self._stats
        stored, tier_stored, removed, clears, unknown, no_tokens, other, engine_block_size = counts
        stats.batches += batches
        stats.direct_batches += batches
        stats.blocks_stored += stored
        stats.tier_blocks_stored += tier_stored
        stats.blocks_removed += removed
        stats.clears += clears
        stats.unknown_parent += unknown
        stats.no_tokens += no_tokens
        stats.other_medium += other
        if engine_block_size >= 0:
            stats.engine_block_size = engine_block_size

    def apply(self, events: Sequence[KVEvent]) -> None:
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.stats.clears += 1
                self.reset()
            else:
                at = self._primary if ev.medium in self.media else self._tiers.get(tier_name(ev.medium))
                if at is None:
                    self.stats.other_medium += 1
                elif isinstance(ev, BlockStored):
                    self._stored(ev, at)
                else:
                    self._removed(ev, at)

    def reset(self) -> None:
        """The engine's cache is gone (``AllBlocksCleared``, restart) or we stop listening. vLLM's
        ``AllBlocksCleared`` carries no medium and a reset clears the offload tiers too, so all go."""
        for at in self._all:
            at.clear(self.engine)

    def _parent(self, group: int, parent: ExternalBlockHash, at: _Medium) -> tuple[BlockHash, int] | None:
        """The parent's last hash of ours and depth: from the run's own medium, else from any other
        (same hashes)."""
        found = at.trans.parent(group, parent)
        if found is None:
            for other in self._all:
                if other is not at and (found := other.trans.parent(group, parent)) is not None:
                    break
        return found

    def _stored(self, ev: BlockStored, at: _Medium) -> None:
        group = ev.group_idx or 0
        if not ev.token_ids:  # an offload tier's placeholder (not self-describing): nothing to hash
            self.stats.no_tokens += 1
            return
        if at is self._primary:
            self.stats.engine_block_size = ev.block_size
        if ev.block_size <= 0 or ev.block_size % self.block_size:
            self.stats.unsupported_block_size += 1
            _warn_once(f"bs:{self.engine}:{ev.block_size}",
                       "KV events from %s: block size %d is not a multiple of the index block size %d; "
                       "set scheduling.prefix.block_size to a divisor of it", self.engine, ev.block_size,
                       self.block_size)
            return
        if ev.parent_block_hash is not None:
            parent = self._parent(group, ev.parent_block_hash, at)
            if parent is None:
                # Missed event, or a partial-tail entry whose parent sits inside an engine block.
                self.stats.unknown_parent += 1
                return
            seed, start = parent
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
        engine_hashes = ev.block_hashes[:n] if len(ev.block_hashes) > n else ev.block_hashes
        at.trans.store(group, engine_hashes, ours, ev.block_size // self.block_size, start)
        if at is self._primary:
            self.stats.blocks_stored += n
        else:
            self.stats.tier_blocks_stored += n
        # All of them, not only new ones: refreshes entries someone else (a registry clear) dropped.
        at.index.add(self.engine, ours, parent=seed if ev.parent_block_hash is not None else None)

    def _removed(self, ev: BlockRemoved, at: _Medium) -> None:
        found, gone = at.trans.remove(ev.group_idx or 0, ev.block_hashes)
        if found and at is self._primary:
            self.stats.blocks_removed += found
        if gone:
            at.index.remove(self.engine, gone)


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
