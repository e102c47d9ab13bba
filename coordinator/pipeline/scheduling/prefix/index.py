"""Which engine holds which prompt blocks.

One structure serves both sources: the approximate source adds the blocks of every prompt it routes
(bounded per engine by an LRU capacity and a TTL, because it never learns about evictions); the
precise source mirrors the engines' own KV events (evictions arrive as events; the capacity is then
only a safety bound against lost ones).

Costs, because a 100k-token prompt is 6,250 blocks: ``match`` probes O(log n) blocks per engine
group instead of walking every block. The storage is native (``_index.c``: hash tables of machine
words, no Python object per block) when the extension is built; the Python form below is the
fallback and the reference the tests hold the native one to. It does its per-block work in C-level
passes over dicts and sets, and runs Python code per block only for blocks shared between engines.
"""

from __future__ import annotations

import copy
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, islice, repeat, takewhile
from operator import eq, is_, is_not

from coordinator.config import PrefixIndexSettings
from coordinator.contracts.hashing import PURE_PYTHON, BlockHash

try:  # the storage in C (``_index.c``); else the Python below
    if PURE_PYTHON:
        raise ImportError("LLMC_PURE_PYTHON=1")
    from coordinator.pipeline.scheduling.prefix import _index as _native
except ImportError:
    _native = None  # type: ignore[assignment]

NATIVE_INDEX = _native is not None
"""Whether indexes keep their blocks in C (``_index.c``) unless told otherwise."""

_NEVER = float("-inf")
_SHARED_BYTES = sys.getsizeof(("engine-a", "engine-b"))
_INT_BYTES = sys.getsizeof(2**62)

# A block's owners: one engine's name (most blocks: a conversation lives on one engine) or a tuple
# of several (shared system prompts). Neither is a container the garbage collector keeps tracking
# (it untracks tuples of strings), so millions of blocks cost no set each, nothing to create in
# bulk learning, and the owner map itself stays untracked: a full collection does not walk it.
Owners = str | tuple[str, ...]


IndexState = tuple[dict[str, list[tuple[BlockHash, float]]], dict[BlockHash, Owners], set[BlockHash], int]
"""``PrefixIndex.state``: LRU lists with last use, owners, leaves, shared count."""


def _holds_all(owners: Owners | None, live: set[str]) -> bool:
    if owners is None:
        return False
    if isinstance(owners, str):
        return len(live) == 1 and owners in live
    return live.issubset(owners)


def _run_end(hashes: Sequence[BlockHash], lo: int, held: Callable[[BlockHash], bool]) -> int:
    """The first depth past ``lo`` whose block is not ``held`` (``len(hashes)`` if all are), given
    that ``hashes[lo]`` is and that what is held is a leading run: gallop, then bisect."""
    good, step, bad = lo, 1, len(hashes)
    while good + step < bad:
        if held(hashes[good + step]):
            good += step
            step *= 2
        else:
            bad = good + step
            break
    while bad - good > 1:
        mid = (good + bad) // 2
        if held(hashes[mid]):
            good = mid
        else:
            bad = mid
    return bad


def _as_set(owners: Owners) -> set[str]:
    return {owners} if isinstance(owners, str) else set(owners)


class PrefixIndex:
    def __init__(self, *, capacity_blocks: int | None = None, ttl_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, native: bool | None = None,
                 huge_pages: bool = True) -> None:
        """``native``: keep the blocks in C (``_index.c``); None: when the extension is built. The
        Python form holds the same blocks in the same order (the tests compare the two).
        ``huge_pages``: the C tables ask for transparent huge pages once they reach 2 MiB
        (``scheduling.prefix.huge_pages``)."""
        if native and _native is None:
            raise RuntimeError("the native prefix index (_index.c) is not built")
        self._core = _native.Index(huge_pages) if _native is not None and native is not False else None
        self.capacity_blocks = capacity_blocks
        self._ttl = ttl_s
        self._clock = clock
        self._owners: dict[BlockHash, Owners] = {}
        self._shared = 0  # blocks with several owners (for ``approx_bytes``)
        # engine → block → last use, in LRU order (a plain dict keeps insertion order; re-inserting
        # moves a block to the end). A chain is inserted tail first, so a block always sits behind
        # (is fresher than) its descendants: trimming and expiry take a chain's tail before its
        # prefix, and what an engine keeps of a prompt is always a leading run that still matches.
        self._blocks: dict[str, dict[BlockHash, float]] = {}
        # The chain's shape: indexed blocks that no block new to the index has continued since they
        # came (leaves). A prompt whose match ends where others branch off (a shared system prompt)
        # is a *new* conversation; one whose match ends at a leaf continues an existing one (see
        # ``continues``). Leaves, not the far more numerous inner blocks, so that learning a chain
        # touches two entries; a block stops being a leaf for good once continued (a flag, not a
        # count) and leaves the set when it leaves the index.
        self._leaves: set[BlockHash] = set()
        self._expired_at = float("-inf")
        # No indexed block was last used before this (a lower bound, exact right after a sweep):
        # a sweep is due only once the TTL's cutoff passes it. Checking each engine's oldest block
        # instead costs a scan: a dict used as an LRU keeps the slots it deleted at its front.
        self._floor = float("inf")

    def __deepcopy__(self, memo: dict[int, object]) -> PrefixIndex:
        """An independent index holding the same (a benchmark's filled index, reused per policy)."""
        clone = copy.copy(self)
        if self._core is not None:
            clone._core = self._core.copy()
        else:
            clone._owners, clone._leaves = dict(self._owners), set(self._leaves)
            clone._blocks = {e: dict(b) for e, b in self._blocks.items()}
        return clone

    @property
    def native(self) -> bool:
        return self._core is not None

    def direct_writes(self) -> tuple[_native.Index, int] | None:
        """The C storage and the capacity (-1: none), when adding to this index is the storage's ``add``
        then ``trim`` by capacity alone (native, no TTL): the KV-event mirror then writes a whole
        published batch to it in one C call (``_mirror.apply_batch``)."""
        if self._core is None or self._ttl is not None:
            return None
        return self._core, -1 if self.capacity_blocks is None else self.capacity_blocks

    def now(self) -> float:
        """The index's clock: the last use it records for what is added now."""
        return self._clock()

    def blocks(self, engine: str) -> int:
        if self._core is not None:
            return self._core.blocks(engine)
        return len(self._blocks.get(engine, ()))

    def engines(self) -> list[str]:
        return self._core.engines() if self._core is not None else list(self._blocks)

    def owners(self, h: BlockHash) -> set[str]:
        if self._core is not None:
            return self._core.owners(h)
        o = self._owners.get(h)
        return set() if o is None else _as_set(o)

    def approx_bytes(self) -> int:
        """Estimated memory of the whole index, cheap enough for every scrape: the native tables and
        pools; or the sizes of the containers, one hash object per distinct block, one owner tuple per
        shared block."""
        if self._core is not None:
            return self._core.approx_bytes()
        per_engine = sum(sys.getsizeof(b) for b in self._blocks.values())
        return (per_engine + sys.getsizeof(self._owners) + sys.getsizeof(self._leaves)
                + len(self._owners) * _INT_BYTES + self._shared * _SHARED_BYTES)

    def state(self) -> IndexState:
        """Everything the index holds, in the Python form's shape: each engine's blocks with their last
        use, oldest first; each block's owner (or owners, in the order they came); the leaves; the
        count of shared blocks. For tests and debugging: it copies the whole index."""
        if self._core is not None:
            return self._core.snapshot()
        return ({e: list(b.items()) for e, b in self._blocks.items()}, dict(self._owners), set(self._leaves),
                self._shared)

    def add(self, engine: str, hashes: Sequence[BlockHash], parent: BlockHash | None = None) -> None:
        """Record that ``engine`` holds the chain ``hashes`` (``parent``: the block before the first,
        when the chain does not start at the prompt's beginning)."""
        if not hashes:
            return
        now = self._clock()
        if now < self._floor:
            self._floor = now
        if self._core is not None:
            self._core.add(engine, hashes, parent, now)
            ttl = self._ttl
            self._core.trim(engine, -1 if self.capacity_blocks is None else self.capacity_blocks,
                            now - ttl if ttl is not None and now - ttl > self._floor else _NEVER)
            return
        blocks = self._blocks.get(engine)
        if blocks is None:
            blocks = self._blocks[engine] = {}
        fresh = dict(zip(reversed(hashes), repeat(now)))  # tail first: see ``_blocks``
        held = fresh.keys() & blocks.keys()
        deque(map(blocks.__delitem__, held), maxlen=0)  # re-inserted below, at the fresh end
        blocks.update(fresh)
        if len(held) < len(fresh):
            self._own(engine, hashes, held, len(fresh), parent)
        self._trim(engine, blocks, now)

    def _own(self, engine: str, hashes: Sequence[BlockHash], held: set[BlockHash], unique: int,
             parent: BlockHash | None) -> None:
        """Ownership and chain shape for the blocks new to ``engine``. Usually they are the chain's
        tail (a conversation grows at its end): blocks other engines hold come first (a shared
        system prompt), then blocks new to the index, which are recorded in bulk (C-level ``map``,
        no bytecode per block): a cold 100k-token prompt is 6,250 of them."""
        n = len(hashes)
        start = n - (unique - len(held))
        if unique < n or not held.isdisjoint(islice(hashes, start, n)):
            self._own_each(engine, hashes, held, parent)   # repeated hashes, or scattered
            return
        owners_of = self._owners
        known = owners_of.keys() & islice(hashes, start, n)
        brand = start + len(known)                 # first block new to the index, if the shape holds
        if not known.isdisjoint(islice(hashes, brand, n)):
            self._own_each(engine, hashes, held, parent)
            return
        for h in known:
            self._add_owner(h, owners_of[h], engine)
        if brand < n:
            owners_of.update(zip(islice(hashes, brand, n), repeat(engine), strict=False))
            # The block before the first new one is continued; the last new one is the new leaf.
            before = hashes[brand - 1] if brand else parent
            if before is not None:
                self._leaves.discard(before)
            self._leaves.add(hashes[n - 1])

    def _own_each(self, engine: str, hashes: Sequence[BlockHash], held: set[BlockHash],
                  parent: BlockHash | None) -> None:
        owners_of = self._owners
        prev = parent
        for h in hashes:
            if h not in held:
                owners = owners_of.get(h)
                if owners is None:
                    owners_of[h] = engine
                    if prev is not None:  # a block new to the index continues ``prev``
                        self._leaves.discard(prev)
                    self._leaves.add(h)   # until a new block continues it
                else:
                    self._add_owner(h, owners, engine)
            prev = h

    def _add_owner(self, h: BlockHash, owners: Owners, engine: str) -> None:
        if isinstance(owners, str):
            if owners != engine:
                self._owners[h] = (owners, engine)
                self._shared += 1
        elif engine not in owners:
            self._owners[h] = (*owners, engine)

    def remove(self, engine: str, hashes: Iterable[BlockHash]) -> None:
        if self._core is not None:
            self._core.remove(engine, hashes)
            return
        blocks = self._blocks.get(engine)
        if blocks:
            hashes = hashes if isinstance(hashes, Sequence) else list(hashes)
            popped = map(blocks.pop, hashes, repeat(None))  # C-level: the KV-event intake's removals
            self._disown_all(list(compress(hashes, map(is_not, popped, repeat(None)))), engine)

    def clear(self, engine: str) -> None:
        """The engine lost everything (restart, ``AllBlocksCleared``) or left the pool."""
        if self._core is not None:
            self._core.clear(engine)
            return
        self._disown_all(list(self._blocks.pop(engine, ())), engine)

    def match(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each engine holds (engines with no match are absent).

        An engine that holds block ``k`` of a chain holds every block before it (see ``_blocks``;
        vLLM too frees a request's blocks tail first, and a prefix no earlier than its tails), so
        the depth where an engine's run ends is found by galloping and bisecting: O(log n) probes,
        not one per block. First for all engines holding the first block at once (a C-level subset
        test per probe: a shared system prompt ends for all of them at one depth), then for each
        engine still matching on its own (a dict lookup per probe: a conversation held at several
        depths by several engines ends at each). A hole inside a run (a lost KV event) can be
        skipped, which counts the blocks after it as held: at worst one mis-scored decision."""
        if not hashes:
            return {}
        self._expire_due()
        if self._core is not None:
            return self._core.match(hashes)
        get = self._owners.get
        first = get(hashes[0])
        if not first:
            return {}
        live = _as_set(first)
        n = len(hashes)
        bad = _run_end(hashes, 0, lambda h: _holds_all(get(h), live))
        if bad >= n:
            return dict.fromkeys(live, n)
        owners = get(hashes[bad])
        still = live.intersection(_as_set(owners) if isinstance(owners, str) else owners) \
            if owners is not None else set()
        matched = dict.fromkeys(live - still, bad)
        for e in still:
            matched[e] = _run_end(hashes, bad, self._blocks[e].__contains__)
        return matched

    def run_from(self, engine: str, hashes: Sequence[BlockHash], lo: int) -> int:
        """The first depth at or past ``lo`` whose block ``engine`` does not hold (``lo`` if it does not
        hold ``hashes[lo]``; galloping, as ``match``): how far a chain goes on in this index from a depth
        another one vouches for (``PrefixMemory``: the pending layer past what the engine's own KV
        events confirm)."""
        if lo < 0:
            raise ValueError("lo must be >= 0")
        if lo >= len(hashes):
            return lo
        self._expire_due()
        if self._core is not None:
            return self._core.run_from(engine, hashes, lo)
        blocks = self._blocks.get(engine)
        if not blocks or hashes[lo] not in blocks:
            return lo
        return _run_end(hashes, lo, blocks.__contains__)

    def _expire_due(self) -> None:
        """With a TTL, drop what it expired, at most every tenth of it (and only once the cutoff
        passes the floor of every block's last use)."""
        if self._ttl is not None:
            now = self._clock()
            if now - self._ttl > self._floor and now - self._expired_at >= min(1.0, self._ttl / 10):
                self._expired_at = now
                self._expire(now)

    def _expire(self, now: float) -> None:
        """Drop blocks unused for ``ttl_s``. Use moves a block to the end, so expired ones are at the
        front of each engine's order and this stops at the first fresh one."""
        assert self._ttl is not None
        if self._core is not None:
            self._floor = self._core.expire(now - self._ttl)
            return
        oldest, floor = now - self._ttl, float("inf")
        for engine, blocks in self._blocks.items():
            self._drop_older(engine, blocks, oldest)
            if blocks:
                floor = min(floor, next(iter(blocks.values())))
        self._floor = floor

    def _trim(self, engine: str, blocks: dict[BlockHash, float], now: float) -> None:
        over = 0 if self.capacity_blocks is None else len(blocks) - self.capacity_blocks
        if over > 0:
            gone = list(islice(blocks, over))
            deque(map(blocks.__delitem__, gone), maxlen=0)
            self._disown_all(gone, engine)
        if self._ttl is not None and now - self._ttl > self._floor:  # see ``_floor``
            self._drop_older(engine, blocks, now - self._ttl)

    def _drop_older(self, engine: str, blocks: dict[BlockHash, float], oldest: float) -> None:
        """Last-use times never decrease along the LRU order, so the expired blocks are a leading run,
        measured and dropped in C-level passes (a 10 s pending layer expires whole 100k-token prompts
        at a time)."""
        expired = sum(1 for _ in takewhile(float(oldest).__gt__, blocks.values()))  # float: int clocks too
        if expired:
            gone = list(islice(blocks, expired))
            deque(map(blocks.__delitem__, gone), maxlen=0)
            self._disown_all(gone, engine)

    def continues(self, h: BlockHash) -> bool:
        """No indexed block continues ``h``: a prompt whose match ends here extends its own chain."""
        if self._core is not None:
            return self._core.continues(h)
        return h in self._leaves or h not in self._owners

    def _disown_all(self, gone: list[BlockHash], engine: str) -> None:
        """``_disown`` for many blocks in C-level passes (trimming evicts as many as it learns): the
        blocks only ``engine`` owned go in bulk, shared ones one by one."""
        owners_of = self._owners
        found = list(map(owners_of.get, gone))
        alone = list(compress(gone, map(eq, found, repeat(engine))))
        deque(map(owners_of.__delitem__, alone), maxlen=0)
        self._leaves.difference_update(alone)
        if len(alone) < len(gone):
            for h in compress(gone, map(is_, map(type, found), repeat(tuple))):
                self._disown(h, engine)

    def _disown(self, h: BlockHash, engine: str) -> None:
        owners = self._owners.get(h)
        if owners == engine:
            del self._owners[h]
            self._leaves.discard(h)
        elif isinstance(owners, tuple) and engine in owners:
            rest = tuple(o for o in owners if o != engine)
            if len(rest) == 1:
                self._shared -= 1
            self._owners[h] = rest if len(rest) > 1 else rest[0]


def configured_index(prefix: PrefixIndexSettings, ttl_s: float | None = None) -> PrefixIndex:
    """An index as ``scheduling.prefix`` sizes it (its capacity, its tables' pages)."""
    return PrefixIndex(capacity_blocks=prefix.capacity_blocks, ttl_s=ttl_s, huge_pages=prefix.huge_pages)
