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
        # The chain's shape: blocks that some indexed block continues. A prompt whose match ends
        # where others branch off (a shared system prompt) is a *new* conversation; one whose match
        # ends at a leaf continues an existing one (see ``continues``). A flag, not a count, so
        # learning stays one set operation per block; it is cleared when the block itself goes.
        self._continued: set[BlockHash] = set()
        self._expired_at = float("-inf")

    def blocks(self, engine: str) -> int:
        return len(self._blocks.get(engine, ()))

    def add(self, engine: str, hashes: Sequence[BlockHash], parent: BlockHash | None = None) -> None:
        """Record that ``engine`` holds the chain ``hashes`` (``parent``: the block before the first,
        when the chain does not start at the prompt's beginning)."""
        now = self._clock()
        blocks = self._blocks.get(engine)
        if blocks is None:
            blocks = self._blocks[engine] = OrderedDict()
        owners_of = self._owners
        prev = parent
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                owners = owners_of.get(h)
                if owners is None:
                    owners_of[h] = {engine}
                    if prev is not None:  # a block new to the index continues ``prev``
                        self._continued.add(prev)
                else:
                    owners.add(engine)
            blocks[h] = now
            prev = h
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
        """Leading blocks of ``hashes`` each engine holds (engines with no match are absent).

        Set operations run in C: an engine stays "live" while every block so far is its own; the
        walk ends when no engine is live or a block has no owner at all."""
        if not hashes:
            return {}
        if self._ttl is not None:
            now = self._clock()
            if now - self._expired_at >= min(1.0, self._ttl / 10):  # TTLs are minutes; sweep ~1/s
                self._expired_at = now
                self._expire(now)
        first = self._owners.get(hashes[0])
        if not first:
            return {}
        live = set(first)
        matched: dict[str, int] = {}
        depth, n = 1, len(hashes)
        while depth < n:
            owners = self._owners.get(hashes[depth])
            if owners is None:
                break
            if not live <= owners:
                still = live & owners
                for e in live - still:
                    matched[e] = depth
                live = still
                if not live:
                    break
            depth += 1
        for e in live:
            matched[e] = depth
        return matched

    def _expire(self, now: float) -> None:
        """Drop blocks unused for ``ttl_s``. Use moves a block to the end, so expired ones are at the
        front of each engine's order and this stops at the first fresh one."""
        assert self._ttl is not None
        for engine, blocks in self._blocks.items():
            self._drop_older(engine, blocks, now - self._ttl)

    def _trim(self, engine: str, blocks: OrderedDict[BlockHash, float], now: float) -> None:
        if self._capacity is not None:
            for _ in range(len(blocks) - self._capacity):
                h, _seen = blocks.popitem(last=False)
                self._disown(h, engine)
        if self._ttl is not None:
            self._drop_older(engine, blocks, now - self._ttl)

    def _drop_older(self, engine: str, blocks: OrderedDict[BlockHash, float], oldest: float) -> None:
        while blocks:
            h, seen = next(iter(blocks.items()))
            if seen >= oldest:
                break
            blocks.popitem(last=False)
            self._disown(h, engine)

    def continues(self, h: BlockHash) -> bool:
        """No indexed block continues ``h``: a prompt whose match ends here extends its own chain."""
        return h not in self._continued

    def _disown(self, h: BlockHash, engine: str) -> None:
        owners = self._owners.get(h)
        if owners is not None:
            owners.discard(engine)
            if not owners:
                del self._owners[h]
                self._continued.discard(h)
