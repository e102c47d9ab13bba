"""Per-engine circuit breaker (closed → open → half-open → closed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """Consecutive failures open it; after ``cooldown_s`` one trial request may pass (half-open); its
    success closes the breaker, its failure re-opens it for another cooldown."""

    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._threshold = failures
        self._cooldown = cooldown_s
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._trial = False

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return "closed"
        if self._trial or self._clock() - self._opened_at >= self._cooldown:
            return "half_open"
        return "open"

    def available(self) -> bool:
        """May a request be sent now? (Pure; ``on_pick`` claims the half-open trial.)"""
        state = self.state
        return state == "closed" or (state == "half_open" and not self._trial)

    def on_pick(self) -> None:
        if self._opened_at is not None:
            self._trial = True

    def record_success(self) -> None:
        self._failures = 0
        self._opened_at = None
        self._trial = False

    def record_failure(self) -> None:
        self._failures += 1
        if self._trial or self._failures >= self._threshold:
            self._opened_at = self._clock()
        self._trial = False

    def release_trial(self) -> None:
        """The trial ended without a verdict (client left): let another request try."""
        self._trial = False
