"""Admission control: token budgets, the priority queue, refusals, and that tokens always come back.

Engines are real ``Engine`` objects; the scheduler is a tiny least-loaded ``place`` that asks the
ledger for room exactly as the real one does, so the controller's rules are observed on their own.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import pytest

from coordinator.config import AdmissionSettings
from coordinator.observability.metrics import Metrics
from coordinator.pipeline.admission.budget import TokenLedger
from coordinator.pipeline.admission.controller import AdmissionController, Grant
from coordinator.pipeline.engines.breaker import CircuitBreaker
from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.errors import NoHealthyEngine, QueueFull, QueueTimeout
from coordinator.pipeline.scheduling.request import Placement, SchedRequest

_ids = itertools.count()


def engine(url: str, budget: int = 100, model: str | None = None) -> Engine:
    return Engine(url, "union", model, 1.0, token_budget=budget, breaker=CircuitBreaker(3, 10.0))


def req(cost: int, priority: int = 0, model: str = "m") -> SchedRequest:
    """A request whose cost (prompt + max_tokens) is exactly ``cost``."""
    return SchedRequest(f"r{next(_ids)}", model, [1] * (cost - 1), max_tokens=1, priority=priority)


def placer(ledger: TokenLedger, engines: list[Engine]) -> Callable[[SchedRequest], Placement | None]:
    """Least-loaded engine with room; None when all are busy; NoHealthyEngine when none serves now."""

    def place(r: SchedRequest) -> Placement | None:
        eligible = [e for e in engines if e.serves(r.model) and e.healthy]
        if not eligible:
            raise NoHealthyEngine(f"no engine for {r.model}")
        room = [e for e in eligible if e.available and ledger.engine_room(e, r.cost_tokens)]
        return Placement(min(room, key=lambda e: e.inflight_tokens)) if room else None

    return place


def make(global_limit: int | None = None, metrics: Metrics | None = None,
         **settings: object) -> tuple[AdmissionController, TokenLedger]:
    ledger = TokenLedger(global_limit)
    return AdmissionController(AdmissionSettings(**settings), ledger, metrics, tick_s=0.02), ledger


async def settle() -> None:
    """Let scheduled callbacks (the wake after a release) and woken tasks run."""
    for _ in range(5):
        await asyncio.sleep(0)


def assert_idle(ctl: AdmissionController, ledger: TokenLedger, *engines: Engine) -> None:
    assert [(e.inflight_tokens, e.inflight_requests) for e in engines] == [(0, 0)] * len(engines)
    assert ledger.global_inflight == 0
    assert ctl.queue_length == 0


def wake_tasks() -> list[asyncio.Task[object]]:
    """The periodic wake task, if one is running (there must be none while nobody waits)."""
    return [t for t in asyncio.all_tasks() if t.get_name() == "admission-wake" and not t.done()]


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


# -- fast path ------------------------------------------------------------------------------------

async def test_fast_path_reserves_without_suspending() -> None:
    ctl, ledger = make()
    e1, e2 = engine("http://e1"), engine("http://e2")
    place = placer(ledger, [e1, e2])
    coro = ctl.admit(req(40), place)
    with pytest.raises(StopIteration) as done:   # finished on its first step: it never awaited
        coro.send(None)
    grant: Grant = done.value.value
    assert grant.placement.engine is e1
    assert (e1.inflight_tokens, e1.inflight_requests, ledger.global_inflight) == (40, 1, 40)
    second = await ctl.admit(req(30), place)
    assert second.placement.engine is e2          # the scheduler saw the first reservation
    grant.release()
    second.release()
    assert_idle(ctl, ledger, e1, e2)


# -- waiting and waking ---------------------------------------------------------------------------

async def test_waits_when_full_and_is_admitted_on_release() -> None:
    ctl, ledger = make()
    e = engine("http://e", budget=100)
    place = placer(ledger, [e])
    holder = await ctl.admit(req(60), place)
    waiter = asyncio.create_task(ctl.admit(req(60), place))
    await settle()
    assert not waiter.done() and ctl.queue_length == 1
    assert e.inflight_tokens == 60                # nothing reserved for the waiter yet
    holder.release()
    await settle()
    grant = waiter.result()
    assert grant.placement.engine is e and e.inflight_tokens == 60 and ctl.queue_length == 0
    grant.release()
    assert_idle(ctl, ledger, e)


async def admission_order(ctl: AdmissionController, place: Callable[[SchedRequest], Placement | None],
                          holder: Grant, priorities: list[tuple[str, int]]) -> list[str]:
    """Queue one full-engine request per (name, priority), then free the engine one at a time."""
    tasks = {}
    for name, prio in priorities:
        tasks[name] = asyncio.create_task(ctl.admit(req(100, prio), place))
        await settle()
    assert ctl.queue_length == len(priorities)
    order: list[str] = []
    current = holder
    while len(order) < len(priorities):
        current.release()
        await settle()
        ready = [n for n, t in tasks.items() if t.done() and n not in order]
        assert len(ready) == 1                   # one full-engine request at a time
        order.append(ready[0])
        current = tasks[ready[0]].result()
    current.release()
    return order


async def test_lower_priority_number_is_admitted_first() -> None:
    ctl, ledger = make()
    e = engine("http://e", budget=100)
    place = placer(ledger, [e])
    holder = await ctl.admit(req(100), place)
    order = await admission_order(ctl, place, holder, [("low", 5), ("high", -1), ("mid", 1)])
    assert order == ["high", "mid", "low"]
    assert_idle(ctl, ledger, e)


async def test_fifo_within_a_priority() -> None:
    ctl, ledger = make()
    e = engine("http://e", budget=100)
    place = placer(ledger, [e])
    holder = await ctl.admit(req(100), place)
    order = await admission_order(ctl, place, holder, [("a", 0), ("b", 0), ("c", 0), ("d", 0)])
    assert order == ["a", "b", "c", "d"]
    assert_idle(ctl, ledger, e)


async def test_newcomer_does_not_overtake_an_equal_priority_waiter() -> None:
    ctl, ledger = make()
    e = engine("http://e", budget=100)
    place = placer(ledger, [e])
    holder = await ctl.admit(req(100), place)
    first = asyncio.create_task(ctl.admit(req(100), place))
    await settle()
    holder.reservation.release()                  # room appears without a wake (as a breaker closing)
    late = asyncio.create_task(ctl.admit(req(100), place))   # ... just when a newcomer arrives
    await settle()
    assert first.done() and not late.done()
    first.result().release()
    await settle()
    late.result().release()
    assert_idle(ctl, ledger, e)


# -- refusals -------------------------------------------------------------------------------------

async def test_queue_full_is_refused_at_once_with_retry_after() -> None:
    metrics = Metrics()
    ctl, ledger = make(metrics=metrics, max_queue=2, retry_after_s=7)
    e = engine("http://e", budget=100)
    place = placer(ledger, [e])
    holder = await ctl.admit(req(100), place)
    waiters = [asyncio.create_task(ctl.admit(req(10), place)) for _ in range(2)]
    await settle()
    coro = ctl.admit(req(10), place)
    with pytest.raises(QueueFull) as refused:     # raised on the first step: no waiting at all
        coro.send(None)
    assert (refused.value.status, refused.value.retry_after) == (429, 7)
    assert ctl.queue_length == 2
    assert sample(metrics, "coordinator_rejected_total", reason="queue_full") == 1
    holder.release()
    await settle()
    for t in waiters:
        t.result().release()
    assert_idle(ctl, ledger, e)


async def test_queue_timeout_gives_503_and_leaves_nothing_behind() -> None:
    metrics = Metrics()
    ctl, ledger = make(metrics=metrics, queue_timeout_s=0.05, retry_after_s=3)
    e = engine("http://e", budget=100)
    place = placer(ledger, [e])
    holder = await ctl.admit(req(100), place)
    with pytest.raises(QueueTimeout) as timed_out:
        await ctl.admit(req(50), place)
    assert (timed_out.value.status, timed_out.value.retry_after) == (503, 3)
    assert ctl.queue_length == 0 and e.inflight_tokens == 100
    assert sample(metrics, "coordinator_rejected_total", reason="queue_timeout") == 1
    holder.release()
    await settle()
    assert_idle(ctl, ledger, e)


async def test_cancelled_waiter_is_removed_and_reserves_nothing() -> None:
    metrics = Metrics()
    ctl, ledger = make(metrics=metrics)
    e = engine("http://e", budget=100)
    place = placer(ledger, [e])
    holder = await ctl.admit(req(100), place)
    waiter = asyncio.create_task(ctl.admit(req(50), place))
    await settle()
    assert ctl.queue_length == 1
    assert wake_tasks()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert ctl.queue_length == 0
    await asyncio.sleep(0)
    assert not wake_tasks()                       # idle again: no periodic wake left running
    holder.release()
    await settle()
    assert_idle(ctl, ledger, e)
    assert sample(metrics, "coordinator_rejected_total", reason="cancelled") == 1


async def test_cancelled_just_after_admission_gives_the_tokens_back() -> None:
    ctl, ledger = make()
    e = engine("http://e", budget=100)
    place = placer(ledger, [e])
    holder = await ctl.admit(req(100), place)
    waiter = asyncio.create_task(ctl.admit(req(50), place))
    await settle()
    holder.release()
    ctl.wake()                                    # admitted: tokens reserved, task not resumed yet
    assert e.inflight_tokens == 50
    waiter.cancel()                               # the client leaves in that same instant
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert_idle(ctl, ledger, e)


async def test_no_healthy_engine_fails_a_waiter() -> None:
    metrics = Metrics()
    ctl, ledger = make(metrics=metrics)
    e = engine("http://e", budget=100)
    place = placer(ledger, [e])
    holder = await ctl.admit(req(100), place)
    waiter = asyncio.create_task(ctl.admit(req(50), place))
    await settle()
    e.probe_ok = False                         # no release: the periodic wake notices
    with pytest.raises(NoHealthyEngine):
        await asyncio.wait_for(waiter, 2.0)
    assert ctl.queue_length == 0
    assert sample(metrics, "coordinator_rejected_total", reason="no_engine") == 1
    with pytest.raises(NoHealthyEngine):          # and on the fast path it propagates as is
        await ctl.admit(req(10), place)
    assert sample(metrics, "coordinator_rejected_total", reason="no_engine") == 2
    holder.release()
    assert_idle(ctl, ledger, e)


async def test_periodic_wake_admits_when_a_breaker_closes_without_any_release() -> None:
    ctl, ledger = make()
    e1, e2 = engine("http://e1", budget=100), engine("http://e2", budget=100)
    for _ in range(3):
        e2.breaker.record_failure()               # e2 open: not available
    place = placer(ledger, [e1, e2])
    holder = await ctl.admit(req(100), place)
    waiter = asyncio.create_task(ctl.admit(req(50), place))
    await settle()
    assert not waiter.done()
    e2.breaker.record_success()
    grant = await asyncio.wait_for(waiter, 2.0)
    assert grant.placement.engine is e2
    await settle()
    assert not wake_tasks()
    grant.release()
    holder.release()
    assert_idle(ctl, ledger, e1, e2)


# -- budgets --------------------------------------------------------------------------------------

async def test_oversized_request_runs_alone() -> None:
    ctl, ledger = make(global_limit=150)
    e = engine("http://e", budget=100)
    place = placer(ledger, [e])
    big = await ctl.admit(req(500), place)        # larger than both budgets, yet the engine is idle
    assert big.placement.engine is e and e.inflight_tokens == 500
    small = asyncio.create_task(ctl.admit(req(10), place))
    await settle()
    assert not small.done()                       # nothing else shares the engine with it
    big.release()
    await settle()
    small.result().release()
    assert_idle(ctl, ledger, e)


async def test_release_is_idempotent_on_every_path() -> None:
    ctl, ledger = make()
    e = engine("http://e", budget=100)
    place = placer(ledger, [e])
    other = await ctl.admit(req(30), place)
    grant = await ctl.admit(req(30), place)
    with pytest.raises(RuntimeError), grant:
        raise RuntimeError("engine stream broke")
    assert grant.released and (e.inflight_tokens, e.inflight_requests, ledger.global_inflight) == (30, 1, 30)
    grant.release()
    grant.release_engine(e)
    assert (e.inflight_tokens, e.inflight_requests, ledger.global_inflight) == (30, 1, 30)
    with other:
        pass
    other.release()
    assert_idle(ctl, ledger, e)


async def test_prefill_share_is_released_early_and_wakes_a_waiter() -> None:
    ctl, ledger = make()
    pre, dec = engine("http://pre", budget=100, model="p"), engine("http://dec", budget=1000)
    r = req(150)
    grant = await ctl.admit(r, lambda _r: Placement(dec, prefill=pre),
                            prefill_tokens=lambda _p: r.prompt_tokens + 1)
    assert (pre.inflight_tokens, dec.inflight_tokens, ledger.global_inflight) == (150, 150, 150)
    assert (pre.inflight_requests, dec.inflight_requests) == (1, 1)
    waiter = asyncio.create_task(ctl.admit(req(80, model="p"), placer(ledger, [pre])))
    await settle()
    assert not waiter.done()
    grant.release_engine(pre)
    assert (pre.inflight_tokens, pre.inflight_requests, dec.inflight_tokens, ledger.global_inflight) == (0, 0, 150, 150)
    await settle()
    waiting_grant = waiter.result()
    grant.release_engine(pre)                     # again: nothing changes
    assert (pre.inflight_tokens, dec.inflight_tokens) == (80, 150)
    grant.release_engine(dec)                     # the last share: the global one goes with it
    assert (dec.inflight_tokens, ledger.global_inflight) == (0, 80)
    grant.release()
    waiting_grant.release()
    assert_idle(ctl, ledger, pre, dec)


async def test_global_limit_holds_across_engines_and_keeps_priority_order() -> None:
    ctl, ledger = make(global_limit=120)
    e1, e2 = engine("http://e1", budget=100), engine("http://e2", budget=100)
    place = placer(ledger, [e1, e2])
    first = await ctl.admit(req(100), place)
    big = asyncio.create_task(ctl.admit(req(50), place))   # e2 is free, but 150 > 120 globally
    await settle()
    small = asyncio.create_task(ctl.admit(req(10), place))  # fits (110), but must not overtake
    await settle()
    assert not big.done() and not small.done() and e2.inflight_tokens == 0
    first.release()
    await settle()
    assert big.done() and small.done()
    big.result().release()
    small.result().release()
    assert_idle(ctl, ledger, e1, e2)


async def test_other_model_is_admitted_while_one_models_engines_are_full() -> None:
    ctl, ledger = make()
    ea, eb = engine("http://a", budget=100, model="a"), engine("http://b", budget=100, model="b")
    place = placer(ledger, [ea, eb])
    hold_a = await ctl.admit(req(100, model="a"), place)
    hold_b = await ctl.admit(req(100, model="b"), place)
    wait_a = asyncio.create_task(ctl.admit(req(50, model="a"), place))
    await settle()
    wait_b = asyncio.create_task(ctl.admit(req(50, model="b"), place))   # queued behind wait_a
    await settle()
    assert ctl.queue_length == 2
    hold_b.release()
    await settle()
    assert wait_b.done() and not wait_a.done()
    assert wait_b.result().placement.engine is eb
    late_b = await asyncio.wait_for(ctl.admit(req(50, model="b"), place), 1.0)  # passes wait_a at once
    assert late_b.placement.engine is eb and ctl.queue_length == 1
    hold_a.release()
    await settle()
    for g in (wait_a.result(), wait_b.result(), late_b):
        g.release()
    assert_idle(ctl, ledger, ea, eb)


async def test_disabled_admission_never_queues_but_still_counts_load() -> None:
    ctl, ledger = make(global_limit=50, enabled=False)
    e = engine("http://e", budget=100)
    place = placer(ledger, [e])
    grants = [await ctl.admit(req(100), place) for _ in range(3)]
    assert (e.inflight_tokens, e.inflight_requests, ledger.global_inflight) == (300, 3, 300)
    for _ in range(3):
        e.breaker.record_failure()                # breaker open: place() finds no engine
    with pytest.raises(QueueFull):                # no engine now: it cannot wait either
        await ctl.admit(req(10), place)
    assert ctl.queue_length == 0
    for g in grants:
        g.release()
    assert_idle(ctl, ledger, e)


# -- metrics --------------------------------------------------------------------------------------

async def test_metrics_follow_admissions_and_the_queue() -> None:
    metrics = Metrics()
    ctl, ledger = make(metrics=metrics, queue_timeout_s=0.05)
    e = engine("http://e", budget=100)
    place = placer(ledger, [e])
    holder = await ctl.admit(req(70), place)
    assert sample(metrics, "coordinator_inflight_tokens") == 70
    with pytest.raises(QueueTimeout):
        await ctl.admit(req(60), place)
    assert sample(metrics, "coordinator_queue_length") == 0
    waiter = asyncio.create_task(ctl.admit(req(60), place))
    await settle()
    assert sample(metrics, "coordinator_queue_length") == 1
    holder.release()
    await settle()
    grant = waiter.result()
    assert sample(metrics, "coordinator_queue_length") == 0
    assert sample(metrics, "coordinator_inflight_tokens") == 60
    assert sample(metrics, "coordinator_admitted_total") == 2
    assert sample(metrics, "coordinator_queue_wait_seconds_count") == 2
    assert sample(metrics, "coordinator_queue_wait_seconds_sum") > 0
    assert sample(metrics, "coordinator_rejected_total", reason="queue_timeout") == 1
    grant.release()
    assert sample(metrics, "coordinator_inflight_tokens") == 0
    assert_idle(ctl, ledger, e)


# -- the fleet: other coordinator processes on the same engines -------------------------------------

class OtherProcesses:
    """A fleet as the ledger sees one (``admission/fleet.py``): what the other processes hold, and a
    verdict per claim. The Redis implementation of these answers is tested on a real server
    (tests/integration/test_fleet_redis.py); here the controller's reaction to them is."""

    def __init__(self, others: dict[str, int] | None = None, verdicts: list[bool] | None = None) -> None:
        self.held = others or {}
        self.verdicts = verdicts or []
        self.claims: list[list[object]] = []
        self.published: list[dict[str, int]] = []
        self.shared = True
        self.degraded = False
        self.scale = 1.0

    def others(self, key: str) -> int:
        return self.held.get(key, 0)

    async def claim(self, slots: list[object]) -> bool:
        self.claims.append(slots)
        return self.verdicts.pop(0) if self.verdicts else True

    def publish(self, totals: dict[str, int]) -> None:
        self.published.append(dict(totals))

    async def start(self, totals: object, on_change: object) -> None:
        return None

    async def aclose(self) -> None:
        return None


def test_room_counts_what_other_processes_hold() -> None:
    from coordinator.pipeline.admission.fleet import GLOBAL

    fleet = OtherProcesses({"http://a": 70, GLOBAL: 150})
    ledger = TokenLedger(200, fleet=fleet)  # type: ignore[arg-type]
    a = engine("http://a")
    assert ledger.engine_room(a, 30) and not ledger.engine_room(a, 31)
    assert ledger.global_room(50) and not ledger.global_room(51)
    fleet.held.clear()
    fleet.degraded, fleet.scale = True, 0.5  # Redis down, 2 replicas expected: half of each budget
    assert ledger.engine_room(a, 50) and ledger.engine_room(a, 400)  # idle: one oversized request runs
    held = ledger.reserve(Placement(a), 10)
    assert ledger.engine_room(a, 40) and not ledger.engine_room(a, 41)
    assert ledger.global_room(90) and not ledger.global_room(91)
    held.release()
    assert fleet.published[-1] == {"http://a": 0, GLOBAL: 0}


async def test_a_claim_another_process_won_waits_and_holds_nothing_meanwhile() -> None:
    fleet = OtherProcesses(verdicts=[False])
    ledger = TokenLedger(None, fleet=fleet)  # type: ignore[arg-type]
    ctl = AdmissionController(AdmissionSettings(), ledger, tick_s=0.02)
    a = engine("http://a")
    task = asyncio.create_task(ctl.admit(req(40), placer(ledger, [a])))
    await settle()
    assert not task.done() and ctl.queue_length == 1
    assert (a.inflight_tokens, ledger.global_inflight) == (0, 0), "a refused claim keeps nothing locally"
    assert fleet.published[-1] == {"http://a": 0, "": 0}, "and says so to the fleet"
    grant = await asyncio.wait_for(task, 2)  # the periodic wake retries; the second claim is taken
    assert len(fleet.claims) == 2 and a.inflight_tokens == 40
    first = fleet.claims[0]
    assert [(s.key, s.own, s.delta) for s in first] == [("http://a", 40, 40), ("", 40, 40)]  # type: ignore[attr-defined]
    grant.release()
    assert fleet.published[-1] == {"http://a": 0, "": 0}
    assert_idle(ctl, ledger, a)
    await ctl.close()


async def test_an_engine_reporting_a_full_kv_cache_takes_nothing_more_until_it_reports_less() -> None:
    """The counts say there is room, the engine's own /metrics say its KV cache is full (someone the
    coordinator does not know of uses it): the request waits, and goes when the engine reports less."""
    ledger = TokenLedger(None, kv_usage_limit=0.95)
    ctl = AdmissionController(AdmissionSettings(), ledger, tick_s=0.02)
    e = engine("http://e", budget=1000)
    place = placer(ledger, [e])
    first = await ctl.admit(req(10), place)  # an idle engine takes one whatever it reports
    e.telemetry.kv_usage = 0.97
    second = asyncio.create_task(ctl.admit(req(10), place))
    await asyncio.sleep(0.1)
    assert not second.done() and e.inflight_tokens == 10
    e.telemetry.kv_usage = 0.5  # the next scrape: the tick admits it without any release
    grant = await asyncio.wait_for(second, 5)
    assert e.inflight_tokens == 20
    first.release()
    grant.release()
    assert_idle(ctl, ledger, e)
