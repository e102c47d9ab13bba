"""The KV-event feeds' descriptors in one epoll set, swept at an interval (``scheduling.prefix.
gather_ms``; docs/scheduling.md, "Gathered wake-ups").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import time
from collections.abc import Callable
from typing import Any

from coordinator.pipeline.scheduling.prefix.kv_events import sweep

log = logging.getLogger(__name__)


class Gatherer:
    """The feeds' ZMQ descriptors in an epoll set of our own, which the event loop watches as one.

    Woken by the first feed with news, it waits ``interval`` seconds and then drains every feed that
    is ready, so a busy fleet costs one wake-up of the loop (and of libzmq's signalling, which only
    signals a reader that emptied its queue) per interval instead of one per published batch; the
    index is then at most ``interval`` behind the engines (docs/scheduling.md, "Gathered wake-ups").
    While sweeps find news, the next one is simply due ``interval`` later: the loop watches the set
    again only after a sweep that found none. Watching it again is an ``epoll_ctl`` that adds one epoll
    set to another, and the kernel then walks the nested set for loops: once per interval that was 9 %
    of a busy indexer's CPU. Linux only (``select.epoll``); elsewhere each feed watches its own
    descriptor.

    A feed added with its ``_mirror.Feed`` is drained by one C call for all of them
    (``kv_events.sweep``), at ``clock()``; its ``drain`` runs only when that call stopped at something
    for Python (a gap, a command, a closed stream). The Python around each feed's drain had been 14 %
    of a busy indexer's CPU.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.interval = interval
        self.sweeps = 0
        self._loop = loop
        self._clock = clock
        self._ep = select.epoll()
        self._drains: dict[int, Callable[[], None]] = {}
        self._feeds: dict[int, Any] = {}   # fd -> _mirror.Feed
        self._sweep_at: asyncio.TimerHandle | None = None
        self._loop.add_reader(self._ep.fileno(), self._woken)

    @classmethod
    def available(cls) -> bool:
        return hasattr(select, "epoll")

    def add(self, fd: int, drain: Callable[[], None], feed: Any = None) -> None:
        """``feed``: the ``_mirror.Feed`` the sweep drains in C while it is live, else None."""
        self._ep.register(fd, select.EPOLLIN)
        self._drains[fd] = drain
        if feed is not None:
            self._feeds[fd] = feed

    def remove(self, fd: int) -> None:
        self._feeds.pop(fd, None)
        if self._drains.pop(fd, None) is not None:
            with contextlib.suppress(OSError, ValueError):
                self._ep.unregister(fd)

    def close(self) -> None:
        if self._sweep_at is not None:
            self._sweep_at.cancel()
        else:
            self._loop.remove_reader(self._ep.fileno())
        self._ep.close()
        self._drains.clear()
        self._feeds.clear()

    def _woken(self) -> None:
        self._loop.remove_reader(self._ep.fileno())
        self._sweep_at = self._loop.call_later(self.interval, self._sweep)

    def _sweep(self) -> None:
        self.sweeps += 1
        ready = self._ep.poll(0)
        slow = [fd for fd, _ in ready]
        if self._feeds and ready:
            try:
                slow = sweep(ready, self._feeds, self._clock())
            except Exception:   # the sweep itself failed: every ready feed drains in Python this time
                log.exception("KV events: the native sweep failed")
        for fd in slow:
            drain = self._drains.get(fd)
            if drain is None:
                continue
            try:
                drain()
            except Exception:   # one feed's failure must not end the others' wake-ups
                log.exception("KV events: a feed's drain failed")
        if ready:   # busy: the next sweep is due anyway
            self._sweep_at = self._loop.call_later(self.interval, self._sweep)
        else:       # quiet: wait for the next news
            self._sweep_at = None
            self._loop.add_reader(self._ep.fileno(), self._woken)
