"""Engines from config and DNS discovery: their state, breaker, telemetry and what each has in flight.

One registry per coordinator. A background task probes ``GET /health`` (and scrapes ``/metrics``) of every
engine; the engine set can change while serving (``update()``, discovery), and removed engines drain
before they are dropped so no in-flight request loses its engine object. Listeners hear about every
change so admission can wake waiters and the prefix index can forget a dropped engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Literal

import httpx
from pydantic import SecretStr

from coordinator.config import PD_ROLES, EngineRole, EngineSettings, PdProtocol, Settings
from coordinator.observability.metrics import Metrics
from coordinator.pipeline.engines.adapters import Residency
from coordinator.pipeline.engines.breaker import BreakerState, CircuitBreaker
from coordinator.pipeline.engines.capabilities import TOKENIZER, probe_native_api, probe_tokenizer
from coordinator.pipeline.engines.discovery import DnsDiscovery, Resolver
from coordinator.pipeline.engines.engine import Engine, EngineState
from coordinator.pipeline.engines.telemetry import scrape
from coordinator.pipeline.engines.versions import read_version, refusal

__all__ = ["EngineEvent", "EngineRegistry", "Listener"]

log = logging.getLogger(__name__)


EngineEvent = Literal["added", "removed", "state"]
Listener = Callable[[str, "Engine"], None]
"""``(event, engine)``: "added"; "removed" (dropped for good); "state" (state, breaker or config changed)."""

_STATES: tuple[EngineState, ...] = ("healthy", "unhealthy", "draining")
_BREAKER_VALUE: dict[BreakerState, int] = {"closed": 0, "half_open": 1, "open": 2}
_PROBE_TIMEOUT_S = 2.0
PROBE_TIMEOUTS_UNHEALTHY = 3  # consecutive timed-out probes before an engine counts as unhealthy


def _secret(value: SecretStr | None) -> str | None:
    return None if value is None else value.get_secret_value()


class EngineRegistry:
    """Holds the engine set; probes health (and telemetry) on a timer; tracks drain and breakers.

    ``update()`` replaces the *configured* engines; discovered engines (``discovery.dns_name``) are merged
    in on every discovery round, with configured entries winning for the same URL.
    """

    def __init__(
        self,
        settings: Settings,
        http: httpx.AsyncClient,
        metrics: Metrics | None = None,
        *,
        resolver: Resolver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._http = http
        self._metrics = metrics
        self._clock = clock                     # the breakers' clock (tests inject one)
        self._interval = settings.engine_client.health_interval_s
        self._telemetry = settings.resilience.telemetry
        self._listeners: list[Listener] = []
        self._by_url: dict[str, Engine] = {}
        self._published: dict[str, tuple[EngineState, BreakerState]] = {}
        self._config_drain: dict[str, bool] = {}  # last `drain` seen per URL: only its changes apply
        self._static: list[EngineSettings] = list(settings.engines)
        # One resolver per Service (a P/D fleet has a prefill and a decode Service, one role each).
        self._discovery = [DnsDiscovery(d, resolver) for d in settings.discovery if d.dns_name is not None]
        self._tasks: list[asyncio.Task[None]] = []
        self._timers: dict[str, asyncio.TimerHandle] = {}   # per URL: re-check when a cooldown ends
        self.engines: list[Engine] = []
        self._apply(self._static)

    @property
    def settings(self) -> Settings:
        """The configuration the registry was started with."""
        return self._settings

    # ---- lookups --------------------------------------------------------------------------------

    def get(self, url: str) -> Engine | None:
        return self._by_url.get(url.rstrip("/"))

    def candidates(self, model: str, role: EngineRole = "union") -> list[Engine]:
        """Engines that may take a new request for ``model`` now (budget is the scheduler's business)."""
        return [e for e in self.engines if e.available and e.role == role and e.serves(model)]

    def pd_protocol(self, model: str) -> PdProtocol:
        """The P/D protocol of ``model``'s prefill and decode engines (the config allows only one)."""
        for e in self.engines:
            if e.role in PD_ROLES and e.serves(model) and not e.removed:
                return e.pd_protocol
        return "handoff"

    def max_model_lens(self, model: str) -> list[int]:
        """The configured context lengths of the engines that may run ``model`` (not removed)."""
        return [e.max_model_len for e in self.engines
                if e.max_model_len is not None and e.serves(model) and not e.removed]

    def eligible(self, model: str, role: EngineRole = "union") -> list[Engine]:
        """Healthy engines for ``model`` whatever their breaker says: non-empty means "wait for capacity
        or a half-open trial" rather than "no engine can serve this" (503)."""
        return [e for e in self.engines if e.healthy and e.role == role and e.serves(model)]

    def panic_pool(self, model: str, role: EngineRole = "union") -> list[Engine]:
        """Engines for ``model`` that probes call unhealthy but no open breaker refuses, for when none is
        healthy (Envoy's panic threshold at 100%): probes miss deadlines on a loaded host and would
        otherwise empty the pool, while an open breaker stands for failures of real requests. Draining
        and removed engines stay out: that is the operator's decision, not a health verdict."""
        return [e for e in self.engines if e.role == role and e.serves(model) and e.probe_ok is False
                and not e.removed and not e.drain_requested and e.breaker.state != "open"]

    def any_healthy(self) -> bool:
        return any(e.healthy for e in self.engines)

    # ---- listeners ------------------------------------------------------------------------------

    def add_listener(self, callback: Listener) -> None:
        self._listeners.append(callback)

    def remove_listener(self, callback: Listener) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(callback)

    def _notify(self, event: EngineEvent, engine: Engine) -> None:
        for cb in list(self._listeners):
            try:
                cb(event, engine)
            except Exception:   # one broken listener must not stop probing or the others
                log.exception("engine registry listener failed on %s %s", event, engine.url)

    # ---- the engine set -------------------------------------------------------------------------

    def update(self, engines: list[EngineSettings]) -> None:
        """Replace the configured engines without a restart: new URLs are added, existing ones updated in
        place (in-flight counters kept), missing ones drain and are dropped once idle."""
        self._static = list(engines)
        self._apply(self._merged())

    def _merged(self) -> list[EngineSettings]:
        found = [e for d in self._discovery for e in d.engines]
        return [*self._static, *found]

    def _budget(self, s: EngineSettings) -> int:
        if s.max_inflight_tokens is not None:
            return s.max_inflight_tokens
        return max(1, int(self._settings.admission.engine_tokens * s.weight))

    def _apply(self, wanted: list[EngineSettings]) -> None:
        desired: dict[str, EngineSettings] = {}
        for s in wanted:
            desired.setdefault(s.url.rstrip("/"), s)   # first wins: configured before discovered
        for url, s in desired.items():
            engine = self._by_url.get(url)
            drain_edge = self._config_drain.get(url) != s.drain
            self._config_drain[url] = s.drain
            if engine is None:
                engine = Engine(url, s.role, s.model, s.weight, self._budget(s),
                                CircuitBreaker(self._settings.resilience.breaker_failures,
                                               self._settings.resilience.breaker_cooldown_s, self._clock),
                                kv_events=s.kv_events, kv_events_replay=s.kv_events_replay,
                                drain_requested=s.drain, native_api=s.native_api,
                                max_model_len=s.max_model_len, pd_protocol=s.pd_protocol,
                                tokenizer=s.tokenizer,
                                api_key=_secret(s.api_key),
                                adapters=Residency(self._settings.lora.max_loras, s.max_loras,
                                                   clock=self._clock))
                self._by_url[url] = engine
                self.engines.append(engine)
                log.info("engine %s added (%s%s)", url, s.role, ", draining" if s.drain else "")
                self._sync(engine, notify=False)
                self._notify("added", engine)
                continue
            before = (engine.role, engine.model, engine.weight, engine.token_budget, engine.kv_events,
                      engine.removed, engine.drain_requested, engine.native_api, engine.tokenizer)
            engine.role, engine.model, engine.weight = s.role, s.model, s.weight
            engine.token_budget, engine.kv_events = self._budget(s), s.kv_events
            engine.kv_events_replay = s.kv_events_replay
            engine.native_api = s.native_api
            engine.max_model_len = s.max_model_len
            engine.pd_protocol = s.pd_protocol
            engine.tokenizer = s.tokenizer
            engine.api_key = _secret(s.api_key)
            engine.adapters.configured_capacity = s.max_loras
            engine.removed = False
            if drain_edge:   # a changed `drain:` applies; an unchanged one leaves drain()/undrain() alone
                engine.drain_requested = s.drain
            after = (engine.role, engine.model, engine.weight, engine.token_budget, engine.kv_events,
                     engine.removed, engine.drain_requested, engine.native_api, engine.tokenizer)
            if after != before:
                log.info("engine %s updated", url)
                self._sync(engine, force=True)
        for url, engine in list(self._by_url.items()):
            if url not in desired and not engine.removed:
                engine.removed = True
                self._config_drain.pop(url, None)
                if engine.inflight_requests <= 0:
                    self._drop(engine)   # idle: straight to "removed", no draining detour
                    continue
                log.info("engine %s removed: draining %d request(s)", url, engine.inflight_requests)
                self._sync(engine)

    def _drop_idle(self) -> None:
        for engine in [e for e in self.engines if e.removed and e.inflight_requests <= 0]:
            self._drop(engine)

    def _drop(self, engine: Engine) -> None:
        if self._by_url.get(engine.url) is not engine:
            return
        del self._by_url[engine.url]
        self.engines.remove(engine)
        self._published.pop(engine.url, None)
        timer = self._timers.pop(engine.url, None)
        if timer is not None:
            timer.cancel()
        m = self._metrics
        if m is not None:
            for state in _STATES:
                with contextlib.suppress(KeyError):
                    m.engine_state.remove(engine.url, state)
            for gauge in (m.breaker_state, m.engine_inflight, m.engine_inflight_tokens):
                with contextlib.suppress(KeyError):
                    gauge.remove(engine.url)
        log.info("engine %s dropped", engine.url)
        self._notify("removed", engine)

    def on_idle(self, engine: Engine) -> None:
        """Callers may call this after releasing a request: drops a removed engine as soon as it is idle."""
        self._publish_load(engine)
        if engine.removed and engine.inflight_requests <= 0:
            self._drop(engine)

    # ---- drain ----------------------------------------------------------------------------------

    def drain(self, url: str) -> bool:
        """Take no new requests on ``url``; in-flight ones finish. False when the URL is unknown."""
        engine = self.get(url)
        if engine is None:
            return False
        engine.drain_requested = True
        self._sync(engine)
        return True

    def undrain(self, url: str) -> bool:
        """Back into rotation (as its last probe left it). An engine removed from config stays draining."""
        engine = self.get(url)
        if engine is None or engine.removed:
            return False
        engine.drain_requested = False
        self._sync(engine)
        return True

    # ---- state, breaker and metrics -------------------------------------------------------------

    def _is_current(self, engine: Engine) -> bool:
        return self._by_url.get(engine.url) is engine

    def _sync(self, engine: Engine, *, notify: bool = True, force: bool = False,
              failed: bool = False) -> None:
        """Publish metrics, and tell listeners when state or breaker changed."""
        if not self._is_current(engine):
            return
        now = (engine.state, engine.breaker.state)
        prev = self._published.get(engine.url)
        self._published[engine.url] = now
        if prev is not None and prev[0] != now[0]:
            log.log(logging.WARNING if now[0] == "unhealthy" else logging.INFO,
                    "engine %s is now %s", engine.url, now[0])
        if prev is not None and prev[1] != now[1]:
            log.warning("engine %s breaker is now %s", engine.url, now[1])
        if now[1] == "open" and (failed or prev is None or prev[1] != "open"):
            self._wake_after_cooldown(engine)   # a failure while open restarts the cooldown
        self._publish(engine)
        if notify and (force or prev != now):
            self._notify("state", engine)

    def _wake_after_cooldown(self, engine: Engine) -> None:
        """An open breaker turns half-open by the clock alone: re-check then so waiters hear about it."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return   # no loop (sync caller): the next probe round notices

        def fire() -> None:
            self._timers.pop(engine.url, None)
            self._sync(engine)

        old = self._timers.pop(engine.url, None)
        if old is not None:
            old.cancel()
        delay = self._settings.resilience.breaker_cooldown_s + 0.001
        self._timers[engine.url] = loop.call_later(delay, fire)

    def export_metrics(self) -> None:
        """Bring every engine's series up to date (called at scrape time: in-flight counts move
        between probe rounds)."""
        for engine in self.engines:
            self._publish(engine)

    def _publish(self, engine: Engine) -> None:
        m = self._metrics
        if m is None:
            return
        for state in _STATES:
            m.engine_state.labels(engine.url, state).set(1 if engine.state == state else 0)
        m.breaker_state.labels(engine.url).set(_BREAKER_VALUE[engine.breaker.state])
        self._publish_load(engine)

    def _publish_load(self, engine: Engine) -> None:
        if self._metrics is None or not self._is_current(engine):
            return
        self._metrics.engine_inflight.labels(engine.url).set(engine.inflight_requests)
        self._metrics.engine_inflight_tokens.labels(engine.url).set(engine.inflight_tokens)

    def record_success(self, engine: Engine) -> None:
        engine.breaker.record_success()
        self._sync(engine)

    def record_failure(self, engine: Engine) -> None:
        engine.breaker.record_failure()
        self._sync(engine, failed=True)

    def release_trial(self, engine: Engine) -> None:
        """A half-open trial ended without a verdict: another request may try (waiters are woken)."""
        engine.breaker.release_trial()
        self._sync(engine, force=engine.breaker.available())

    def mark_failed(self, engine: Engine) -> None:
        """A connection failure: counts against the breaker and takes the engine out of rotation until
        the next good probe."""
        engine.breaker.record_failure()
        engine.probe_ok = False
        self._sync(engine, failed=True)

    # ---- probing --------------------------------------------------------------------------------

    async def probe_once(self) -> None:
        """One round: health (and telemetry) of every engine, then drop removed engines that are idle."""
        engines = list(self.engines)
        await asyncio.gather(*(self._probe(e) for e in engines))
        for engine in engines:
            self._sync(engine)   # also catches open → half-open by the clock
        self._drop_idle()

    async def is_gone(self, engine: Engine) -> bool:
        """After a failed call: is the engine process dead (not answering, or unhealthy)? It is then
        taken out of rotation at once instead of at the next probe round."""
        gone = await self._health(engine) is not True
        if gone:
            self.mark_failed(engine)
        return gone

    async def _health(self, engine: Engine) -> bool | None:
        """``GET /health``: True (200), False (another status, or no connection), None (no answer in
        time: a busy engine, not necessarily a dead one)."""
        try:
            resp = await self._http.get(f"{engine.url}/health", timeout=_PROBE_TIMEOUT_S)
        except httpx.TimeoutException:
            return None
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def _probe(self, engine: Engine) -> None:
        async def health() -> None:
            ok = await self._health(engine)
            if ok is None:
                # A busy engine (or a busy coordinator host) answers late; only a run of silent probes
                # means it is gone. Refused connections and bad answers count at once.
                engine.probe_timeouts += 1
                if engine.probe_timeouts >= PROBE_TIMEOUTS_UNHEALTHY:
                    engine.probe_ok = False
            else:
                engine.probe_ok = ok
                engine.probe_timeouts = 0
            if ok is False:
                engine.forget_learned()
            elif ok and engine.learning:
                await self._learn_capabilities(engine)

        async def telemetry() -> None:
            found = await scrape(self._http, engine.url, _PROBE_TIMEOUT_S)
            if found is not None:
                engine.telemetry = found
                if found.max_loras is not None:   # LoRA is on there: ask which adapters it holds
                    await self._learn_adapters(engine, found.max_loras)

        if self._telemetry:
            await asyncio.gather(health(), telemetry())
        else:
            await health()

    async def _learn_capabilities(self, engine: Engine) -> None:
        # No listener to tell: a request never waits for a capability (the scheduler refuses at once
        # when no engine has it), and the first round runs before the coordinator serves.
        if not engine.version_learned:
            answered, version = await read_version(self._http, engine.url, _PROBE_TIMEOUT_S,
                                                   engine.credentials())
            if not answered or not self._is_current(engine):
                return
            engine.version_learned, engine.vllm_version = True, version
            engine.refused = refusal("engine", engine.url, version)
            if engine.refused:
                log.error("%s; it gets no requests", engine.refused)
            elif version:
                log.info("engine %s runs vLLM %s", engine.url, version)
        if engine.tokenizer is None and engine.learned_tokenizer is None:
            found = await probe_tokenizer(self._http, engine.url, _PROBE_TIMEOUT_S)
            if found is None or not self._is_current(engine):
                return
            engine.learned_tokenizer = found
            log.info("engine %s %s (%s)", engine.url, "loads a tokenizer" if found else "loads no tokenizer",
                     "structured outputs and bad_words can run there" if found else "--tokens-only")
        if engine.native_api is not None or engine.learned_native_api is not None:
            return
        native = False   # without a tokenizer the engine's own OpenAI API cannot answer (capabilities.py)
        if engine.can(TOKENIZER):
            found = await probe_native_api(self._http, engine.url, _PROBE_TIMEOUT_S, engine.credentials())
            if found is None or not self._is_current(engine):
                return
            native = found
        engine.learned_native_api = native
        log.info("engine %s %s", engine.url, "serves its own OpenAI API (the native route may use it)"
                 if native else "does not serve its own OpenAI API")

    async def _learn_adapters(self, engine: Engine, capacity: int) -> None:
        """The adapters the engine lists in its ``/v1/models`` (those with a ``parent``) replace what
        the coordinator believed it holds (adapters.py)."""
        try:
            resp = await self._http.get(f"{engine.url}/v1/models", timeout=_PROBE_TIMEOUT_S,
                                        headers=engine.credentials())
            cards = resp.json().get("data") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        if not isinstance(cards, list) or not self._is_current(engine):
            return
        names = [c["id"] for c in cards
                 if isinstance(c, dict) and c.get("parent") and isinstance(c.get("id"), str)]
        came, went = engine.adapters.learn(names, capacity)
        if came or went:
            log.info("engine %s holds LoRA adapters %s (found %s, gone %s)", engine.url,
                     sorted(engine.adapters.held), sorted(came), sorted(went))

    async def discover_once(self) -> None:
        """One discovery round over every configured Service (no-op without any)."""
        if not self._discovery:
            return
        await asyncio.gather(*(d.discover() for d in self._discovery))
        self._apply(self._merged())

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Discover (when configured) and probe once before serving, then keep doing both."""
        await self.discover_once()
        await self.probe_once()
        self._tasks.append(asyncio.create_task(self._every(self._interval, self.probe_once),
                                               name="engine-health"))
        if self._discovery:
            interval = min(d.interval_s for d in self._discovery)
            self._tasks.append(asyncio.create_task(
                self._every(interval, self.discover_once), name="engine-discovery"))

    @staticmethod
    async def _every(interval_s: float, job: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await job()
            except Exception:   # a bad round must not end the loop
                log.exception("engine registry background round failed")

    async def stop(self) -> None:
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
