"""The KV-event feeds' descriptors in one epoll set, swept at an interval (``scheduling.prefix.
gather_ms``; docs/scheduling.md, "Gathered wake-ups").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
from collections.abc import Callable

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
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float) -> None:
        self.interval = interval
        self.sweeps = 0
        self._loop = loop
        self._ep = select.epoll()
        self._drains: dict[int, Callable[[], None]] = {}
        self._sweep_at: asyncio.TimerHandle | None = None
        self._loop.add_reader(self._ep.fileno(), self._woken)

    @classmethod
    def available(cls) -> bool:
        return hasattr(select, "epoll")

    def add(self, fd: int, drain: Callable[[], None]) -> None:
        self._ep.register(fd, select.EPOLLIN)
        self._drains[fd] = drain

    def remove(self, fd: int) -> None:
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

    def _woken(self) -> None:
        self._loop.remove_reader(self._ep.fileno())
        self._sweep_at = self._loop.call_later(self.interval, self._sweep)

    def _sweep(self) -> None:
        self.sweeps += 1
        ready = self._ep.poll(0)
        for fd, _ in ready:
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
