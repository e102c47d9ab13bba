"""The precise source's feeds, one per engine that publishes KV events, kept in step with the fleet
(``PreciseIndexSource``). Runs in a coordinator process (``scheduling.prefix.indexer: local``) or in
the pod's indexer process (docs/scheduling.md, "The pod's KV index").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import zmq

from coordinator.pipeline.scheduling.prefix.feeds import KvEventSubscriber
from coordinator.pipeline.scheduling.prefix.gather import Gatherer
from coordinator.pipeline.scheduling.prefix.index import PrefixIndex
from coordinator.pipeline.scheduling.prefix.kv_events import KvEventMirror

log = logging.getLogger(__name__)


class PreciseIndexSource:
    """Keeps one ``KvEventSubscriber`` per engine that publishes KV events (``EngineSettings.kv_events``).

    The index key is the engine URL, as for the approximate source. ``model_of`` names an engine's
    model when ``attach`` is not told (it seeds the hash chain, so it must be the name requests use).
    """

    def __init__(self, index: PrefixIndex, model_of: Callable[[str], str], block_size: int, *,
                 topic: str = "", context: zmq.Context[Any] | None = None, bootstrap: bool = False,
                 tiers: Mapping[str, PrefixIndex] | None = None, gather_s: float = 0.0,
                 reader: str = "zmtp") -> None:
        """``bootstrap``: each feed first replays what its engine still buffers (``KvEventSubscriber``).
        ``reader``: ``zmtp`` (our own, where the endpoint allows) or ``libzmq`` (``KvEventSubscriber``).
        ``gather_s``: the feeds share one ``Gatherer`` of this interval (0: each wakes for itself).
        ``tiers``: the offload tiers' indexes (``KvEventMirror``); events of other tiers are dropped."""
        self.index = index
        self.tiers = dict(tiers or {})
        self.model_of = model_of
        self.block_size = block_size
        self.topic = topic
        self._ctx = context
        self.subscribers: dict[str, KvEventSubscriber] = {}
        self.bootstrap = bootstrap
        self.gather_s = gather_s
        self.reader = reader
        self.gatherer: Gatherer | None = None

    async def attach(self, engine_url: str, endpoint: str, model: str | None = None,
                     replay: str | None = None) -> KvEventSubscriber:
        """Idempotent for the same endpoints and model; a changed one replaces the subscriber."""
        endpoint = connect_endpoint(endpoint, engine_url)
        replay = connect_endpoint(replay, engine_url) if replay else None
        model = model or self.model_of(engine_url)
        sub = self.subscribers.get(engine_url)
        if sub is not None:
            if sub.endpoint == endpoint and sub.mirror.model == model and sub.replay_endpoint == replay:
                return sub
            await self.detach(engine_url)
        mirror = KvEventMirror(self.index, engine_url, model, self.block_size, tiers=self.tiers)
        if self.gatherer is None and self.gather_s > 0 and Gatherer.available():
            self.gatherer = Gatherer(asyncio.get_running_loop(), self.gather_s, self.index.now)
        sub = KvEventSubscriber(endpoint, mirror, self.topic, context=self._ctx, replay_endpoint=replay,
                                bootstrap=self.bootstrap, gatherer=self.gatherer, reader=self.reader)
        sub.start()
        self.subscribers[engine_url] = sub
        log.info("precise prefix index: %s ← KV events at %s", engine_url, endpoint)
        return sub

    async def detach(self, engine_url: str) -> None:
        sub = self.subscribers.pop(engine_url, None)
        if sub is not None:
            await sub.stop()

    async def stop_all(self) -> None:
        for url in list(self.subscribers):
            await self.detach(url)
        gatherer, self.gatherer = self.gatherer, None
        if gatherer is not None:
            gatherer.close()


def connect_endpoint(endpoint: str, engine_url: str) -> str:
    """``tcp://*:5557`` / ``tcp://0.0.0.0:5557`` (the engine's own bind address, often copied into our
    config) cannot be connected to: use the engine URL's host instead."""
    parts = urlsplit(endpoint)
    if parts.scheme == "tcp" and parts.hostname in ("*", "0.0.0.0", "::") and parts.port is not None:
        host = urlsplit(engine_url).hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"tcp://{host}:{parts.port}"
    return endpoint
