"""Engine registry: health states, drain, live engine-set changes, listeners, DNS discovery, telemetry,
breaker wiring and the per-engine metrics it publishes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest

from coordinator.config import (
    AdmissionSettings,
    DiscoverySettings,
    EngineClientSettings,
    EngineSettings,
    ModelSettings,
    ResilienceSettings,
    Settings,
)
from coordinator.observability.metrics import Metrics
from coordinator.pipeline.engines.discovery import DnsDiscovery, resolve_addresses
from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.engines.registry import PROBE_TIMEOUTS_UNHEALTHY, EngineRegistry
from coordinator.pipeline.engines.telemetry import Telemetry, parse_metrics, scrape
from token_engine.simulator import SimConfig, SimulatedEngine

A, B, C = "http://a:8000", "http://b:8000", "http://c:8000"
MODEL = "smollm2-135m-instruct"


# --------------------------------------------------------------------------- fakes

class Fleet:
    """Answers /health and /metrics per engine base URL through an httpx MockTransport."""

    def __init__(self) -> None:
        self.status: dict[str, int] = {}
        self.down: set[str] = set()
        self.slow: set[str] = set()
        self.metrics: dict[str, str] = {}
        self.tokenize: dict[str, int] = {}  # /tokenize status per engine (unset: 404, a route it lacks)
        self.chat: dict[str, int] = {}  # /v1/chat/completions status per engine (unset: 404)
        self.auth: list[str | None] = []  # the Authorization header of each chat probe
        self.paths: list[str] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        base = str(request.url).removesuffix(request.url.path)
        self.paths.append(request.url.path)
        if base in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if base in self.slow:
            raise httpx.ReadTimeout("no answer in time", request=request)
        if request.url.path == "/health":
            return httpx.Response(self.status.get(base, 200))
        if request.url.path == "/metrics" and base in self.metrics:
            return httpx.Response(200, text=self.metrics[base])
        if request.url.path == "/tokenize" and base in self.tokenize:
            return httpx.Response(self.tokenize[base], json={})
        if request.url.path == "/v1/chat/completions" and base in self.chat:
            self.auth.append(request.headers.get("authorization"))
            return httpx.Response(self.chat[base], json={})
        return httpx.Response(404)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def __call__(self, event: str, engine: Engine) -> None:
        self.seen.append((event, engine.url))

    def take(self) -> list[tuple[str, str]]:
        out, self.seen = self.seen, []
        return out


def settings(*engines: EngineSettings, **kw: Any) -> Settings:
    kw.setdefault("resilience", ResilienceSettings(breaker_failures=2, breaker_cooldown_s=30.0, telemetry=False))
    return Settings(engines=list(engines), **kw)


@pytest.fixture
def fleet() -> Fleet:
    return Fleet()


@pytest.fixture
async def http(fleet: Fleet) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(fleet.handler)) as c:
        yield c


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def make(http: httpx.AsyncClient, clock: Clock) -> Callable[..., EngineRegistry]:
    def build(s: Settings, metrics: Metrics | None = None, **kw: Any) -> EngineRegistry:
        return EngineRegistry(s, http, metrics, clock=clock, **kw)
    return build


def urls(engines: list[Engine]) -> list[str]:
    return [e.url for e in engines]


async def eventually(pred: Callable[[], bool], within_s: float = 3.0) -> bool:
    for _ in range(int(within_s / 0.01)):
        if pred():
            return True
        await asyncio.sleep(0.01)
    return pred()


# --------------------------------------------------------------------------- engine set from config

def test_engines_from_settings(make: Callable[..., EngineRegistry]) -> None:
    reg = make(settings(
        EngineSettings(url=A + "/", weight=0.5),
        EngineSettings(url=B, max_inflight_tokens=1000, role="prefill", model=MODEL),
        EngineSettings(url=C, drain=True),
        admission=AdmissionSettings(engine_tokens=4000),
    ))
    a, b, c = reg.engines
    assert (a.url, a.token_budget) == (A, 2000)             # engine_tokens * weight
    assert (b.token_budget, b.role, b.model) == (1000, "prefill", MODEL)
    assert c.state == "draining" and a.state == b.state == "healthy"
    assert reg.get(A + "/") is a and reg.get("http://nope:1") is None
    assert urls(reg.candidates(MODEL)) == [A]               # C drains, B is prefill
    assert urls(reg.candidates(MODEL, "prefill")) == [B]
    assert reg.candidates("other-model", "prefill") == []  # B serves only MODEL
    assert reg.any_healthy()


async def test_probe_marks_unhealthy_and_back(make: Callable[..., EngineRegistry], fleet: Fleet) -> None:
    reg = make(settings(EngineSettings(url=A), EngineSettings(url=B)))
    events = Events()
    reg.add_listener(events)
    fleet.status[A] = 503
    fleet.down.add(B)
    await reg.probe_once()
    assert [e.state for e in reg.engines] == ["unhealthy", "unhealthy"]
    assert not reg.any_healthy() and reg.candidates(MODEL) == [] and reg.eligible(MODEL, "union") == []
    assert sorted(events.take()) == [("state", A), ("state", B)]
    await reg.probe_once()
    assert events.take() == []                              # no change, no event
    fleet.status[A] = 200
    fleet.down.clear()
    await reg.probe_once()
    assert urls(reg.candidates(MODEL)) == [A, B]
    assert sorted(events.take()) == [("state", A), ("state", B)]


async def test_a_slow_probe_is_not_a_dead_engine(make: Callable[..., EngineRegistry], fleet: Fleet) -> None:
    """A loaded engine may miss a probe's deadline; only a run of silent probes takes it out."""
    reg = make(settings(EngineSettings(url=A)))
    (a,) = reg.engines
    fleet.slow.add(A)
    for _ in range(PROBE_TIMEOUTS_UNHEALTHY - 1):
        await reg.probe_once()
        assert a.state == "healthy"
    await reg.probe_once()
    assert a.state == "unhealthy"
    fleet.slow.clear()
    await reg.probe_once()
    assert a.state == "healthy" and a.probe_timeouts == 0


async def test_mark_failed_holds_until_next_good_probe(make: Callable[..., EngineRegistry]) -> None:
    reg = make(settings(EngineSettings(url=A)))
    (a,) = reg.engines
    reg.mark_failed(a)
    assert a.state == "unhealthy" and not reg.any_healthy()
    await reg.probe_once()
    assert a.state == "healthy" and a.breaker.state == "closed"   # one failure of two


# --------------------------------------------------------------------------- drain

async def test_drain_and_undrain(make: Callable[..., EngineRegistry], fleet: Fleet) -> None:
    reg = make(settings(EngineSettings(url=A), EngineSettings(url=B)))
    a, _ = reg.engines
    a.inflight_requests = 2
    events = Events()
    reg.add_listener(events)
    assert reg.drain(A) and a.state == "draining"
    assert events.take() == [("state", A)]
    assert urls(reg.candidates(MODEL)) == [B] and urls(reg.eligible(MODEL, "union")) == [B]
    await reg.probe_once()                                   # a good probe never un-drains
    assert a.state == "draining" and a in reg.engines and a.inflight_requests == 2
    assert reg.undrain(A) and a.state == "healthy"
    assert urls(reg.candidates(MODEL)) == [A, B]
    assert not reg.drain("http://unknown:1") and not reg.undrain("http://unknown:1")


async def test_undrain_returns_to_what_the_probe_saw(make: Callable[..., EngineRegistry], fleet: Fleet) -> None:
    reg = make(settings(EngineSettings(url=A)))
    reg.drain(A)
    fleet.status[A] = 503
    await reg.probe_once()
    assert reg.engines[0].state == "draining"
    reg.undrain(A)
    assert reg.engines[0].state == "unhealthy"


def test_runtime_drain_survives_unchanged_config(make: Callable[..., EngineRegistry]) -> None:
    reg = make(settings(EngineSettings(url=A)))
    reg.drain(A)
    reg.update([EngineSettings(url=A)])                      # e.g. a discovery round: same config
    assert reg.engines[0].state == "draining"
    reg.update([EngineSettings(url=A, drain=True)])
    reg.undrain(A)
    reg.update([EngineSettings(url=A, drain=True)])          # unchanged `drain: true` does not re-drain
    assert reg.engines[0].state == "healthy"
    reg.update([EngineSettings(url=A, drain=False)])
    reg.update([EngineSettings(url=A, drain=True)])          # a changed one does
    assert reg.engines[0].state == "draining"


# --------------------------------------------------------------------------- live updates

def test_update_adds_modifies_in_place_and_drops_idle(make: Callable[..., EngineRegistry]) -> None:
    reg = make(settings(EngineSettings(url=A), EngineSettings(url=B),
                        admission=AdmissionSettings(engine_tokens=1000)))
    a, b = reg.engines
    a.inflight_requests, a.inflight_tokens = 3, 300
    events = Events()
    reg.add_listener(events)
    reg.update([EngineSettings(url=A, weight=2.0, role="decode", kv_events="tcp://a:5557"),
                EngineSettings(url=C)])
    assert urls(reg.engines) == [A, C]
    assert reg.get(A) is a and (a.inflight_requests, a.inflight_tokens) == (3, 300)
    assert (a.role, a.weight, a.token_budget, a.kv_events) == ("decode", 2.0, 2000, "tcp://a:5557")
    assert reg.get(B) is None and b not in reg.engines      # idle: dropped at once
    assert sorted(events.take()) == [("added", C), ("removed", B), ("state", A)]
    reg.update([EngineSettings(url=A, weight=2.0, role="decode", kv_events="tcp://a:5557"),
                EngineSettings(url=C)])
    assert events.take() == []                               # nothing changed, nothing said


async def test_removed_busy_engine_drains_then_is_dropped(make: Callable[..., EngineRegistry]) -> None:
    m = Metrics()
    reg = make(settings(EngineSettings(url=A), EngineSettings(url=B), EngineSettings(url=C)), m)
    _, b, c = reg.engines
    b.inflight_requests = c.inflight_requests = 1
    events = Events()
    reg.add_listener(events)
    reg.update([EngineSettings(url=A)])
    assert urls(reg.engines) == [A, B, C]
    assert b.state == c.state == "draining" and urls(reg.candidates(MODEL)) == [A]
    assert events.take() == [("state", B), ("state", C)]
    reg.undrain(B)                                           # removed from config: stays draining
    assert b.state == "draining"
    await reg.probe_once()
    assert urls(reg.engines) == [A, B, C]                    # still busy
    b.inflight_requests = 0
    reg.on_idle(b)                                           # the caller released its last request
    assert urls(reg.engines) == [A, C] and events.take() == [("removed", B)]
    assert m.registry.get_sample_value("coordinator_engine_state", {"engine": B, "state": "draining"}) is None
    c.inflight_requests = 0
    await reg.probe_once()                                   # or the next probe round notices
    assert urls(reg.engines) == [A] and events.take() == [("removed", C)]


def test_readded_engine_keeps_its_inflight_counters(make: Callable[..., EngineRegistry]) -> None:
    reg = make(settings(EngineSettings(url=A), EngineSettings(url=B)))
    b = reg.engines[1]
    b.inflight_requests = 1
    reg.update([EngineSettings(url=A)])
    assert b.state == "draining"
    reg.update([EngineSettings(url=A), EngineSettings(url=B)])
    assert reg.get(B) is b and b.state == "healthy" and b.inflight_requests == 1


def test_a_failing_listener_does_not_stop_the_others(make: Callable[..., EngineRegistry]) -> None:
    reg = make(settings(EngineSettings(url=A)))

    def broken(event: str, engine: Engine) -> None:
        raise RuntimeError("boom")

    events = Events()
    reg.add_listener(broken)
    reg.add_listener(events)
    reg.update([EngineSettings(url=A), EngineSettings(url=B)])
    assert events.take() == [("added", B)]
    reg.remove_listener(events)
    reg.drain(B)
    assert events.take() == []


# --------------------------------------------------------------------------- breaker wiring

async def test_breaker_open_half_open_trial_close(make: Callable[..., EngineRegistry], clock: Clock) -> None:
    m = Metrics()
    reg = make(settings(EngineSettings(url=A), EngineSettings(url=B)), m)
    a, _ = reg.engines
    events = Events()
    reg.add_listener(events)

    def breaker_metric() -> float | None:
        return m.registry.get_sample_value("coordinator_breaker_state", {"engine": A})

    reg.record_failure(a)
    assert a.breaker.state == "closed" and events.take() == []
    reg.record_failure(a)
    assert a.breaker.state == "open" and events.take() == [("state", A)] and breaker_metric() == 2
    assert urls(reg.candidates(MODEL)) == [B]
    assert urls(reg.eligible(MODEL, "union")) == [A, B]      # healthy, just not now
    await reg.probe_once()                                   # a good probe leaves the breaker alone
    assert a.breaker.state == "open" and events.take() == []
    clock.now += 30
    await reg.probe_once()                                   # the round notices the cooldown passed
    assert a.breaker.state == "half_open" and events.take() == [("state", A)] and breaker_metric() == 1
    assert urls(reg.candidates(MODEL)) == [A, B]
    a.breaker.on_pick()                                      # the scheduler sends the trial
    assert urls(reg.candidates(MODEL)) == [B]
    reg.release_trial(a)                                     # client left: someone else may try
    assert urls(reg.candidates(MODEL)) == [A, B] and events.take() == [("state", A)]
    a.breaker.on_pick()
    reg.record_success(a)
    assert a.breaker.state == "closed" and events.take() == [("state", A)] and breaker_metric() == 0


async def test_failed_trial_reopens(make: Callable[..., EngineRegistry], clock: Clock) -> None:
    reg = make(settings(EngineSettings(url=A)))
    (a,) = reg.engines
    reg.record_failure(a)
    reg.record_failure(a)
    clock.now += 30
    a.breaker.on_pick()
    reg.record_failure(a)
    assert a.breaker.state == "open" and reg.candidates(MODEL) == [] and reg.any_healthy()


async def test_listeners_hear_when_the_cooldown_ends(http: httpx.AsyncClient) -> None:
    """Admission waiters must wake when an open breaker turns half-open, not only on the next probe."""
    reg = EngineRegistry(settings(EngineSettings(url=A), resilience=ResilienceSettings(
        breaker_failures=1, breaker_cooldown_s=0.05, telemetry=False)), http)
    events = Events()
    reg.add_listener(events)
    reg.record_failure(reg.engines[0])
    assert events.take() == [("state", A)]
    assert await eventually(lambda: events.seen == [("state", A)])
    assert reg.engines[0].available
    await reg.stop()


# --------------------------------------------------------------------------- metrics

async def test_metrics_follow_state_and_load(make: Callable[..., EngineRegistry], fleet: Fleet) -> None:
    m = Metrics()
    reg = make(settings(EngineSettings(url=A), EngineSettings(url=B)), m)

    def sample(name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(name, labels)

    a, _ = reg.engines
    a.inflight_requests, a.inflight_tokens = 2, 640
    fleet.status[B] = 500
    await reg.probe_once()
    assert [sample("coordinator_engine_state", engine=A, state=s) for s in ("healthy", "unhealthy", "draining")] \
        == [1, 0, 0]
    assert [sample("coordinator_engine_state", engine=B, state=s) for s in ("healthy", "unhealthy", "draining")] \
        == [0, 1, 0]
    assert sample("coordinator_breaker_state", engine=A) == 0
    assert sample("coordinator_engine_inflight_requests", engine=A) == 2
    assert sample("coordinator_engine_inflight_tokens", engine=A) == 640
    reg.drain(A)                                             # a state change publishes at once
    assert sample("coordinator_engine_state", engine=A, state="draining") == 1
    reg.update([EngineSettings(url=A)])                      # B is idle: dropped, its series go
    for name, labels in [("coordinator_engine_state", {"engine": B, "state": "unhealthy"}),
                         ("coordinator_breaker_state", {"engine": B}),
                         ("coordinator_engine_inflight_requests", {"engine": B}),
                         ("coordinator_engine_inflight_tokens", {"engine": B})]:
        assert m.registry.get_sample_value(name, labels) is None


# --------------------------------------------------------------------------- discovery

class Resolver:
    def __init__(self, *answer: str) -> None:
        self.answer: list[str] | OSError = list(answer)
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, name: str, port: int) -> list[str]:
        self.asked.append((name, port))
        if isinstance(self.answer, OSError):
            raise self.answer
        return list(self.answer)


def discovery(**kw: Any) -> DiscoverySettings:
    return DiscoverySettings(dns_name="engines.ns.svc.cluster.local", port=8200, **kw)


async def test_discovery_builds_engine_settings() -> None:
    res = Resolver("10.0.0.2", "10.0.0.1", "fd00::7", "10.0.0.1")
    d = DnsDiscovery(discovery(role="decode", model=MODEL, kv_events_port=5557, kv_events_replay_port=5558), res)
    found = await d.discover()
    assert res.asked == [("engines.ns.svc.cluster.local", 8200)]
    assert [(e.url, e.kv_events, e.kv_events_replay, e.role, e.model) for e in found] == [
        ("http://10.0.0.1:8200", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558", "decode", MODEL),
        ("http://10.0.0.2:8200", "tcp://10.0.0.2:5557", "tcp://10.0.0.2:5558", "decode", MODEL),
        ("http://[fd00::7]:8200", "tcp://[fd00::7]:5557", "tcp://[fd00::7]:5558", "decode", MODEL),
    ]
    assert [e.kv_events for e in await DnsDiscovery(discovery(), res).discover()] == [None] * 3


async def test_discovered_engines_may_serve_their_own_api(make: Callable[..., EngineRegistry]) -> None:
    """``discovery[].native_api`` marks every engine found under the name, so a Kubernetes fleet has
    a render fallback; and render off is accepted with such an entry alone (or one left to learn it),
    refused when every entry says false."""
    reg = make(settings(discovery=discovery(native_api=True)), resolver=Resolver("10.0.0.1", "10.0.0.2"))
    await reg.discover_once()
    assert [e.native_api for e in reg.engines] == [True, True]
    off = Settings(render={"enable": False}, discovery=[discovery(native_api=True)])
    assert off.render_off_problem() is None
    assert Settings(render={"enable": False}, discovery=[discovery()]).render_off_problem() is None
    assert "native_api" in str(Settings(render={"enable": False}, engines=[],
                                        discovery=[discovery(native_api=False)]).render_off_problem())


async def test_discovery_merges_with_static_engines(make: Callable[..., EngineRegistry], fleet: Fleet,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    res = Resolver("10.0.0.1", "10.0.0.2")
    reg = make(settings(EngineSettings(url="http://10.0.0.1:8200", weight=3.0), EngineSettings(url=A),
                        discovery=discovery()), resolver=res)
    events = Events()
    reg.add_listener(events)
    await reg.discover_once()
    assert urls(reg.engines) == ["http://10.0.0.1:8200", A, "http://10.0.0.2:8200"]
    assert reg.engines[0].weight == 3.0                      # the configured entry wins over discovery
    assert events.take() == [("added", "http://10.0.0.2:8200")]
    reg.update([EngineSettings(url="http://10.0.0.1:8200", weight=3.0)])   # config reload keeps discovery
    assert urls(reg.engines) == ["http://10.0.0.1:8200", "http://10.0.0.2:8200"]
    events.take()

    res.answer = OSError("Temporary failure in name resolution")
    with caplog.at_level(logging.WARNING, logger="coordinator.pipeline.engines.discovery"):
        await reg.discover_once()
        await reg.discover_once()
    assert urls(reg.engines) == ["http://10.0.0.1:8200", "http://10.0.0.2:8200"]   # last known set kept
    assert len([r for r in caplog.records if "cannot resolve" in r.getMessage()]) == 1
    assert events.take() == []

    res.answer = ["10.0.0.3"]                                # pod .2 went away, .3 came up
    reg.get("http://10.0.0.2:8200").inflight_requests = 1    # type: ignore[union-attr]
    await reg.discover_once()
    assert urls(reg.engines) == ["http://10.0.0.1:8200", "http://10.0.0.2:8200", "http://10.0.0.3:8200"]
    assert reg.get("http://10.0.0.2:8200").state == "draining"   # type: ignore[union-attr]


async def test_discovery_of_a_prefill_and_a_decode_service(make: Callable[..., EngineRegistry],
                                                             fleet: Fleet) -> None:
    """A P/D fleet: two headless Services, each resolving to engines of its own role."""
    records = {"prefill.ns": ["10.0.1.1"], "decode.ns": ["10.0.2.1", "10.0.2.2"]}

    async def resolve(name: str, port: int) -> list[str]:
        return records[name]

    s = Settings(engines=[], models=[ModelSettings(name=MODEL)], discovery=[
        {"dns_name": "prefill.ns", "port": 8200, "role": "prefill"},
        {"dns_name": "decode.ns", "port": 8300, "role": "decode", "kv_events_port": 5557}])
    reg = make(s, resolver=resolve)
    await reg.discover_once()
    assert [(e.url, e.role) for e in reg.engines] == [
        ("http://10.0.1.1:8200", "prefill"), ("http://10.0.2.1:8300", "decode"),
        ("http://10.0.2.2:8300", "decode")]
    assert [e.url for e in reg.candidates(MODEL, "decode")] == ["http://10.0.2.1:8300", "http://10.0.2.2:8300"]
    records["decode.ns"] = ["10.0.2.2"]                   # one decode pod went away; prefill untouched
    await reg.discover_once()
    assert [(e.url, e.role) for e in reg.engines] == [       # idle, so dropped at once
        ("http://10.0.1.1:8200", "prefill"), ("http://10.0.2.2:8300", "decode")]


async def test_discovery_of_encode_engines_keeps_them_out_of_every_other_role(
        make: Callable[..., EngineRegistry], fleet: Fleet) -> None:
    """EPD: a Service of encode engines beside the union one; encoders are found as their own role,
    never offered for a union, prefill or decode leg, nor counted as P/D engines."""
    records = {"union.ns": ["10.0.1.1"], "encode.ns": ["10.0.3.1"]}

    async def resolve(name: str, port: int) -> list[str]:
        return records[name]

    s = Settings(engines=[], models=[ModelSettings(name=MODEL)], discovery=[
        {"dns_name": "union.ns", "port": 8200}, {"dns_name": "encode.ns", "port": 8200, "role": "encode"}])
    reg = make(s, resolver=resolve)
    await reg.discover_once()
    assert [e.url for e in reg.candidates(MODEL, "encode")] == ["http://10.0.3.1:8200"]
    assert [e.url for e in reg.candidates(MODEL)] == ["http://10.0.1.1:8200"]
    assert reg.candidates(MODEL, "prefill") == reg.candidates(MODEL, "decode") == []
    assert not s.uses_trigger() and s.mixed_pd_protocols(s.engines) is None


def test_discovery_accepts_one_mapping_or_a_list() -> None:
    one = Settings(discovery={"dns_name": "engines.ns", "port": 8200})
    assert [d.dns_name for d in one.discovery] == ["engines.ns"]
    assert Settings().discovery == []


async def test_start_runs_discovery_and_probe_loops(make: Callable[..., EngineRegistry], fleet: Fleet) -> None:
    res = Resolver("10.0.0.1")
    s = settings(discovery=DiscoverySettings(dns_name="engines", port=8200, interval_s=0.02),
                 engine_client=EngineClientSettings(health_interval_s=0.02))
    reg = make(s, resolver=res)
    assert reg.engines == []
    await reg.start()
    assert urls(reg.engines) == ["http://10.0.0.1:8200"] and reg.any_healthy()   # before serving
    res.answer = ["10.0.0.1", "10.0.0.9"]
    fleet.status["http://10.0.0.1:8200"] = 503
    assert await eventually(lambda: len(reg.engines) == 2 and not reg.engines[0].healthy)
    await reg.stop()
    await reg.stop()                                         # idempotent


async def test_resolves_localhost_for_real() -> None:
    addresses = await resolve_addresses("localhost", 8200)
    assert addresses and set(addresses) <= {"127.0.0.1", "::1"}
    found = await DnsDiscovery(DiscoverySettings(dns_name="localhost", port=8200)).discover()
    assert {e.url for e in found} <= {"http://127.0.0.1:8200", "http://[::1]:8200"}


# --------------------------------------------------------------------------- telemetry

VLLM_TEXT = """\
# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 28.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_hits{engine="0",model_name="m"} 64.0
"""


def test_parse_metrics() -> None:
    t = parse_metrics(VLLM_TEXT)
    assert t == Telemetry(waiting=5, running=7, kv_usage=0.375, prefix_queries=128.0, prefix_hits=64.0)
    assert parse_metrics("# nothing here\n") == Telemetry()


async def test_scrape_failure_is_none(fleet: Fleet, http: httpx.AsyncClient) -> None:
    fleet.metrics[A] = "vllm:num_requests_waiting{ 3 broken"
    assert await scrape(http, A) is None
    assert await scrape(http, B) is None                     # 404
    fleet.down.add(C)
    assert await scrape(http, C) is None


async def test_telemetry_off_scrapes_nothing(make: Callable[..., EngineRegistry], fleet: Fleet) -> None:
    reg = make(settings(EngineSettings(url=A)))
    await reg.probe_once()
    assert fleet.paths == ["/health", "/version", "/tokenize"]  # health and, once, what it runs; no /metrics


async def test_the_engines_tokenizer_is_learned_from_its_tokenize_route(
        make: Callable[..., EngineRegistry], fleet: Fleet) -> None:
    """/tokenize 200: a tokenizer is loaded (`--enable-scale-out`); vLLM's 400 "Tokenizer not
    available": `--tokens-only`; no answer: not known yet, so no, and asked again next round."""
    fleet.tokenize = {A: 200, B: 400}
    fleet.slow.add(C)
    reg = make(settings(EngineSettings(url=A), EngineSettings(url=B), EngineSettings(url=C)))
    a, b, c = reg.engines
    assert not any(e.can("tokenizer") for e in (a, b, c))  # before the first round
    await reg.probe_once()
    assert (a.can("tokenizer"), b.can("tokenizer"), c.can("tokenizer")) == (
        True, False, False)
    assert c.learned_tokenizer is None
    fleet.slow.discard(C)
    fleet.tokenize[C] = 200
    fleet.paths.clear()
    await reg.probe_once()
    assert c.can("tokenizer")
    assert fleet.paths.count("/tokenize") == 1  # only the engine that had not answered yet


async def test_capabilities_are_asked_again_when_an_engine_comes_back(
        make: Callable[..., EngineRegistry], fleet: Fleet) -> None:
    """A restarted engine may have been started with other flags: what it could run is forgotten
    while it is down and learned again when it answers."""
    fleet.tokenize = {A: 200}
    reg = make(settings(EngineSettings(url=A)))
    (a,) = reg.engines
    await reg.probe_once()
    assert a.can("tokenizer")
    fleet.down.add(A)
    await reg.probe_once()
    assert a.learned_tokenizer is None and not a.can("tokenizer")
    fleet.down.discard(A)
    fleet.tokenize[A] = 400  # back as --tokens-only
    await reg.probe_once()
    assert a.healthy and not a.can("tokenizer")


async def test_a_configured_tokenizer_wins_and_skips_the_probe(
        make: Callable[..., EngineRegistry], fleet: Fleet) -> None:
    fleet.tokenize = {A: 400, B: 200}
    reg = make(settings(EngineSettings(url=A, tokenizer=True),
                        EngineSettings(url=B, tokenizer=False)))
    a, b = reg.engines
    await reg.probe_once()
    assert a.can("tokenizer") and not b.can("tokenizer")
    assert "/tokenize" not in fleet.paths
    reg.update([EngineSettings(url=A, tokenizer=False), EngineSettings(url=B)])
    await reg.probe_once()
    assert not a.can("tokenizer") and b.can("tokenizer")  # B's now learned


async def test_the_engines_own_api_is_learned_where_a_tokenizer_is_loaded(
        make: Callable[..., EngineRegistry], fleet: Fleet) -> None:
    """The native route needs an engine whose ``/v1/chat/completions`` answers: vLLM's 400 for the
    probe's empty body says the route is there; 404 says it is not (an engine serving the token route
    alone); a ``--tokens-only`` engine (no tokenizer) is never asked, since it fails on that route; a
    401 hides the route behind a key, so it is asked again; a configured value wins unasked."""
    D, E = "http://d:8000", "http://e:8000"
    fleet.tokenize = {A: 200, B: 200, C: 400, D: 200, E: 200}
    fleet.chat = {A: 400, C: 400, D: 401, E: 400}
    reg = make(settings(EngineSettings(url=A), EngineSettings(url=B), EngineSettings(url=C),
                        EngineSettings(url=D, api_key="k-d"), EngineSettings(url=E, native_api=False)))
    d = reg.engines[3]
    assert not any(x.can("native_api") for x in reg.engines)   # before the first round
    await reg.probe_once()
    assert [x.can("native_api") for x in reg.engines] == [True, False, False, False, False]
    assert d.learned_native_api is None and fleet.auth.count("Bearer k-d") == 1
    assert fleet.paths.count("/v1/chat/completions") == 3      # A, B and D: not C (no tokenizer), not E
    fleet.chat[D] = 400
    fleet.paths.clear()
    await reg.probe_once()
    assert d.can("native_api") and fleet.paths.count("/v1/chat/completions") == 1
    await reg.probe_once()
    assert "/v1/chat/completions" not in fleet.paths[-5:]       # learned: not asked again


async def test_the_native_route_finds_learned_engines(
        make: Callable[..., EngineRegistry], fleet: Fleet) -> None:
    """Render off with an engine left to learn: once it answers, the route serves through it."""
    fleet.tokenize, fleet.chat = {A: 400, B: 200}, {B: 400}
    reg = make(settings(EngineSettings(url=A), EngineSettings(url=B)))
    await reg.probe_once()
    assert [x.url for x in reg.engines if x.can("native_api")] == [B]
    fleet.down.add(B)
    await reg.probe_once()
    assert not reg.engines[1].can("native_api") and reg.engines[1].learned_native_api is None


@pytest.fixture(scope="module")
def sim() -> Iterator[SimulatedEngine]:
    with SimulatedEngine(SimConfig()) as eng:
        yield eng


async def test_telemetry_and_health_from_a_simulated_engine(sim: SimulatedEngine) -> None:
    s = settings(EngineSettings(url=sim.url),
                 resilience=ResilienceSettings(telemetry=True, breaker_failures=2))
    async with httpx.AsyncClient() as http:
        reg = EngineRegistry(s, http)
        (e,) = reg.engines
        r = await http.post(f"{sim.url}/inference/v1/generate", json={
            "request_id": "t1", "token_ids": list(range(100, 140)), "sampling_params": {"max_tokens": 2}})
        assert r.status_code == 200
        await reg.probe_once()
        t = e.telemetry
        assert (t.waiting, t.running) == (0, 0)
        assert t.kv_usage is not None and 0.0 <= t.kv_usage <= 1.0
        assert t.prefix_queries is not None and t.prefix_queries >= 40 and t.prefix_hits is not None
        assert e.healthy

        sim.set_faults(health_dead=True)
        try:
            await reg.probe_once()
            assert e.state == "unhealthy" and e.telemetry == t   # metrics still served; health is not
        finally:
            sim.clear_faults()
        await reg.probe_once()
        assert e.healthy


async def test_failed_scrape_keeps_previous_values(make: Callable[..., EngineRegistry], fleet: Fleet) -> None:
    reg = make(settings(EngineSettings(url=A), resilience=ResilienceSettings(telemetry=True)))
    fleet.metrics[A] = VLLM_TEXT
    await reg.probe_once()
    before = reg.engines[0].telemetry
    assert before.waiting == 5
    fleet.down.add(A)
    await reg.probe_once()
    assert reg.engines[0].telemetry == before and reg.engines[0].state == "unhealthy"
