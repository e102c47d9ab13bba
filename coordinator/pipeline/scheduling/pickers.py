"""Pickers: choose one engine from the scored list."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Protocol

from coordinator.pipeline.engines.registry import Engine


class Picker(Protocol):
    name: str

    def __call__(self, engines: Sequence[Engine], scores: Sequence[float]) -> Engine: ...


class MaxScorePicker:
    """Highest score; ties go round-robin so equal engines share the load instead of the first one
    taking everything."""

    name = "max_score"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def __call__(self, engines: Sequence[Engine], scores: Sequence[float]) -> Engine:
        best = max(scores)
        tied = [e for e, s in zip(engines, scores, strict=True) if s >= best - 1e-9]
        return tied[next(self._turn) % len(tied)]


class RoundRobinPicker:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def __call__(self, engines: Sequence[Engine], scores: Sequence[float]) -> Engine:
        return engines[next(self._turn) % len(engines)]


class RandomPicker:
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def __call__(self, engines: Sequence[Engine], scores: Sequence[float]) -> Engine:
        return self._rng.choice(list(engines))


PICKERS: dict[str, type[MaxScorePicker | RoundRobinPicker | RandomPicker]] = {
    p.name: p for p in (MaxScorePicker, RoundRobinPicker, RandomPicker)
}
