"""What the scheduler knows of where prompts' prefixes are cached.

Two sources, one view: the prefix index (fed by routing decisions, the approximate source, or by the
engines' KV events, the precise one), a short-lived pending layer that decisions feed while the
index waits for KV events (a prefix being prefilled right now must already attract its followers),
and the lessons of decisions not applied yet. Learning is the step after a placement: a decision
only reads, and what it teaches is applied later in one batch (``defer``), while later decisions
read the unapplied lessons directly (``lookup``), so they see what they would have seen without
the deferral.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence

from coordinator.contracts.hashing import BlockHash
from coordinator.pipeline.scheduling.prefix.index import PrefixIndex


class _Differs:
    """``bisect`` key: whether two chains differ at a depth (False up to their common prefix)."""

    def __init__(self, a: Sequence[BlockHash], b: Sequence[BlockHash]) -> None:
        self.a, self.b = a, b

    def __call__(self, i: int) -> bool:
        return self.a[i] != self.b[i]


class PrefixMemory:
    def __init__(self, index: PrefixIndex | None, pending: PrefixIndex | None, *, learn: bool,
                 defer: Callable[[Callable[[], None]], None] | None = None) -> None:
        """``learn``: decisions feed ``index`` (the approximate source). ``pending``: the short-TTL
        layer decisions feed while ``index`` is fed by KV events. ``defer``: how the batch of lessons
        is scheduled (None: applied at once)."""
        self.index = index
        self.pending = pending
        self._learns = learn and index is not None
        self._defer = defer
        self._unlearned: list[tuple[str, list[BlockHash]]] = []  # (engine url, chain) not applied yet

    @property
    def active(self) -> bool:
        """Whether there is anything to look prompts up in."""
        return self.index is not None or self.pending is not None

    def lookup(self, hashes: list[int] | None) -> tuple[dict[str, int], frozenset[str]]:
        """Blocks each engine holds (the longest of the index, the pending layer and the lessons not
        applied yet), and the engines where the request extends its own chain: its match ends at a
        leaf or covers the prompt."""
        matched: dict[str, int] = {}
        continuing: set[str] = set()
        if not hashes:
            return matched, frozenset()
        indexes = [ix for ix in (self.index, self.pending) if ix is not None]
        unlearned = self._unlearned
        lands_in = [ix for ix in (self.index if self._learns else None, self.pending) if ix is not None]

        def extends(n: int, shapes: Sequence[PrefixIndex]) -> bool:
            """The match of ``n`` blocks covers the prompt or ends at a leaf: no block of ``shapes``
            or about to be indexed continues its last one (chains are position-tagged, so only
            depth ``n - 1`` of a lesson can hold it)."""
            if n == len(hashes):
                return True
            h = hashes[n - 1]
            return (all(ix.continues(h) for ix in shapes)
                    and not any(len(c) > n and c[n - 1] == h for _, c in unlearned))

        def note(url: str, n: int, shapes: Sequence[PrefixIndex]) -> None:
            best = matched.get(url, 0)
            if n > best:
                matched[url] = n
                continuing.discard(url)
            if n >= best and extends(n, shapes):
                continuing.add(url)

        for index in indexes:
            for url, n in index.match(hashes).items():
                note(url, n, (index,))
        for url, chain in unlearned:
            # Equal chained hashes at a depth mean equal prefixes up to it: bisect for the first
            # difference.
            n = bisect_left(range(min(len(chain), len(hashes))), True, key=_Differs(chain, hashes))
            if n:
                note(url, n, lands_in)
        return matched, frozenset(continuing)

    def learn(self, engine_url: str, hashes: list[BlockHash] | None) -> None:
        """A placement's lesson: ``engine_url`` now holds (or is about to hold) this chain."""
        if not hashes or not (self._learns or self.pending is not None):
            return
        self._unlearned.append((engine_url, hashes))
        if self._defer is None:
            self.flush()
        elif len(self._unlearned) == 1:
            self._defer(self.flush)

    def flush(self) -> None:
        """Apply the lessons to the index (and the pending layer), oldest first."""
        batch, self._unlearned = self._unlearned, []
        for url, hashes in batch:
            if self._learns and self.index is not None:
                self.index.add(url, hashes)
            if self.pending is not None:
                self.pending.add(url, hashes)

    def forget(self, engine_url: str) -> None:
        """An engine left (or lost its cache): nothing is known to be cached there any more."""
        self._unlearned = [(url, hashes) for url, hashes in self._unlearned if url != engine_url]
        for index in (self.index, self.pending):
            if index is not None:
                index.clear(engine_url)
