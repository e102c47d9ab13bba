"""Which LoRA adapters one engine holds, as the coordinator knows it (no HTTP here: ``lora.py`` loads).

Why the coordinator keeps this at all: a request for an adapter an engine does not hold costs a load
(reading the weights, a slot in the engine's LoRA cache) before its first token, and an engine runs at
most ``--max-loras`` adapters per batch, so a request for a further one waits inside the engine
("deferred"). Routing to holders avoids both. What an engine holds is learned from the engine itself
(its ``/v1/models`` lists every registered adapter with ``parent`` set; ``vllm:lora_requests_info``
names the running ones and ``max_lora``), and updated by what the coordinator loads and unloads, so a
restart of either side converges on the truth within one probe round.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter of one base model: engines load it from ``path`` and run it as ``name``."""

    name: str
    base: str
    path: str
    pinned: tuple[str, ...] = ()      # engine URLs that keep it loaded
    created: int = 0


@dataclass
class Residency:
    """One engine's adapters: held (name → last use), pinned, requests in flight per adapter, loads
    in flight, and how many it may hold (``capacity``)."""

    default_capacity: int = 4
    configured_capacity: int | None = None   # engines[].max_loras
    learned_capacity: int | None = None      # the engine's max_lora (its metrics)
    held: dict[str, float] = field(default_factory=dict)
    pinned: set[str] = field(default_factory=set)
    inflight: Counter[str] = field(default_factory=Counter)
    loading: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic

    @property
    def capacity(self) -> int:
        return self.configured_capacity or self.learned_capacity or self.default_capacity

    def holds(self, name: str) -> bool:
        return name in self.held

    def is_loading(self, name: str) -> bool:
        return name in self.loading

    def running(self, name: str) -> int:
        """The coordinator's requests for ``name`` on this engine right now."""
        return self.inflight.get(name, 0)

    @property
    def free_slots(self) -> int:
        return max(0, self.capacity - len(self.held) - len(self.loading))

    def evictable(self, keep: str | None = None) -> str | None:
        """The least recently used adapter that may be unloaded to make room (for ``keep``): not
        pinned, no request of ours running on it, not being loaded. None: nothing may go (the engine
        is then left over its size rather than a running adapter unloaded)."""
        idle = [(used, name) for name, used in self.held.items()
                if name != keep and name not in self.pinned and not self.inflight.get(name)
                and name not in self.loading]
        return min(idle)[1] if idle else None

    def touch(self, name: str) -> None:
        self.held[name] = self.clock()

    def begin(self, name: str) -> None:
        """A request for ``name`` starts on this engine (it is now in use: not evictable)."""
        self.inflight[name] += 1
        if name in self.held:
            self.touch(name)

    def end(self, name: str) -> None:
        self.inflight[name] -= 1
        if self.inflight[name] <= 0:
            del self.inflight[name]

    def loaded(self, name: str) -> None:
        self.touch(name)

    def unloaded(self, name: str) -> None:
        self.held.pop(name, None)

    def learn(self, names: Iterable[str], capacity: int | None = None) -> tuple[set[str], set[str]]:
        """The engine's own list of adapters replaces ours (a restarted engine holds none; one that an
        operator loaded by hand holds more); a known adapter keeps its last-use time. Returns what
        appeared and what vanished."""
        found = set(names)
        before = set(self.held)
        for name in before - found:
            if name not in self.loading:   # a load in flight registers it when it answers
                del self.held[name]
        now = self.clock()
        for name in found - before:
            self.held[name] = now - 1e6    # held but never used by us: first to go
        if capacity is not None:
            self.learned_capacity = capacity
        return found - before, before - found

    def forget(self) -> None:
        """The engine went away: it holds nothing when it comes back (pins are reapplied by then)."""
        self.held.clear()
        self.learned_capacity = None
