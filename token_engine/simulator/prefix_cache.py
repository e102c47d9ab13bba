"""A tiny model of vLLM's automatic prefix cache.

Why it exists: cache-aware scheduling only pays off if engines get cheaper on repeated prefixes, so the
simulator needs a cache whose hits shorten prefill and show up in `/metrics` like vLLM's do.

Like vLLM, only full blocks are cached; each block's hash chains its parent's hash (so a block only hits
if the whole prefix before it matches), the first block is salted with `cache_salt`, eviction is LRU, and
at least one prompt token is always recomputed (a fully cached, block-aligned prompt gives back its last
block). It models a hash table, not physical block allocation.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[BlockHash]:
    """Chained hashes of the prompt's full blocks (a partial trailing block is never cached)."""
    hashes: list[BlockHash] = []
    parent = b"" if salt is None else hashlib.sha256(salt.encode("utf-8")).digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.sha256(parent)
        digest.update(b",".join(str(t).encode("ascii") for t in block))
        parent = digest.digest()
        hashes.append(parent)
    return hashes


@dataclass
class PrefixCacheStats:
    """Token-level counters with vLLM's meaning: queries = prompt tokens looked up, hits = tokens found."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0


class PrefixCache:
    """LRU set of chained block hashes with hit/query accounting."""

    def __init__(self, block_size: int, capacity_blocks: int, enabled: bool = True) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.enabled = enabled
        self.stats = PrefixCacheStats()
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, token_ids: Sequence[int], salt: str | None = None, *, record: bool = True) -> int:
        """Number of leading prompt tokens served from cache; counts a query when `record`."""
        cached = 0
        if self.enabled:
            for h in block_hashes(token_ids, self.block_size, salt):
                if h not in self._blocks:
                    break
                self._blocks.move_to_end(h)
                cached += self.block_size
            # vLLM always recomputes at least the last prompt token to get logits.
            if cached >= len(token_ids):
                cached = max(0, cached - self.block_size)
        if record:
            self.stats.queries += len(token_ids)
            self.stats.hits += cached
        return cached

    def insert(self, token_ids: Sequence[int], salt: str | None = None) -> None:
        """Mark the prompt's full blocks cached (most recently used); evict the oldest beyond capacity."""
        if not self.enabled:
            return
        for h in block_hashes(token_ids, self.block_size, salt):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
            self.stats.evictions += 1

    def clear(self) -> None:
        """Drop every cached block (vLLM's `reset_prefix_cache`); counters are kept."""
        self._blocks.clear()

    @property
    def usage(self) -> float:
        """Fraction of the block capacity holding cached prefixes."""
        return len(self._blocks) / self.capacity_blocks
