"""What the scheduler knows of where prompts' prefixes are cached.

Two sources, one view: the prefix index (fed by routing decisions, the approximate source, or by the
engines' KV events, the precise one), a short-lived pending layer that decisions feed while the
index waits for KV events (a prefix being prefilled right now must already attract its followers;
it holds a lesson only past what the engine's events confirm, and a lookup reads it on from there),
and the lessons of decisions not applied yet. Learning is the step after a placement: a decision
only reads, and what it teaches is applied later in one batch (``defer``), while later decisions
read the unapplied lessons directly (``lookup``), so they see what they would have seen without
the deferral.

With the pod's indexer (``remote``) the index and the pending layer live in that process, shared by
every worker: a decision reads the indexer's answer to a question asked just before it
(``PrefixView``) plus this process's lessons the indexer had not received when it answered, and the
lessons are sent to it in the deferred batch. Sent lessons are kept here for ``RECENT_S``, which is
also what a decision sees of the past while the indexer is unreachable.

Offload tiers (``tiers``, the precise source: vLLM's CPU and storage offloading) are indexes of their
own, read beside the engine's cache: a block held only in a tier counts by the tier's weight
(``offloaded``), since it must be loaded back rather than recomputed.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from coordinator.contracts.hashing import BlockHash
from coordinator.pipeline.scheduling.prefix.index import PrefixIndex
from coordinator.pipeline.scheduling.prefix.remote import RemoteIndex

RECENT_S = 2.0      # how long sent lessons stay readable here (remote index)
RECENT_MAX = 4096


class _Shape(Protocol):
    """What ``continues`` asks of an index: whether an indexed block continues ``h``."""

    def continues(self, h: BlockHash) -> bool: ...


@dataclass(frozen=True)
class PrefixView:
    """The indexer's match for one prompt, asked before its decision."""

    matched: dict[str, int]
    continuing: frozenset[str]
    seen: int   # this process's lessons numbered up to here had been sent when it asked
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)  # engine → offload tier → leading blocks
    recent: dict[str, int] = field(default_factory=dict)   # the pod's decisions per engine (``Matched``)
    founded: dict[str, int] = field(default_factory=dict)  # ... of which were cold


@dataclass(frozen=True)
class PodShares:
    """The whole pod's routing decisions per engine over the bounded-load window (its indexer's count
    plus this process's decisions it had not heard of yet), and how many of them were cold."""

    decisions: dict[str, int]
    founded: dict[str, int]


class _Lesson(NamedTuple):
    url: str
    chain: list[BlockHash]
    cold: bool           # the decision found nothing cached anywhere (``bounded_load`` counts these)


class _Sent(NamedTuple):
    seq: int
    at: float
    lesson: _Lesson


def offloaded_blocks(cached: int, runs: Mapping[str, int], weights: Mapping[str, float]) -> float:
    """Blocks an engine holds past the ``cached`` ones of its own cache, each counted by the weight of
    the best tier that holds it (the weights, highest first: CPU before storage). A tier's run counts
    from the prompt's start, so a tier holding only a middle piece adds nothing: an under-estimate,
    never a promise the engine cannot keep."""
    reach, extra = cached, 0.0
    for tier, weight in sorted(weights.items(), key=lambda tw: -tw[1]):
        run = runs.get(tier, 0)
        if run > reach:
            extra += weight * (run - reach)
            reach = run
    return extra


class _Differs:
    """``bisect`` key: whether two chains differ at a depth (False up to their common prefix)."""

    def __init__(self, a: Sequence[BlockHash], b: Sequence[BlockHash]) -> None:
        self.a, self.b = a, b

    def __call__(self, i: int) -> bool:
        return self.a[i] != self.b[i]


class PrefixMemory:
    def __init__(self, index: PrefixIndex | None, pending: PrefixIndex | None, *, learn: bool,
                 defer: Callable[[Callable[[], None]], None] | None = None,
                 remote: RemoteIndex | None = None, tiers: Mapping[str, PrefixIndex] | None = None,
                 tier_weights: Mapping[str, float] | None = None) -> None:
        """``learn``: decisions feed ``index`` (the approximate source). ``pending``: the short-TTL
        layer decisions feed while ``index`` is fed by KV events. ``defer``: how the batch of lessons
        is scheduled (None: applied at once). ``remote``: the pod's indexer, which holds both (then
        ``index`` and ``pending`` are None here). ``tiers``: the offload tiers' indexes (KV events),
        ``tier_weights`` what a block in each is worth (the indexer's tiers reach a worker in its
        ``PrefixView``)."""
        self.index = index
        self.pending = pending
        self.remote = remote
        self.tiers = dict(tiers or {})
        self.tier_weights = dict(tier_weights or {})
        self._learns = learn and index is not None
        self._defer = defer
        self._unlearned: list[_Lesson] = []  # not applied (or sent) yet
        self._sent: deque[_Sent] = deque(maxlen=RECENT_MAX)
        self._sent_seq = 0

    @property
    def active(self) -> bool:
        """Whether there is anything to look prompts up in."""
        return self.index is not None or self.pending is not None or self.remote is not None

    async def view(self, hashes: list[int]) -> PrefixView | None:
        """Ask the indexer (``remote``) about ``hashes``; None if it cannot answer now."""
        if self.remote is None or not hashes:
            return None
        seen = self._sent_seq
        answer = await self.remote.match(hashes)
        if answer is None:
            return None
        return PrefixView({m.engine: m.blocks for m in answer.engines if m.blocks},
                          frozenset(m.engine for m in answer.engines if m.continues), seen,
                          {m.engine: m.tiers for m in answer.engines if m.tiers}, answer.recent,
                          answer.founded)

    def _unseen(self, view: PrefixView | None) -> Iterator[_Lesson]:
        """The lessons the indexer's answer lacks: those not applied (or sent) yet, and with the indexer,
        those sent after ``view`` was asked for (all recent ones when there is no view)."""
        yield from self._unlearned
        if self.remote is None:
            return
        seen = view.seen if view is not None else -1
        for sent in reversed(self._sent):
            if sent.seq <= seen:
                break
            yield sent.lesson

    def _lessons(self, view: PrefixView | None) -> Iterator[tuple[str, list[BlockHash]]]:
        """The lessons a lookup must read itself (``_unseen``), as (engine url, chain)."""
        for lesson in self._unseen(view):
            yield lesson.url, lesson.chain

    def lookup(self, hashes: list[int] | None,
               view: PrefixView | None = None) -> tuple[dict[str, int], frozenset[str]]:
        """Blocks each engine holds (the longest of the index, the pending layer, the indexer's
        ``view`` and the lessons it lacks), and the engines where the request extends its own chain:
        its match ends at a leaf or covers the prompt."""
        matched: dict[str, int] = {}
        continuing: set[str] = set()
        if not hashes:
            return matched, frozenset()
        indexes = [ix for ix in (self.index, self.pending) if ix is not None]
        unlearned = list(self._lessons(view))
        lands_in = [ix for ix in (self.index if self._learns else None, self.pending) if ix is not None]

        def extends(n: int, shapes: Sequence[_Shape]) -> bool:
            """The match of ``n`` blocks covers the prompt or ends at a leaf: no block of ``shapes``
            or about to be indexed continues its last one (chains are position-tagged, so only
            depth ``n - 1`` of a lesson can hold it)."""
            if n == len(hashes):
                return True
            h = hashes[n - 1]
            return (all(ix.continues(h) for ix in shapes)
                    and not any(len(c) > n and c[n - 1] == h for _, c in unlearned))

        def note(url: str, n: int, shapes: Sequence[_Shape]) -> None:
            best = matched.get(url, 0)
            if n > best:
                matched[url] = n
                continuing.discard(url)
            if n >= best and extends(n, shapes):
                continuing.add(url)

        confirmed: dict[str, int] = {}
        for index in indexes:
            runs = index.match(hashes)
            if index is self.index:
                confirmed = runs
            for url, n in runs.items():
                note(url, n, (index,))
        if self._pends_past_index:
            # The pending layer holds a lesson only past what the engine's events confirm (``_pend``):
            # read it on from where the engine's run in the index ends.
            assert self.index is not None and self.pending is not None
            for url, n in confirmed.items():
                end = self.pending.run_from(url, hashes, n)
                if end > n:
                    note(url, end, (self.index, self.pending))
        if view is not None:
            for url, n in view.matched.items():
                note(url, n, () if url in view.continuing else (_NEVER,))
        for url, chain in unlearned:
            # Equal chained hashes at a depth mean equal prefixes up to it: bisect for the first
            # difference.
            n = bisect_left(range(min(len(chain), len(hashes))), True, key=_Differs(chain, hashes))
            if n:
                note(url, n, lands_in)
        return matched, frozenset(continuing)

    def pod_shares(self, view: PrefixView | None) -> PodShares | None:
        """The pod's decisions per engine over its window: the indexer's count when ``view`` was
        answered plus this process's decisions it had not heard of yet (one lesson each). None without
        an answer from the indexer."""
        if view is None:
            return None
        decisions, founded = dict(view.recent), dict(view.founded)
        for lesson in self._unseen(view):
            decisions[lesson.url] = decisions.get(lesson.url, 0) + 1
            if lesson.cold:
                founded[lesson.url] = founded.get(lesson.url, 0) + 1
        return PodShares(decisions, founded)

    def tier_runs(self, hashes: list[int] | None) -> dict[str, dict[str, int]]:
        """Leading blocks of ``hashes`` each engine holds in each offload tier of this process."""
        runs: dict[str, dict[str, int]] = {}
        if hashes:
            for tier, index in self.tiers.items():
                for url, n in index.match(hashes).items():
                    runs.setdefault(url, {})[tier] = n
        return runs

    def offloaded(self, hashes: list[int] | None, matched: Mapping[str, int],
                  view: PrefixView | None = None) -> dict[str, float]:
        """Weighted blocks each engine holds in offload tiers past its ``matched`` ones
        (``offloaded_blocks``), from this process's tiers or the indexer's ``view``."""
        if not self.tier_weights or not hashes:
            return {}
        runs = view.tiers if view is not None else self.tier_runs(hashes)
        out = {}
        for url, held in runs.items():
            extra = offloaded_blocks(matched.get(url, 0), held, self.tier_weights)
            if extra > 0:
                out[url] = extra
        return out

    def learn(self, engine_url: str, hashes: list[BlockHash] | None, *, cold: bool = False) -> None:
        """A placement's lesson: ``engine_url`` now holds (or is about to hold) this chain (``cold``:
        nothing of it was cached anywhere)."""
        if not hashes or not (self._learns or self.pending is not None or self.remote is not None):
            return
        self._unlearned.append(_Lesson(engine_url, hashes, cold))
        if self._defer is None:
            self.flush()
        elif len(self._unlearned) == 1:
            self._defer(self.flush)

    def flush(self) -> None:
        """Apply the lessons to the index (and the pending layer), oldest first; or send them to the
        indexer, keeping them readable here for ``RECENT_S``."""
        batch, self._unlearned = self._unlearned, []
        if self.remote is not None:
            now = time.monotonic()
            sent = self._sent
            while sent and sent[0].at < now - RECENT_S:
                sent.popleft()
            for lesson in batch:
                self.remote.learn(lesson.url, lesson.chain, lesson.cold)
                self._sent_seq += 1
                sent.append(_Sent(self._sent_seq, now, lesson))
            return
        for url, hashes, _ in batch:
            if self._learns and self.index is not None:
                self.index.add(url, hashes)
            if self.pending is not None:
                self._pend(url, hashes)

    @property
    def _pends_past_index(self) -> bool:
        """The precise source: the index is the engines' KV events, the pending layer the lessons."""
        return self.index is not None and self.pending is not None and not self._learns

    def _pend(self, url: str, hashes: list[BlockHash]) -> None:
        """A lesson in the pending layer, only past what the engine's own KV events already confirm
        (its run in the index), which ``lookup`` reads on from: a turn of a 100k-token conversation
        is then its new blocks, not all 6,250 again (0.5-1.9 ms of table work each)."""
        assert self.pending is not None
        index = self.index if self._pends_past_index else None
        held = index.run_from(url, hashes, 0) if index is not None else 0
        if held < len(hashes):
            self.pending.add(url, hashes[held:], parent=hashes[held - 1] if held else None)

    def forget(self, engine_url: str) -> None:
        """An engine left (or lost its cache): nothing is known to be cached there any more."""
        self._unlearned = [lesson for lesson in self._unlearned if lesson.url != engine_url]
        if self.remote is not None:
            self.remote.forget(engine_url)
            kept = [sent for sent in self._sent if sent.lesson.url != engine_url]
            self._sent.clear()
            self._sent.extend(kept)
        for index in (self.index, self.pending, *self.tiers.values()):
            if index is not None:
                index.clear(engine_url)


class _Never:
    """A shape in which every block is continued: the indexer said the match does not extend its chain."""

    def continues(self, h: BlockHash) -> bool:
        return False


_NEVER = _Never()
