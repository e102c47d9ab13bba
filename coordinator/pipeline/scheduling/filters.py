"""Filters: drop engines that must not take this request now. Each is one small callable."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from coordinator.config import FilterSettings
from coordinator.pipeline.scheduling.request import SchedRequest
from coordinator.pipeline.scheduling.types import E, EngineView, Filter


class NotTried:
    """A retry goes to an engine this request has not failed on yet."""

    name = "not_tried"

    def __call__(self, req: SchedRequest, engines: Sequence[E], tokens: int) -> list[E]:
        return [e for e in engines if e.url not in req.exclude]


class HasRoom:
    """The engine's token budget can take ``tokens`` more (admission's per-engine limit)."""

    name = "has_room"

    def __init__(self, room: Callable[[EngineView, int], bool]) -> None:
        self._room = room

    def __call__(self, req: SchedRequest, engines: Sequence[E], tokens: int) -> list[E]:
        return [e for e in engines if self._room(e, tokens)]


class QueueDepth:
    """Skip engines whose own ``/metrics`` report a long waiting queue (our count misses other
    coordinators' traffic; the engine's does not)."""

    name = "queue_depth"

    def __init__(self, max_waiting: int) -> None:
        self._max = max_waiting

    def __call__(self, req: SchedRequest, engines: Sequence[E], tokens: int) -> list[E]:
        return [e for e in engines if e.telemetry.waiting is None or e.telemetry.waiting <= self._max]


class Capable:
    """Only engines that can run what the request needs (``SchedRequest.needs``: a grammar needs a
    tokenizer on the engine, the native route needs its OpenAI API). Applied to the eligible set,
    before the breaker and budget filters: an empty result means "no engine can run this" (an
    error), never "wait for room"."""

    name = "capable"

    def __call__(self, req: SchedRequest, engines: Sequence[E], tokens: int) -> list[E]:
        if not req.needs:
            return list(engines)
        return [e for e in engines if e.can_all(req.needs)]


FILTERS: dict[str, Callable[[FilterSettings], Filter]] = {
    "queue_depth": lambda s: QueueDepth(s.max_waiting),
}
"""The filters config may name (``scheduling.filters``), each built from its own settings."""
