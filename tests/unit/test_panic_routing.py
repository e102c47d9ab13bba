"""Panic routing: when health probes call every engine of a model unhealthy, requests still go to them.

Probes miss their deadline on a loaded host (2 CPU cores, a busy engine) and would otherwise turn a
working fleet into a wall of 503s. Open breakers, which stand for failures of real requests, and
draining still take engines out.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from coordinator.config import EngineSettings, Settings
from coordinator.observability.metrics import Metrics
from coordinator.pipeline.admission.budget import TokenLedger
from coordinator.pipeline.engines.registry import PROBE_TIMEOUTS_UNHEALTHY, EngineRegistry
from coordinator.pipeline.errors import NoHealthyEngine
from coordinator.pipeline.scheduling.request import SchedRequest
from coordinator.pipeline.scheduling.scheduler import Scheduler, build_profile

MODEL = "smollm2-135m-instruct"
A, B = "http://a:8000", "http://b:8000"


def make(*engines: EngineSettings, http: httpx.AsyncClient | None = None
         ) -> tuple[Scheduler, EngineRegistry, Metrics]:
    settings = Settings(engines=list(engines))
    metrics = Metrics()
    registry = EngineRegistry(settings, http or httpx.AsyncClient(), metrics)
    profile = build_profile(settings.scheduling, TokenLedger(None).engine_room)
    return Scheduler(registry, profile, index=None, block_size=16, learn=False, topology=settings.topology,
                     metrics=metrics), registry, metrics


def req() -> SchedRequest:
    return SchedRequest("r", MODEL, list(range(100, 140)), 16)


def panics(metrics: Metrics, role: str = "union") -> float:
    return metrics.registry.get_sample_value("coordinator_panic_decisions_total", {"role": role}) or 0.0


def test_every_engine_unhealthy_by_probes_is_still_tried() -> None:
    sched, reg, metrics = make(EngineSettings(url=A), EngineSettings(url=B))
    for e in reg.engines:
        e.probe_ok = False
    picked = {p.engine.url for p in (sched.place(req()) for _ in range(4)) if p is not None}
    assert picked == {A, B} and panics(metrics) == 4
    assert sched.has_other_engine(req())


def test_one_healthy_engine_takes_everything() -> None:
    sched, reg, metrics = make(EngineSettings(url=A), EngineSettings(url=B))
    reg.engines[0].probe_ok = False
    picked = {p.engine.url for p in (sched.place(req()) for _ in range(4)) if p is not None}
    assert picked == {B} and panics(metrics) == 0


def test_open_breakers_end_panic_with_503() -> None:
    """Real request failures opened the breakers: those engines are not tried, panic or not."""
    sched, reg, _ = make(EngineSettings(url=A))
    (a,) = reg.engines
    a.probe_ok = False
    for _ in range(reg._settings.resilience.breaker_failures):
        reg.record_failure(a)
    assert a.breaker.state == "open"
    with pytest.raises(NoHealthyEngine):
        sched.place(req())
    assert not sched.has_other_engine(req())


def test_a_claimed_half_open_trial_means_wait_not_503() -> None:
    sched, reg, _ = make(EngineSettings(url=A))
    (a,) = reg.engines
    a.probe_ok = False
    a.breaker.record_failure()
    a.breaker.record_failure()
    a.breaker.record_failure()
    a.breaker._opened_at = -1e9          # cooldown over: half-open
    assert sched.place(req()) is not None  # takes the trial
    assert sched.place(req()) is None      # trial in flight: wait for its verdict


def test_draining_engines_never_panic() -> None:
    sched, reg, _ = make(EngineSettings(url=A, drain=True), EngineSettings(url=B))
    reg.engines[1].probe_ok = False
    reg.engines[0].probe_ok = False
    placement = sched.place(req())
    assert placement is not None and placement.engine.url == B


@pytest.fixture
async def silent_fleet() -> AsyncIterator[httpx.AsyncClient]:
    async def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("probe deadline", request=request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        yield http


async def test_probe_timeouts_never_empty_the_pool(silent_fleet: httpx.AsyncClient) -> None:
    """One timed-out probe changes nothing; a run of them marks the engine unhealthy, and it is still
    tried (panic) rather than every request getting a 503."""
    sched, reg, metrics = make(EngineSettings(url=A), http=silent_fleet)
    (a,) = reg.engines
    await reg.probe_once()
    assert a.state == "healthy" and sched.place(req()) is not None and panics(metrics) == 0
    for _ in range(PROBE_TIMEOUTS_UNHEALTHY - 1):
        await reg.probe_once()
    assert a.state == "unhealthy"
    placement = sched.place(req())
    assert placement is not None and placement.engine is a and panics(metrics) == 1
