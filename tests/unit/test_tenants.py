"""Tenants: keys name them, their per-minute limits answer as OpenAI's do, and the admission queue
shares busy engines between them by weight (weighted fair queuing on tokens).

The controller runs with real ``Engine`` objects and the same tiny placer as test_admission.py, so
what is observed is the order and amount in which tenants' waiting requests are admitted.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
from pydantic import SecretStr

from coordinator.config import AdmissionSettings, TenantLimits, TenantSettings, TenantsSettings
from coordinator.observability.metrics import Metrics
from coordinator.pipeline.admission.budget import TokenLedger
from coordinator.pipeline.admission.controller import AdmissionController, Grant
from coordinator.pipeline.admission.rate_limits import LocalBuckets, TenantLimiter, reset_text
from coordinator.pipeline.admission.tenants import Tenant, TenantDirectory
from coordinator.pipeline.errors import QueueFull, RateLimited, Unauthorized
from coordinator.pipeline.scheduling.request import SchedRequest
from tests.unit.test_admission import engine, placer, settle

_ids = itertools.count()


def tenants(**members: dict[str, object]) -> TenantsSettings:
    return TenantsSettings(members=[TenantSettings(name=name, **spec) for name, spec in members.items()])


# -- keys → tenants ---------------------------------------------------------------------------------

def test_a_key_names_its_tenant_and_server_keys_are_the_default_tenant() -> None:
    d = TenantDirectory(tenants(a={"api_keys": [SecretStr("ka")], "weight": 2.0}), [SecretStr("server")])
    assert d.authenticate("Bearer ka").name == "a" and d.authenticate("Bearer ka").weight == 2.0
    assert d.authenticate("bearer server").name == "default"
    for bad in (None, "Bearer nope", "Basic ka", "Bearer", ""):
        with pytest.raises(Unauthorized):
            d.authenticate(bad)


def test_without_any_key_every_request_is_the_default_tenant() -> None:
    d = TenantDirectory(TenantsSettings(default=TenantLimits(requests_per_minute=5)))
    assert not d.auth_enabled
    assert d.authenticate(None) == Tenant("default", requests_per_minute=5)
    assert d.authenticate("Bearer anything").name == "default"


def test_two_tenants_may_not_share_a_key() -> None:
    with pytest.raises(ValueError, match="API key belongs to two tenants"):
        tenants(a={"api_keys": [SecretStr("k")]}, b={"api_keys": [SecretStr("k")]})


def test_the_tenants_file_adds_and_revokes_keys_and_a_broken_file_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text("members:\n  - name: c\n    api_keys: [kc]\n    tokens_per_minute: 900\n")
    settings = tenants(a={"api_keys": [SecretStr("ka")]})
    settings.file = str(path)
    d = TenantDirectory(settings)
    assert d.authenticate("Bearer kc") == Tenant("c", tokens_per_minute=900)

    path.write_text("members:\n  - name: c\n    api_keys: [kc2]\n")
    bump(path)
    assert d.reload()
    assert d.authenticate("Bearer kc2").name == "c"
    with pytest.raises(Unauthorized):
        d.authenticate("Bearer kc")  # revoked

    for broken in ("members: [ {name: c, api_keys: [kc3]", "members:\n  - name: c\n    wieght: 3\n",
                   "members:\n  - name: c\n    api_keys: [ka]\n"):  # bad YAML, a typo, another's key
        path.write_text(broken)
        bump(path)
        assert not d.reload()
        assert d.authenticate("Bearer kc2").name == "c" and d.authenticate("Bearer ka").name == "a"


def bump(path: Path) -> None:
    """A new modification time even within the file system's timestamp resolution."""
    stat = path.stat()
    import os
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


# -- requests and tokens per minute -----------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_requests_per_minute_refuse_with_retry_after_and_openai_headers() -> None:
    clock = Clock()
    limiter = TenantLimiter(LocalBuckets(clock=clock))
    t = Tenant("a", requests_per_minute=3)
    seen = [await limiter.requests(t) for _ in range(3)]
    assert [h["x-ratelimit-remaining-requests"] for h in seen] == ["2", "1", "0"]
    assert seen[0]["x-ratelimit-limit-requests"] == "3" and seen[0]["x-ratelimit-reset-requests"] == "20s"
    with pytest.raises(RateLimited) as refused:
        await limiter.requests(t)
    exc = refused.value
    assert exc.status == 429 and exc.type == "RateLimitError" and exc.retry_after == 20
    assert exc.headers is not None and exc.headers["retry-after-ms"] == "20000"
    assert exc.headers["x-ratelimit-remaining-requests"] == "0"
    assert "requests per minute" in exc.message
    clock.now += 20.0  # one request's worth refilled
    assert (await limiter.requests(t))["x-ratelimit-remaining-requests"] == "0"
    other = Tenant("b", requests_per_minute=3)  # each tenant has its own bucket
    assert (await limiter.requests(other))["x-ratelimit-remaining-requests"] == "2"


async def test_tokens_per_minute_count_what_is_asked_and_a_request_over_the_limit_is_told_so() -> None:
    clock = Clock()
    limiter = TenantLimiter(LocalBuckets(clock=clock))
    t = Tenant("a", tokens_per_minute=600)
    assert (await limiter.tokens(t, 500))["x-ratelimit-remaining-tokens"] == "100"
    with pytest.raises(RateLimited) as refused:
        await limiter.tokens(t, 200)
    assert refused.value.retry_after == 10  # 100 more tokens at 10 tokens/s
    with pytest.raises(RateLimited, match="Request too large") as too_large:
        await limiter.tokens(t, 601)
    assert too_large.value.retry_after is None  # waiting never helps
    assert await limiter.tokens(Tenant("free"), 10**9) == {}  # no limit, no headers


def test_reset_durations_are_written_as_openai_writes_them() -> None:
    assert [reset_text(s) for s in (0.0, 0.0201, 1.5, 20.0, 360.0, 61.25)] == \
        ["0ms", "21ms", "1.5s", "20s", "6m0s", "1m1.25s"]


# -- fair shares ------------------------------------------------------------------------------------

def req(tenant: str, cost: int = 10, priority: int = 0) -> SchedRequest:
    return SchedRequest(f"r{next(_ids)}", "m", [1] * (cost - 1), max_tokens=1, priority=priority, tenant=tenant)


def controller(weights: dict[str, float] | None = None, limits: dict[str, int] | None = None,
               metrics: Metrics | None = None, **settings: object
               ) -> tuple[AdmissionController, TokenLedger]:
    weights, limits = weights or {}, limits or {}
    ledger = TokenLedger(None, tenant_limit=lambda t: limits.get(t))
    ctl = AdmissionController(AdmissionSettings(**settings), ledger, metrics, tick_s=0.02,
                              weight=lambda t: weights.get(t, 1.0))
    return ctl, ledger


async def run_backlogged(ctl: AdmissionController, ledger: TokenLedger, backlog: dict[str, int],
                         grants: int) -> list[str]:
    """One engine fits ten 10-token requests; tenant A fills it, then every tenant queues ``backlog``
    requests (A first). Release one grant at a time; the tenants of the next ``grants`` admitted."""
    e = engine("http://e", budget=100)
    place = placer(ledger, [e])
    held: list[Grant] = [await ctl.admit(req("A"), place) for _ in range(10)]
    order: list[str] = []
    waiting: list[asyncio.Task[Grant]] = []
    for tenant, n in backlog.items():
        for _ in range(n):
            task = asyncio.create_task(ctl.admit(req(tenant), place))
            task.add_done_callback(lambda t, name=tenant: order.append(name) if not t.cancelled() else None)
            waiting.append(task)
            await asyncio.sleep(0)
    await settle()
    assert order == [] and ctl.queue_length == sum(backlog.values())
    while len(order) < grants:
        held.pop(0).release()
        await settle()
        held.extend(t.result() for t in waiting if t.done() and t.result() not in held and not t.result().released)
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    for g in held:
        g.release()
    return order[:grants]


async def test_a_light_tenant_goes_ahead_of_a_heavy_tenants_backlog() -> None:
    """B queues behind 30 of A's requests; with equal weights B's 5 are admitted within the first 10
    grants, alternating with A's, instead of after all 30."""
    ctl, ledger = controller()
    order = await run_backlogged(ctl, ledger, {"A": 30, "B": 5}, grants=10)
    assert order.count("B") == 5, order
    # A already holds the engine: B's first request goes first, and its second too (its tag ties with
    # A's next one, and ties go to the tenant holding less).
    assert order[:3] == ["B", "B", "A"], order


async def test_busy_tenants_share_admitted_tokens_by_weight() -> None:
    ctl, ledger = controller(weights={"A": 3.0, "B": 1.0})
    order = await run_backlogged(ctl, ledger, {"A": 60, "B": 60}, grants=40)
    assert 28 <= order.count("A") <= 32, order  # 3 : 1 of 40


async def test_one_tenant_keeps_plain_priority_order() -> None:
    ctl, ledger = controller()
    e = engine("http://e", budget=10)
    place = placer(ledger, [e])
    first = await ctl.admit(req("A"), place)
    order: list[int] = []
    tasks = []
    for priority in (5, 1, 3):
        r = req("A", priority=priority)
        task = asyncio.create_task(ctl.admit(r, place))
        task.add_done_callback(lambda _, p=priority: order.append(p))
        tasks.append(task)
        await asyncio.sleep(0)
    first.release()
    for _ in range(3):
        await settle()
        for t in tasks:
            if t.done() and not t.result().released:
                t.result().release()
    assert order == [1, 3, 5]


async def test_concurrent_tokens_hold_a_tenant_back_while_others_pass() -> None:
    ctl, ledger = controller(limits={"A": 30})
    e = engine("http://e", budget=1000)
    place = placer(ledger, [e])
    a = [await ctl.admit(req("A"), place) for _ in range(3)]
    fourth = asyncio.create_task(ctl.admit(req("A"), place))
    await settle()
    assert not fourth.done() and ledger.tenant_inflight("A") == 30
    b = await ctl.admit(req("B"), place)  # the engine has room and B has no limit: no wait
    a[0].release()
    await settle()
    assert fourth.done() and ledger.tenant_inflight("A") == 30
    for g in [*a, b, fourth.result()]:
        g.release()
    assert ledger.tenant_inflight("A") == 0 and ledger.global_inflight == 0 and e.inflight_tokens == 0


async def test_a_full_queue_gives_a_tenant_under_its_share_the_newest_place_of_the_one_over_it() -> None:
    metrics = Metrics()
    ctl, ledger = controller(metrics=metrics, max_queue=4)
    e = engine("http://e", budget=10)
    place = placer(ledger, [e])
    held = await ctl.admit(req("A"), place)
    a = [asyncio.create_task(ctl.admit(req("A"), place)) for _ in range(4)]
    await settle()
    with pytest.raises(QueueFull):  # A is at its whole share already
        await ctl.admit(req("A"), place)
    b = [asyncio.create_task(ctl.admit(req("B"), place)) for _ in range(2)]
    await settle()
    assert [t.done() for t in a] == [False, False, True, True]  # A's two newest gave their places
    assert all(isinstance(t.exception(), QueueFull) for t in a[2:])
    assert ctl.queue_length == 4 and ctl.tenant_queue_length("B") == 2
    with pytest.raises(QueueFull):  # B holds its share (2 of 4) now
        ctl.check_early(0, "B")
    assert metrics.registry.get_sample_value("coordinator_tenant_rejected_total",
                                             {"tenant": "A", "reason": "queue_full"}) == 3.0
    for t in [*a[:2], *b]:
        t.cancel()
    await asyncio.gather(*a, *b, return_exceptions=True)
    held.release()
    assert ctl.queue_length == 0 and ledger.global_inflight == 0


def test_fair_allocation_gives_small_demands_in_full_and_splits_the_rest_by_weight() -> None:
    from coordinator.pipeline.admission.shares import fair_allocation

    equal = fair_allocation({"A": 1000, "B": 100, "idle": 0}, lambda t: 1.0, 600)
    assert equal == {"A": 500.0, "B": 100.0}
    weighted = fair_allocation({"A": 1000, "B": 1000}, {"A": 3.0, "B": 1.0}.__getitem__, 400)
    assert weighted == {"A": 300.0, "B": 100.0}
    assert fair_allocation({"A": 50, "B": 60}, lambda t: 1.0, 400) == {"A": 50.0, "B": 60.0}


async def test_headroom_lets_a_light_tenant_start_at_once_next_to_a_heavy_backlog() -> None:
    """A keeps the engine full and a backlog waiting. Without headroom B's request waits for A's
    next release; with it, A (over its share) leaves one B-sized request of room and B starts at
    once, while A still gets every other token."""
    for window, b_waits in ((None, True), (10.0, False)):
        ledger = TokenLedger(None)
        e = engine("http://e", budget=100)
        ctl = AdmissionController(AdmissionSettings(), ledger, tick_s=0.02, headroom_window_s=window,
                                  capacity=lambda: 100, engines=lambda e=e: [e])
        place = placer(ledger, [e])
        first_b = await ctl.admit(req("B"), place)  # B has been seen: two tenants are active
        first_b.release()
        held = [await ctl.admit(req("A"), place) for _ in range(9)]
        backlog = [asyncio.create_task(ctl.admit(req("A"), place)) for _ in range(5)]
        await settle()
        # With headroom, A (90 of a 50-token share) stops at 90: one B request of room stays free.
        assert e.inflight_tokens == (100 if window is None else 90)
        b = asyncio.create_task(ctl.admit(req("B"), place))
        await settle()
        assert b.done() is not b_waits
        held[0].release()
        await settle()
        assert b.done()
        for g in held[1:]:
            g.release()
        b.result().release()
        for _ in range(3):
            await settle()
            for t in backlog:
                if t.done() and not t.result().released:
                    t.result().release()
        assert all(t.done() for t in backlog) and ledger.global_inflight == 0


async def test_a_smaller_request_does_not_take_the_room_a_larger_one_ahead_of_it_waits_for() -> None:
    """The engine frees 10 tokens at a time; B's 20-token request is first in fair order. A's 10-token
    requests behind it would fit each freed gap, but they must not take it: B goes once 20 are free."""
    ctl, ledger = controller()
    e = engine("http://e", budget=100)
    place = placer(ledger, [e])
    held = [await ctl.admit(req("A"), place) for _ in range(10)]
    b = asyncio.create_task(ctl.admit(req("B", cost=20), place))
    await settle()
    a = [asyncio.create_task(ctl.admit(req("A"), place)) for _ in range(3)]
    await settle()
    held.pop().release()
    await settle()
    assert not b.done() and not any(t.done() for t in a)  # 10 free: B does not fit, A must not jump it
    held.pop().release()
    await settle()
    assert b.done() and e.inflight_tokens == 100 and not any(t.done() for t in a)
    for g in [*held, b.result()]:
        g.release()
    await settle()
    for t in a:
        (await t).release()
    assert ledger.global_inflight == 0


async def test_headroom_is_kept_on_two_engines_of_the_pool_not_on_every_one() -> None:
    """Four engines of 25 tokens (two 10-token requests each, 20 + 5 spare): A fills them until only two
    engines still have a B-sized room; the other two are filled to the brim."""
    ledger = TokenLedger(None)
    engines = [engine(f"http://e{i}", budget=25) for i in range(4)]
    ctl = AdmissionController(AdmissionSettings(), ledger, tick_s=0.02, headroom_window_s=10.0,
                              capacity=lambda: 100, engines=lambda: engines)
    place = placer(ledger, engines)
    (await ctl.admit(req("B"), place)).release()
    held = [await ctl.admit(req("A"), place) for _ in range(6)]
    extra = asyncio.create_task(ctl.admit(req("A"), place))
    await settle()
    assert sorted(e.inflight_tokens for e in engines) == [10, 10, 20, 20] and not extra.done()
    b = await asyncio.wait_for(ctl.admit(req("B"), place), 1)
    extra.cancel()
    await asyncio.gather(extra, return_exceptions=True)
    for g in [*held, b]:
        g.release()
    assert ledger.global_inflight == 0
