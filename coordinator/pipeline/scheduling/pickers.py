"""Pickers: choose one engine from the scored list."""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from coordinator.pipeline.scheduling.types import E, EngineView, ScoringInput


class MaxScorePicker:
    """Highest score; ties go round-robin so equal engines share the load instead of the first one
    taking everything."""

    name = "max_score"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def __call__(self, engines: Sequence[E], scores: Sequence[float], data: ScoringInput) -> E:
        best = max(scores)
        tied = [e for e, s in zip(engines, scores, strict=True) if s >= best - 1e-9]
        return tied[next(self._turn) % len(tied)]


@runtime_checkable
class Observer(Protocol):
    """A stage that learns from committed decisions (the scheduler calls it once per placement)."""

    def observe(self, engine: EngineView, data: ScoringInput) -> None: ...


class BoundedLoadPicker:
    """Highest score among engines whose share of recent decisions stays under
    ``max(factor x fair share, fair share + slack)``: consistent hashing with bounded loads.

    Why: prefix affinity alone pins each shared system prompt to the engine its first user landed on,
    for good (8 tenants on 4 engines split 3/2/2/1 as easily as 2/2/2/2), and the load scorer only
    reacts once engines are busy. The bound spreads placements over the window while leaving every
    engine that is within its share free to win on prefix. A request that *continues* its own chain
    on an engine (its match ends at a leaf: the next turn of a conversation) keeps that engine even
    over the cap: moving it costs a whole re-prefill, while moving a new conversation that only shares
    a system prompt costs that prompt once per engine. So does a LoRA request on an engine holding its
    adapter: moving it costs a load that stalls the other engine (the lora scorer spreads hot adapters
    by its own rule)."""

    name = "bounded_load"

    def __init__(self, factor: float = 1.25, slack: float = 8.0, window_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._factor, self._slack, self._window = factor, slack, window_s
        self._clock = clock
        self._recent: deque[tuple[float, str, bool]] = deque()
        self._counts: Counter[str] = Counter()    # decisions per engine in the window
        self._founded: Counter[str] = Counter()   # ... of which were cold (nothing cached anywhere)
        self._ties = MaxScorePicker()

    def __call__(self, engines: Sequence[E], scores: Sequence[float], data: ScoringInput) -> E:
        self._forget(self._clock())
        # The pod's shares when its indexer told them (every worker's decisions), else this process's.
        pod = data.pod_shares
        counts: Mapping[str, int] = pod.decisions if pod is not None else self._counts
        founded: Mapping[str, int] = pod.founded if pod is not None else self._founded
        # Shares within this pool only (another model's or role's engines have their own).
        fair = (sum(counts.get(e.url, 0) for e in engines) + 1) / len(engines)
        cap = max(self._factor * fair, fair + self._slack)
        lora = data.req.lora
        allowed = [i for i, e in enumerate(engines)
                   if counts.get(e.url, 0) + 1 <= cap or e.url in data.continuing
                   or (lora is not None and e.adapters.holds(lora))]
        if not allowed:
            return self._ties(engines, scores, data)
        if data.cold and data.req.lora is None:
            # (An adapter request's home is the engine holding its adapter: the lora scorer's call.)
            # Nothing cached anywhere: this request founds a new prefix "home" (a system prompt, a
            # tenant) that its followers will stick to. Homes are what get pinned, so spread homes:
            # the engine that founded the fewest recently, not the one with the fewest requests in
            # flight this instant (a coin flip when engines are not saturated).
            least = min(founded.get(engines[i].url, 0) for i in allowed)
            allowed = [i for i in allowed if founded.get(engines[i].url, 0) == least]
        return self._ties([engines[i] for i in allowed], [scores[i] for i in allowed], data)

    def observe(self, engine: EngineView, data: ScoringInput) -> None:
        now = self._clock()
        cold = data.cold
        self._recent.append((now, engine.url, cold))
        self._counts[engine.url] += 1
        self._founded[engine.url] += cold
        self._forget(now)

    def _forget(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self._window:
            _, url, cold = self._recent.popleft()
            self._counts[url] -= 1
            self._founded[url] -= cold


class RoundRobinPicker:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def __call__(self, engines: Sequence[E], scores: Sequence[float], data: ScoringInput) -> E:
        return engines[next(self._turn) % len(engines)]


class RandomPicker:
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def __call__(self, engines: Sequence[E], scores: Sequence[float], data: ScoringInput) -> E:
        return self._rng.choice(list(engines))


PICKERS: dict[str, type[MaxScorePicker | BoundedLoadPicker | RoundRobinPicker | RandomPicker]] = {
    p.name: p for p in (MaxScorePicker, BoundedLoadPicker, RoundRobinPicker, RandomPicker)
}
