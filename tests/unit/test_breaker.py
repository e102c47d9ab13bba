"""Per-engine circuit breaker: closed → open → half-open (one trial) → closed or open again."""

from __future__ import annotations

from coordinator.pipeline.engines.breaker import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(failures: int = 3, cooldown: float = 10.0) -> tuple[CircuitBreaker, Clock]:
    clock = Clock()
    return CircuitBreaker(failures, cooldown, clock), clock


def test_starts_closed_and_lets_every_request_through() -> None:
    b, _ = make()
    for _ in range(5):
        assert b.state == "closed" and b.available()
        b.on_pick()   # picks while closed claim nothing


def test_opens_after_consecutive_failures_only() -> None:
    b, _ = make(failures=3)
    b.record_failure()
    b.record_failure()
    b.record_success()          # breaks the run
    b.record_failure()
    b.record_failure()
    assert b.state == "closed" and b.available()
    b.record_failure()
    assert b.state == "open" and not b.available()


def test_half_open_after_cooldown_admits_exactly_one_trial() -> None:
    b, clock = make(failures=1, cooldown=10.0)
    b.record_failure()
    clock.now += 9.9
    assert b.state == "open" and not b.available()
    clock.now += 0.1
    assert b.state == "half_open" and b.available()
    b.on_pick()
    assert b.state == "half_open" and not b.available()   # the trial is out; nobody else


def test_trial_success_closes() -> None:
    b, clock = make(failures=2, cooldown=5.0)
    b.record_failure()
    b.record_failure()
    clock.now += 5.0
    b.on_pick()
    b.record_success()
    assert b.state == "closed" and b.available()
    b.record_failure()           # the count started over
    assert b.state == "closed"


def test_trial_failure_reopens_for_a_full_cooldown() -> None:
    b, clock = make(failures=3, cooldown=5.0)
    for _ in range(3):
        b.record_failure()
    clock.now += 5.0
    b.on_pick()
    b.record_failure()           # one failed trial is enough
    assert b.state == "open" and not b.available()
    clock.now += 4.9
    assert b.state == "open"
    clock.now += 0.1
    assert b.state == "half_open" and b.available()


def test_released_trial_lets_another_request_try() -> None:
    b, clock = make(failures=1, cooldown=1.0)
    b.record_failure()
    clock.now += 1.0
    b.on_pick()
    assert not b.available()
    b.release_trial()
    assert b.state == "half_open" and b.available()
