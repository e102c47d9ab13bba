"""The KV-event mirror's translation table in Python: one medium's engine blocks in our hash space.
The fallback of ``_mirror.Translation`` (the same in C, no Python object per block) and its reference
in the tests (``kv_events`` picks one)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import chain, repeat
from operator import itemgetter

from coordinator.contracts.hashing import BlockHash
from coordinator.contracts.kv_events import ExternalBlockHash

Entry = tuple[tuple[BlockHash, ...], int]
"""One engine block in our hash space: our hashes of it, and our blocks from the prompt's start through
it (the depth a run continuing it starts at, which the chain's hash needs)."""


class PyTranslation:
    """One medium's engine blocks in our hash space, and how many engine blocks map to each hash of ours.

    Two engine blocks can map to one hash of ours (KV cache groups of a hybrid model share hashes; a
    LoRA run under the base model's name), so a hash leaves the index only with its last engine block:
    ``held`` has every hash some engine block maps to, ``extra`` the rare ones more than one does (how
    many more). The per-block work is C-level passes over whole runs (``dict.update``/``map``/``zip``).
    The fallback of ``_mirror.Translation`` (the same in C, no Python object per block) and its
    reference in the tests."""

    def __init__(self) -> None:
        self.ours: dict[int, dict[ExternalBlockHash, Entry]] = {}  # KV cache group → engine block → ours
        self.held: set[BlockHash] = set()
        self.extra: dict[BlockHash, int] = {}

    def __len__(self) -> int:
        return sum(map(len, self.ours.values()))

    def clear(self) -> None:
        self.ours.clear()
        self.held.clear()
        self.extra.clear()

    def parent(self, group: int, engine_hash: ExternalBlockHash) -> tuple[BlockHash, int] | None:
        """Our last hash of a block the engine reported, and the depth after it."""
        found = self.ours.get(group, {}).get(engine_hash)
        return None if found is None else (found[0][-1], found[1])

    def store(self, group: int, engine_hashes: Sequence[ExternalBlockHash], ours: Sequence[BlockHash],
              per: int, start: int) -> None:
        """Engine block ``i`` is ``ours[i*per:(i+1)*per]``, at depth ``start + (i+1)*per``. A block
        reported again first gives up its old mapping (its hashes stay in the index: the caller
        refreshes it)."""
        known = self.ours.get(group)
        if known is None:
            known = self.ours[group] = {}
        again = known.keys() & engine_hashes
        if again:  # re-reported (a cache hit in "full" report mode): its old mapping goes first
            self._release(list(chain.from_iterable(known.pop(eh)[0] for eh in again)))
        # Our hashes cut into the engine's blocks, each with the depth after it: C-level zips.
        cut = zip(*[iter(ours)] * per, strict=True)
        depths = range(start + per, start + (len(engine_hashes) + 1) * per, per)
        known.update(zip(engine_hashes, zip(cut, depths, strict=True), strict=True))
        held = self.held
        if not held.isdisjoint(ours):
            extra = self.extra
            for h in held.intersection(ours):
                extra[h] = extra.get(h, 0) + 1
        held.update(ours)

    def remove(self, group: int, engine_hashes: Iterable[ExternalBlockHash]) -> tuple[int, list[BlockHash]]:
        """How many of these engine blocks were known, and the hashes of ours no engine block maps to
        any more."""
        known = self.ours.get(group)
        if not known:
            return 0, []
        entries = [e for e in map(known.pop, engine_hashes, repeat(None)) if e is not None]
        if not entries:
            return 0, []
        return len(entries), self._release(list(chain.from_iterable(map(itemgetter(0), entries))))

    def _release(self, ours: list[BlockHash]) -> list[BlockHash]:
        """Drop one engine block's mapping per hash; returns the hashes no engine block maps to any
        more (all of them, unless a hash is mapped more than once: ``extra`` is almost always empty)."""
        extra = self.extra
        if not extra or extra.keys().isdisjoint(ours):
            self.held.difference_update(ours)
            return ours
        shared = Counter(h for h in ours if h in extra)
        kept = set()
        for h, dropped in shared.items():
            left = extra.pop(h) + 1 - dropped   # engine blocks still mapping to it
            if left > 1:
                extra[h] = left - 1
            if left > 0:
                kept.add(h)
        free = [h for h in dict.fromkeys(ours) if h not in kept]
        self.held.difference_update(free)
        return free

    def state(self) -> tuple[dict[tuple[int, int], Entry], dict[BlockHash, int]]:
        """``_mirror.Translation.state``'s shape (int engine hashes only): for the tests."""
        return ({(g, int(eh)): entry for g, known in self.ours.items() for eh, entry in known.items()},
                {h: 1 + self.extra.get(h, 0) for h in self.held})
