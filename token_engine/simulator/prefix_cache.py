"""A tiny model of vLLM's automatic prefix cache.

Why it exists: cache-aware scheduling only pays off if engines get cheaper on repeated prefixes, so the
simulator needs a cache whose hits shorten prefill and show up in `/metrics` (and in KV events) like
vLLM's do.

Like vLLM, only full blocks are cached; each block's hash chains its parent's hash (so a block only hits
if the whole prefix before it matches), the first block is salted with `cache_salt`, eviction is LRU, and
at least one prompt token is always recomputed (a fully cached, block-aligned prompt gives back its last
block). Like vLLM's free-block queue, a request's blocks are queued for eviction tail first, so a parent
is never evicted before its children and the cache never holds unreachable blocks. It models a hash
table, not physical block allocation.

With ``offload_blocks`` it also models vLLM's OffloadingConnector to CPU memory with
``self_describing_kv_events``: every block the engine computes is stored to a CPU tier too (its own
LRU of ``offload_blocks``), published as ``BlockStored``/``BlockRemoved`` with ``medium: "CPU"`` and
the same block hashes, tokens and parents as the GPU's events. A prompt's run that continues past the
GPU's hit in the CPU tier is loaded back rather than recomputed (``lookup`` counts it as cached,
``last_loaded`` says how much of it came from the tier, as vLLM counts an external hit).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.contracts.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    external_hash,
)

BlockHash = bytes
EventSink = Callable[[list[KVEvent]], None]
MediaItem = tuple[str, int, int]
"""An image of the prompt: its hash (render's ``mm_hashes``), placeholder offset and length."""


def media_items(features: dict[str, Any] | None) -> list[MediaItem]:
    """A GenerateRequest's ``features`` as media items, by offset (vLLM sorts them so too)."""
    if not features:
        return []
    hashes = features.get("mm_hashes") or {}
    items = [(str(h), int(p["offset"]), int(p["length"]))
             for modality, ranges in (features.get("mm_placeholders") or {}).items()
             for p, h in zip(ranges, hashes.get(modality) or (), strict=False)]
    return sorted(items, key=lambda item: item[1])


def media_keys(media: Sequence[MediaItem], start: int, end: int) -> list[tuple[str, int]]:
    """vLLM's media extra keys of the block ``[start, end)``: ``(hash, offset - start)`` of every item
    overlapping it (negative in the blocks an item continues into)."""
    return [(h, off - start) for h, off, length in media if off < end and off + length > start]


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None,
                 lora: str | None = None, media: Sequence[MediaItem] = ()) -> list[BlockHash]:
    """Chained hashes of the prompt's full blocks (a partial trailing block is never cached). A LoRA
    run's blocks are its own (vLLM puts the adapter in every block's extra keys), and so are the
    blocks an image overlaps (its hash and offset are in their keys: the same placeholder tokens with
    another image are other blocks)."""
    hashes: list[BlockHash] = []
    parent = b"" if salt is None else hashlib.sha256(salt.encode("utf-8")).digest()
    if lora is not None:
        parent = hashlib.sha256(parent + b"lora:" + lora.encode("utf-8")).digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.sha256(parent)
        digest.update(b",".join(str(t).encode("ascii") for t in block))
        for h, rel in media_keys(media, start, start + block_size) if media else ():
            digest.update(f"|mm:{h}:{rel}".encode())
        parent = digest.digest()
        hashes.append(parent)
    return hashes


@dataclass
class PrefixCacheStats:
    """Token-level counters with vLLM's meaning: queries = prompt tokens looked up, hits = tokens found."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0
    offload_hits: int = 0        # prompt tokens loaded back from the CPU tier
    offload_evictions: int = 0   # blocks the CPU tier dropped


class PrefixCache:
    """LRU set of chained block hashes with hit/query accounting and optional vLLM KV events.

    `on_events` receives the events of one operation (one vLLM scheduler step's worth) as a list:
    `BlockStored` for the newly cached run of blocks, one `BlockRemoved` per evicted block,
    `AllBlocksCleared` on `clear()`. `int_event_hashes` mirrors `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`.
    """

    def __init__(
        self,
        block_size: int,
        capacity_blocks: int,
        enabled: bool = True,
        *,
        on_events: EventSink | None = None,
        int_event_hashes: bool = True,
        offload_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.enabled = enabled
        self.on_events = on_events
        self.int_event_hashes = int_event_hashes
        self.offload_blocks = offload_blocks
        self.stats = PrefixCacheStats()
        self.last_loaded = 0  # tokens of the last ``lookup`` that came from the CPU tier
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()
        self._offloaded: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    @property
    def offloaded_len(self) -> int:
        """Blocks the CPU tier holds."""
        return len(self._offloaded)

    def _touch(self, hashes: Sequence[BlockHash], blocks: OrderedDict[BlockHash, None] | None = None) -> None:
        """Most recently used, tail block first: the tail is evicted before its parents."""
        blocks = self._blocks if blocks is None else blocks
        for h in reversed(hashes):
            blocks[h] = None
            blocks.move_to_end(h)

    def lookup(self, token_ids: Sequence[int], salt: str | None = None, *, record: bool = True,
               lora: str | None = None, media: Sequence[MediaItem] = ()) -> int:
        """Number of leading prompt tokens served from cache; counts a query when `record`."""
        cached = loaded = 0
        if self.enabled:
            hit: list[BlockHash] = []
            hashes = block_hashes(token_ids, self.block_size, salt, lora, media)
            for h in hashes:
                if h not in self._blocks:
                    break
                hit.append(h)
            self._touch(hit)
            # The offloading connector looks up what follows the GPU's hit in its tier.
            more = list(itertools.takewhile(self._offloaded.__contains__, hashes[len(hit):]))
            self._touch(more, self._offloaded)
            cached = len(hit) * self.block_size
            loaded = len(more) * self.block_size
            # vLLM always recomputes at least the last prompt token to get logits.
            if cached + loaded >= len(token_ids):
                if loaded:
                    loaded -= self.block_size
                else:
                    cached = max(0, cached - self.block_size)
        self.last_loaded = loaded
        if record:
            self.stats.queries += len(token_ids)
            self.stats.hits += cached
            self.stats.offload_hits += loaded
        return cached + loaded

    def insert(self, token_ids: Sequence[int], salt: str | None = None,
               lora: tuple[str, int] | None = None, media: Sequence[MediaItem] = ()) -> None:
        """Mark the prompt's full blocks cached (most recently used); evict the oldest beyond capacity."""
        if not self.enabled:
            return
        hashes = block_hashes(token_ids, self.block_size, salt, lora[0] if lora else None, media)
        first_new, evicted = self._store(self._blocks, hashes, self.capacity_blocks)
        self.stats.evictions += len(evicted)
        events: list[KVEvent] = []
        if self.on_events is not None:
            new = set(hashes[first_new:])
            events += [self._removed(h) for h in evicted if h not in new]
            if first_new < len(hashes):
                events.append(self._stored(hashes, first_new, token_ids, salt, lora, media))
            events.extend(self._removed(h) for h in evicted if h in new)
        if self.offload_blocks:  # the offloading connector stores every computed block to its tier too
            first_new, evicted = self._store(self._offloaded, hashes, self.offload_blocks)
            self.stats.offload_evictions += len(evicted)
            if self.on_events is not None and first_new < len(hashes):
                events.append(self._stored(hashes, first_new, token_ids, salt, lora, media,
                                           medium=MEDIUM_CPU))
            if self.on_events is not None and evicted:
                events.append(BlockRemoved(block_hashes=[self._ext(h) for h in evicted], medium=MEDIUM_CPU,
                                           group_idx=0))
        if self.on_events is not None:
            self.on_events(events)

    def _store(self, blocks: OrderedDict[BlockHash, None], hashes: list[BlockHash],
               capacity: int) -> tuple[int, list[BlockHash]]:
        """Put a prompt's chain in ``blocks`` (the GPU's cache or the CPU tier, both LRUs): where its new
        blocks start (a suffix: blocks are chained and parents outlive children) and what left past
        ``capacity``."""
        first_new = next((i for i, h in enumerate(hashes) if h not in blocks), len(hashes))
        self._touch(hashes, blocks)
        evicted: list[BlockHash] = []
        while len(blocks) > capacity:
            evicted.append(blocks.popitem(last=False)[0])
        return first_new, evicted

    def clear(self) -> None:
        """Drop every cached block (vLLM's `reset_prefix_cache`, the CPU tier's too); counters are kept."""
        self._blocks.clear()
        self._offloaded.clear()
        if self.on_events is not None and self.enabled:
            self.on_events([AllBlocksCleared()])

    @property
    def usage(self) -> float:
        """Fraction of the block capacity holding cached prefixes."""
        return len(self._blocks) / self.capacity_blocks

    # ------------------------------------------------------------------ events

    def _ext(self, h: BlockHash) -> Any:
        return external_hash(h, self.int_event_hashes)

    def _stored(
        self, hashes: list[BlockHash], first: int, token_ids: Sequence[int], salt: str | None,
        lora: tuple[str, int] | None = None, media: Sequence[MediaItem] = (), medium: str = MEDIUM_GPU,
    ) -> BlockStored:
        """vLLM's `cache_full_blocks` event: the new run, its parent, its tokens, per-block extra keys
        untagged in vLLM's order (a LoRA run's adapter name on every block, then ``(mm_hash, offset)``
        of each image the block overlaps, then the cache_salt on block 0 only; None where a block has
        none), and the adapter's name and id."""
        bs = self.block_size

        def keys(i: int) -> tuple[Any, ...] | None:
            found = (((lora[0],) if lora else ()) + tuple(media_keys(media, i * bs, (i + 1) * bs))
                     + ((salt,) if i == 0 and salt else ()))
            return found or None

        return BlockStored(
            block_hashes=[self._ext(h) for h in hashes[first:]],
            parent_block_hash=self._ext(hashes[first - 1]) if first > 0 else None,
            token_ids=list(token_ids[first * bs : len(hashes) * bs]),
            block_size=bs,
            lora_id=lora[1] if lora else None,
            medium=medium,
            lora_name=lora[0] if lora else None,
            extra_keys=[keys(i) for i in range(first, len(hashes))],
            group_idx=0,
        )

    def _removed(self, h: BlockHash) -> BlockRemoved:
        return BlockRemoved(block_hashes=[self._ext(h)], medium=MEDIUM_GPU, group_idx=0)
