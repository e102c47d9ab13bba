"""The fleet budget on a real ``redis-server``: atomic claims across processes, leases that give a dead
process's tokens back, degraded mode while Redis is down and recovery after, and two coordinators in
front of one engine holding it to one budget (sampled from the engine itself)."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from coordinator.pipeline.admission.fleet import GLOBAL, RedisFleet, Slot
from tests.conftest import SERVED, CoordinatorFactory
from tests.support import RedisServer, peak_at_engine
from token_engine.simulator import SimConfig, SimulatedEngine

ENGINE = "http://engine-a"


class Holder:
    """One process's local holdings, as the ledger keeps them, claiming through its own fleet."""

    def __init__(self, fleet: RedisFleet) -> None:
        self.fleet = fleet
        self.own = 0

    def totals(self) -> dict[str, int]:
        return {ENGINE: self.own, GLOBAL: self.own}

    async def claim(self, tokens: int, budget: int) -> bool:
        self.own += tokens  # reserved locally first, as admission does
        ok = await self.fleet.claim([Slot(ENGINE, self.own, tokens, budget), Slot(GLOBAL, self.own, tokens, None)])
        if not ok:
            self.own -= tokens
        return ok

    def release(self, tokens: int) -> None:
        self.own -= tokens
        self.fleet.publish(self.totals())


def fleet(redis_server: RedisServer, ns: str, **kw: Any) -> RedisFleet:
    return RedisFleet(redis_server.url, namespace=ns, **{"lease_ttl_s": 1.0, "sync_interval_s": 0.05, **kw})


async def started(f: RedisFleet) -> Holder:
    holder = Holder(f)
    await f.start(holder.totals, lambda: None)
    return holder


def test_claims_are_atomic_across_processes(redis_server: RedisServer) -> None:
    """Two processes race 40 claims of 10 tokens each at a 100-token budget: never more than 10 are
    taken, whichever process made them (fewer when a claim that counted more of its own tokens
    reaches Redis first: it waits, as a request would); claiming on fills the budget exactly; and a
    release makes room for exactly one more."""
    ns = uuid.uuid4().hex

    async def main() -> None:
        a, b = await started(fleet(redis_server, ns)), await started(fleet(redis_server, ns))
        results = await asyncio.gather(*(h.claim(10, 100) for _ in range(20) for h in (a, b)))
        assert 1 <= sum(results) <= 10 and a.own + b.own == 10 * sum(results)
        # A raced claim may have written a total its process no longer holds (it counted siblings
        # refused after it); the next sync rewrites the true totals.
        await asyncio.sleep(0.2)
        for h in [a, b] * 10:  # one at a time now: the budget fills exactly
            await h.claim(10, 100)
        assert a.own + b.own == 100
        assert not await b.claim(10, 100) and not await a.claim(10, 100)
        (a if a.own else b).release(10)
        await asyncio.sleep(0.2)  # the release is written in the background
        assert await b.claim(10, 100)
        assert not await a.claim(10, 100)
        assert a.fleet.others(ENGINE) == b.own and b.fleet.others(ENGINE) >= 0
        for h in (a, b):
            await h.fleet.aclose()

    asyncio.run(main())


def test_an_idle_budget_takes_one_request_larger_than_itself(redis_server: RedisServer) -> None:
    """The local rule holds fleet-wide: a request over the whole budget runs when nobody holds
    anything (instead of waiting forever), and nothing else may join it."""
    ns = uuid.uuid4().hex

    async def main() -> None:
        a, b = await started(fleet(redis_server, ns)), await started(fleet(redis_server, ns))
        assert await a.claim(150, 100)
        assert not await b.claim(1, 100)
        a.release(150)
        await asyncio.sleep(0.2)
        assert await b.claim(150, 100)
        for h in (a, b):
            await h.fleet.aclose()

    asyncio.run(main())


_HOLDER = """
import asyncio, sys
from coordinator.pipeline.admission.fleet import GLOBAL, RedisFleet, Slot
async def main():
    f = RedisFleet(sys.argv[1], namespace=sys.argv[2], lease_ttl_s=1.0, sync_interval_s=0.05)
    await f.start(lambda: {"http://engine-a": 80, GLOBAL: 80}, lambda: None)
    assert await f.claim([Slot("http://engine-a", 80, 80, 100), Slot(GLOBAL, 80, 80, None)])
    print("held", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def test_a_killed_process_gives_its_tokens_back_when_its_lease_ends(redis_server: RedisServer) -> None:
    ns = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, redis_server.url, ns], stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "the holder process never said it held its tokens"
        assert proc.stdout.readline().strip() == "held"

        async def main() -> float:
            b = await started(fleet(redis_server, ns))
            assert not await b.claim(50, 100), "the live holder's 80 tokens count"
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            # Only a claim Redis decided counts (a degraded fleet answers yes on its own; a Redis call
            # is bounded, so a lost reply degrades it until the next sync instead of hanging).
            while not await b.claim(50, 100) or b.fleet.degraded:
                assert time.monotonic() - killed < 5, "the dead holder's tokens never came back"
                await asyncio.sleep(0.05)
            waited = time.monotonic() - killed
            await b.fleet.aclose()
            return waited

        waited = asyncio.run(main())
        print(f"a SIGKILLed holder's tokens came back after {waited:.2f} s (lease 1 s)")
        assert 0.5 < waited < 2.5  # about the lease (1 s): not before, not much after
    finally:
        proc.kill()
        proc.wait()


def test_redis_down_degrades_to_a_share_and_recovers(redis_server: RedisServer) -> None:
    """While Redis is down claims are decided locally against budget / expected replicas and the
    process says so; when it is back, the process's holdings are published and claims are shared."""
    server = RedisServer().start()
    ns = uuid.uuid4().hex
    states: list[bool] = []

    async def main() -> None:
        a = await started(fleet(server, ns, expected_replicas=4, on_state=states.append, timeout_s=0.2))
        assert await a.claim(30, 100) and not a.fleet.degraded and a.fleet.scale == 1.0
        server.stop()
        assert await a.claim(10, 100), "a Redis outage never refuses a request"
        assert a.fleet.degraded and a.fleet.scale == 0.25
        server.start()
        deadline = time.monotonic() + 5
        while a.fleet.degraded:
            assert time.monotonic() < deadline, "never recovered"
            await asyncio.sleep(0.05)
        b = await started(fleet(server, ns))
        assert b.fleet.others(ENGINE) == 40, "the holdings from the outage were published"
        assert not await b.claim(70, 100) and await b.claim(60, 100)
        for h in (a, b):
            await h.fleet.aclose()

    try:
        asyncio.run(main())
    finally:
        server.stop()
    assert states == [True, False]


# -- two coordinators, one engine ------------------------------------------------------------------

@pytest.fixture
def slow_engine() -> Iterator[SimulatedEngine]:
    with SimulatedEngine(SimConfig(model=SERVED, seed=5, decode_s_per_token=0.02)) as engine:
        yield engine


@pytest.mark.parametrize("backend", ["redis", "local"])
def test_two_coordinators_hold_one_engine_to_one_budget(
        backend: str, redis_server: RedisServer, render_sidecar: Any, slow_engine: SimulatedEngine,
        coordinator_factory: CoordinatorFactory) -> None:
    """Each request costs the same (fixed prompt, ``ignore_eos``); the engine's budget fits three.
    With the Redis fleet the engine never holds more than three, whichever coordinator sent them;
    with each coordinator counting alone (the local backend) it holds up to six: the overshoot the
    shared ledger removes. A Redis call that fails (on a loaded machine, one slower than
    ``fleet.timeout_s``) lets that admission stand on the local decision, by design, so a run in
    which either coordinator lost Redis says nothing about the shared ledger and is run again."""
    body = {"model": SERVED, "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 40, "ignore_eos": True,
            "temperature": 0}
    cost = 8 + 40
    fleet_cfg = {"backend": backend, "redis_url": redis_server.url, "namespace": uuid.uuid4().hex,
                 "expected_replicas": 2}
    coords = [coordinator_factory(render_sidecar.url, [slow_engine.url],
                                  admission={"engine_tokens": 3 * cost + cost // 2, "fleet": fleet_cfg})
              for _ in range(2)]
    for _ in range(3):
        peak, done = peak_at_engine([c.url for c in coords], slow_engine, body, clients=4, seconds=4.0)
        outages = sum(getattr(c.components.ledger.fleet, "outages", 0) for c in coords)
        print(f"fleet backend {backend}: the engine held at most {peak} requests; {done} completed; "
              f"{outages} Redis outages so far")
        if outages == 0:
            break
        for c in coords:
            c.components.ledger.fleet.outages = 0
    assert outages == 0, "every run lost Redis for a while: the shared ledger was never measured"
    assert done >= 6
    if backend == "redis":
        assert peak <= 3, f"the engine held {peak} requests of a 3-request budget"
        for c in coords:
            assert httpx.get(f"{c.url}/ready", timeout=10).json()["fleet"] == "shared"
    else:
        assert peak > 3, f"without a shared ledger the engine held only {peak}: the test shows nothing"


def test_redis_stopped_mid_load_costs_no_request_and_leaks_nothing(
        render_sidecar: Any, slow_engine: SimulatedEngine, coordinator_factory: CoordinatorFactory) -> None:
    """Two coordinators under load; Redis stops for a while and comes back. Every request is answered
    200 (none waits forever, none gets a 5xx), both say "degraded" on /ready meanwhile and "shared"
    after, and afterwards nothing is held anywhere: not in the coordinators, not in Redis."""
    server = RedisServer().start()
    ns = uuid.uuid4().hex
    fleet_cfg = {"backend": "redis", "redis_url": server.url, "namespace": ns, "expected_replicas": 2,
                 "timeout_s": 0.2, "sync_interval_s": 0.05}
    body = {"model": SERVED, "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 20, "ignore_eos": True}
    try:
        coords = [coordinator_factory(render_sidecar.url, [slow_engine.url],
                                      admission={"engine_tokens": 200, "fleet": fleet_cfg}) for _ in range(2)]
        statuses: list[int] = []
        stop = time.monotonic() + 6

        def client(url: str) -> None:
            with httpx.Client(timeout=60) as c:
                while time.monotonic() < stop:
                    statuses.append(c.post(f"{url}/v1/completions", json=body).status_code)

        threads = [threading.Thread(target=client, args=(c.url,)) for c in coords for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(1.5)
        server.stop()
        time.sleep(1.0)
        seen = [httpx.get(f"{c.url}/ready", timeout=10).json() for c in coords]
        server.start()
        for t in threads:
            t.join()
        assert [r["fleet"] for r in seen] == ["degraded", "degraded"] and all(r["ready"] for r in seen)
        assert all(c.components.ledger.fleet.outages >= 1 for c in coords)  # what the budget test reads
        assert statuses and set(statuses) == {200}, sorted(set(statuses))
        deadline = time.monotonic() + 5
        while any(httpx.get(f"{c.url}/ready", timeout=10).json()["fleet"] != "shared" for c in coords):
            assert time.monotonic() < deadline, "the coordinators never shared again"
            time.sleep(0.05)
        for c in coords:
            assert c.wait_idle(10) == 0
            held = httpx.get(f"{c.url}/admin/accounting", timeout=10).json()
            assert held["held"] == 0, held
        import redis

        keys = redis.Redis.from_url(server.url).keys(f"{ns}:b:*")
        assert keys == [], f"holdings left in Redis: {keys}"
    finally:
        server.stop()


def test_a_killed_replica_gives_the_budget_back_within_its_lease(
        redis_server: RedisServer, render_sidecar: Any, slow_engine: SimulatedEngine,
        coordinator_factory: CoordinatorFactory) -> None:
    """Replica A (its own process) holds the engine's whole budget with streams in flight and is
    SIGKILLed; replica B's request, refused room while A lived, is admitted once A's lease ends."""
    from perf._procs import CoordinatorProcess

    ns = uuid.uuid4().hex
    fleet_cfg = {"backend": "redis", "redis_url": redis_server.url, "namespace": ns, "lease_ttl_s": 1.0,
                 "sync_interval_s": 0.05}
    long = {"model": SERVED, "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    cost = 408
    config = {"render": {"url": str(render_sidecar.url)},
              "engines": [{"url": slow_engine.url, "max_inflight_tokens": 2 * cost}],
              "models": [{"name": SERVED}], "admission": {"fleet": fleet_cfg}}
    b = coordinator_factory(render_sidecar.url, [slow_engine.url],
                            admission={"engine_tokens": 2 * cost, "fleet": fleet_cfg, "queue_timeout_s": 30})
    with CoordinatorProcess(config) as a:
        streams = [httpx.stream("POST", f"{a.url}/v1/completions", json=long, timeout=60) for _ in range(2)]
        responses = [s.__enter__() for s in streams]
        assert [r.status_code for r in responses] == [200, 200]
        # Keep the line iterators: a dropped one is closed when collected, and closes its response.
        lines = [r.iter_lines() for r in responses]
        for it in lines:
            next(it)  # both are running at the engine: the whole budget is A's
        assert len(slow_engine.state()["running"]) == 2
        assert a.proc is not None
        result: dict[str, Any] = {}

        def ask_b() -> None:
            started = time.monotonic()
            r = httpx.post(f"{b.url}/v1/completions", json={**long, "stream": False, "max_tokens": 4},
                           timeout=60)
            result.update(status=r.status_code, done=time.monotonic(), started=started)

        waiter = threading.Thread(target=ask_b)
        waiter.start()
        time.sleep(0.5)
        assert not result, "B was admitted while A held the whole budget"
        a.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        waiter.join(30)
        for r in responses:
            r.close()
    assert result.get("status") == 200, result
    waited = result["done"] - killed
    print(f"B admitted {waited:.2f} s after A was SIGKILLed (lease 1 s)")
    assert waited < 3.0
