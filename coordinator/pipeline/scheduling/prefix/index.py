"""Which engine holds which prompt blocks.

One structure serves both sources: the approximate source adds the blocks of every prompt it routes
(bounded per engine by an LRU capacity and a TTL, because it never learns about evictions); the
precise source mirrors the engines' own KV events (unbounded, evictions arrive as events).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from coordinator.pipeline.scheduling.prefix.hashing import BlockHash


class PrefixIndex:
    def __init__(self, *, capacity_blocks: int | None = None, ttl_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._capacity = capacity_blocks
        self._ttl = ttl_s
        self._clock = clock
        self._owners: dict[BlockHash, set[str]] = {}
        self._blocks: dict[str, OrderedDict[BlockHash, float]] = {}  # engine → block → last use

    def blocks(self, engine: str) -> int:
        return len(self._blocks.get(engine, ()))

    def add(self, engine: str, hashes: Iterable[BlockHash]) -> None:
        now = self._clock()
        blocks = self._blocks.setdefault(engine, OrderedDict())
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                self._owners.setdefault(h, set()).add(engine)
            blocks[h] = now
        self._trim(engine, blocks, now)

    def remove(self, engine: str, hashes: Iterable[BlockHash]) -> None:
        blocks = self._blocks.get(engine)
        if not blocks:
            return
        for h in hashes:
            if blocks.pop(h, None) is not None:
                self._disown(h, engine)

    def clear(self, engine: str) -> None:
        """The engine lost everything (restart, ``AllBlocksCleared``) or left the pool."""
        for h in self._blocks.pop(engine, {}):
            self._disown(h, engine)

    def match(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each engine holds (engines with no match are absent)."""
        if not hashes:
            return {}
        first = self._owners.get(hashes[0])
        if not first:
            return {}
        oldest = None if self._ttl is None else self._clock() - self._ttl
        live = {e for e in first if oldest is None or self._blocks[e][hashes[0]] >= oldest}
        matched: dict[str, int] = {}
        depth = 0
        for depth, h in enumerate(hashes):
            owners = self._owners.get(h)
            still = {e for e in live if owners and e in owners
                     and (oldest is None or self._blocks[e][h] >= oldest)}
            for e in live - still:
                matched[e] = depth
            live = still
            if not live:
                break
        else:
            depth = len(hashes)
        for e in live:
            matched[e] = depth
        return {e: n for e, n in matched.items() if n > 0}

    def _trim(self, engine: str, blocks: OrderedDict[BlockHash, float], now: float) -> None:
        oldest = None if self._ttl is None else now - self._ttl
        while blocks:
            h, seen = next(iter(blocks.items()))
            if (self._capacity is not None and len(blocks) > self._capacity) or (
                    oldest is not None and seen < oldest):
                blocks.popitem(last=False)
                self._disown(h, engine)
            else:
                break

    def _disown(self, h: BlockHash, engine: str) -> None:
        owners = self._owners.get(h)
        if owners is not None:
            owners.discard(engine)
            if not owners:
                del self._owners[h]
