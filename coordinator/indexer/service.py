"""What the indexer does with each message: the same ``PrefixMemory`` a coordinator process would keep,
fed by every worker's lessons and, with the precise source, by the engines' KV events."""

from __future__ import annotations

import os
import time
from collections import Counter, deque

from coordinator.config import PrefixIndexSettings
from coordinator.contracts.indexer import (
    Attach,
    Detach,
    EngineMatch,
    Forget,
    Learn,
    Match,
    Matched,
    Reply,
    Request,
    Stats,
    Status,
)
from coordinator.pipeline.scheduling.prefix.index import configured_index
from coordinator.pipeline.scheduling.prefix.memory import PrefixMemory
from coordinator.pipeline.scheduling.prefix.source import PreciseIndexSource


class IndexService:
    """One pod's (or one replica set's) prefix index. The approximate source learns from every
    worker's decisions, so each sees the lessons of all; the precise source mirrors each engine's KV
    events once for the pod, and the workers' lessons feed its short-lived pending layer."""

    def __init__(self, prefix: PrefixIndexSettings, *, window_s: float = 30.0) -> None:
        """``window_s``: how long a worker's decision counts towards the pod's shares (the
        ``bounded_load`` picker's window)."""
        self.source = prefix.source
        self._window_s = window_s
        self._decisions: deque[tuple[float, str, bool]] = deque()   # (when, engine, cold), one per lesson
        self._recent: Counter[str] = Counter()
        self._founded: Counter[str] = Counter()
        self.started_at = time.time()
        self.feeds: PreciseIndexSource | None = None
        if prefix.source == "precise":
            self.index = configured_index(prefix)
            pending = configured_index(prefix, ttl_s=prefix.pending_ttl_s)
            tiers = {tier: configured_index(prefix) for tier in prefix.tiers}
            self.memory = PrefixMemory(self.index, pending, learn=False, tiers=tiers)
            # A fresh indexer (a restart) first replays what each engine still buffers.
            self.feeds = PreciseIndexSource(self.index, self._model_of, prefix.block_size, bootstrap=True,
                                            tiers=tiers, gather_s=prefix.gather_ms / 1000,
                                            reader=prefix.reader)
        else:
            self.index = configured_index(prefix, ttl_s=prefix.ttl_s)
            self.memory = PrefixMemory(self.index, None, learn=True)
        self._models: dict[str, str] = {}
        # engine → the connections (workers, replicas) that asked for its feed: one worker's detach
        # (its own admin call, a discovery lag) must not stop the feed the others still route on.
        self._holders: dict[str, set[object]] = {}

    def _model_of(self, engine: str) -> str:
        return self._models.get(engine, "")

    async def handle(self, message: Request, peer: object = None) -> Reply | None:
        """The answer to ``message`` from connection ``peer`` (None for the ones that have none)."""
        if isinstance(message, Match):
            matched, continuing = self.memory.lookup(message.hashes)
            tiers = self.memory.tier_runs(message.hashes)
            return Matched(message.id, [EngineMatch(e, matched.get(e, 0), e in continuing, tiers.get(e, {}))
                                        for e in matched.keys() | tiers.keys()], *self.recent())
        if isinstance(message, Learn):
            self.memory.learn(message.engine, message.hashes)
            self._decisions.append((time.monotonic(), message.engine, message.cold))
            self._recent[message.engine] += 1
            self._founded[message.engine] += message.cold
            self._expire()   # here too: workers that score no prefix send lessons but never ask
        elif isinstance(message, Attach):
            if self.feeds is not None:
                self._holders.setdefault(message.engine, set()).add(peer)
                self._models[message.engine] = message.model
                await self.feeds.attach(message.engine, message.endpoint, message.model, message.replay)
        elif isinstance(message, Detach):
            await self._release(message.engine, peer)
        elif isinstance(message, Forget):
            self.memory.forget(message.engine)
        elif isinstance(message, Status):
            return self.stats(message.id)
        return None

    def recent(self) -> tuple[dict[str, int], dict[str, int]]:
        """Decisions per engine over the window, every connection's, and how many of them were cold."""
        self._expire()
        return +self._recent, +self._founded   # unary plus: only the positive counts

    def _expire(self) -> None:
        cutoff = time.monotonic() - self._window_s
        decisions, recent, founded = self._decisions, self._recent, self._founded
        while decisions and decisions[0][0] < cutoff:
            _, engine, cold = decisions.popleft()
            recent[engine] -= 1
            founded[engine] -= cold

    async def _release(self, engine: str, peer: object) -> None:
        holders = self._holders.get(engine)
        if holders is None:
            return
        holders.discard(peer)
        if not holders:
            del self._holders[engine]
            if self.feeds is not None:
                await self.feeds.detach(engine)

    def gone(self, peer: object) -> None:
        """Connection ``peer`` closed. Its feeds go on even if no one else holds them: a worker that died
        (or restarts) sent no detach, and its successor attaches the same engines again; until then
        the index stays current. A later detach from anyone stops an orphaned feed."""
        for holders in self._holders.values():
            holders.discard(peer)

    def stats(self, request_id: int = 0) -> Stats:
        subs = list(self.feeds.subscribers.values()) if self.feeds is not None else []
        engines = self.index.engines()
        return Stats(request_id, self.source, engines=sum(1 for e in engines if self.index.blocks(e)),
                     blocks=sum(self.index.blocks(e) for e in engines), feeds=len(subs),
                     batches=sum(s.mirror.stats.batches for s in subs),
                     blocks_stored=sum(s.mirror.stats.blocks_stored for s in subs),
                     gaps=sum(s.gaps for s in subs),
                     replayed=sum(s.replayed for s in subs), started_at=self.started_at,
                     pid=os.getpid(),
                     tier_blocks={tier: sum(map(ix.blocks, ix.engines()))
                                  for tier, ix in self.memory.tiers.items()})

    async def aclose(self) -> None:
        if self.feeds is not None:
            await self.feeds.stop_all()
