"""One engine attempt's rules, in one place: admit, judge the outcome, count deaths, retry, release.

Every route that calls an engine goes through ``Attempts``: the token-only topologies (``Dispatcher``
and the streaming leg ``EngineStream``) and the native route (an engine's own OpenAI API). So an
engine is judged the same whichever route a request used, and a request is retried by one policy:

* **Admit** through admission control, noting the queue delay on the request's observation record.
* **Outcome** of each engine call feeds the engine's breaker and writes one ``leg`` event:
  a client error is a success for the engine (it answered; the request was at fault); a busy
  answer (408/425/429/503) and a missing token route are successes too, but the request must try
  elsewhere; unreachable, 5xx and broken replies are the engine's failures; a cancelled call judges
  nothing.
* **Deaths**: an engine that failed after receiving the request and is now gone may have been
  killed by it, so it is counted and ``resilience.retries_after_engine_death`` bounds how many
  engines one request can cost.
* **Retry** (tenacity, jittered exponential backoff, ``resilience.retries``) before the first
  byte reached the client, always on an engine this request has not failed on. Retryable: the
  engine could not be reached, failed (5xx, a broken non-streaming reply) or was busy. Not: client
  errors, our own timeouts (the request may be what is slow), errors inside a stream (the
  streaming leg relays those, ``engine_stream.py``).
* **Release** gives the grant's budget back; a removed engine leaves the pool once its last
  request ends.

What a topology adds on top (which legs, in what order, with which bodies) is the ``Opener``
side: ``opening.AttemptOpener`` implements it, and ``EngineStream`` only knows that Protocol, so
neither imports the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from coordinator.config import ResilienceSettings
from coordinator.contracts.generate import GenerateRequest, StreamChunk
from coordinator.observability import tracing
from coordinator.observability.events import event
from coordinator.observability.metrics import Metrics
from coordinator.observability.record import note_queue_delay
from coordinator.pipeline.admission.controller import AdmissionController, Grant, PrefillTokens, no_prefill
from coordinator.pipeline.engines.adapters import Adapter
from coordinator.pipeline.engines.capabilities import Capability
from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.engines.http_errors import EngineStreamError, EngineUnreachable
from coordinator.pipeline.engines.lora import AdapterLoader, AdapterLoadFailed
from coordinator.pipeline.engines.registry import EngineRegistry
from coordinator.pipeline.errors import (
    EngineBusy,
    TokenRouteMissing,
    UpstreamClientError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from coordinator.pipeline.scheduling.request import SchedRequest
from coordinator.pipeline.scheduling.scheduler import Scheduler

if TYPE_CHECKING:
    from coordinator.observability.tracing import Leg
    from coordinator.pipeline.context import PromptPlan, RequestContext

log = logging.getLogger(__name__)


def retryable(exc: BaseException) -> bool:
    """A failure of the engine, not of the request, before anything streamed (see the module doc)."""
    if isinstance(exc, EngineBusy):
        return True
    return isinstance(exc, UpstreamUnavailable) and not isinstance(exc, EngineStreamError)


def adapter_gone(exc: BaseException, req: SchedRequest) -> bool:
    """The engine no longer knows the request's adapter (vLLM's 404 "The model `name` does not
    exist."): someone unloaded it since the coordinator last looked (another coordinator making room,
    an operator, an engine restart). Loading it again is worth one more attempt."""
    return (req.lora is not None and isinstance(exc, UpstreamClientError) and exc.status == 404
            and f"`{req.lora}`" in exc.message)


def reached_engine(exc: BaseException) -> bool:
    """A failure after the engine received the request: it may be the request that broke it. A busy
    answer is not one (the engine answered, and it is alive)."""
    return retryable(exc) and not isinstance(exc, EngineUnreachable | EngineBusy)


class Attempts:
    """Admission, outcome, death counting, the retry policy and release of engine attempts."""

    def __init__(self, registry: EngineRegistry, scheduler: Scheduler, admission: AdmissionController,
                 resilience: ResilienceSettings, metrics: Metrics | None = None,
                 adapters: Callable[[str], Adapter | None] | None = None,
                 loader: AdapterLoader | None = None) -> None:
        """``adapters`` names the LoRA adapters (the catalog's); ``loader`` makes engines hold them."""
        self._registry = registry
        self._scheduler = scheduler
        self._admission = admission
        self.resilience = resilience
        self._metrics = metrics
        self._adapters = adapters
        self._loader = loader

    def capable(self, model: str, needs: frozenset[Capability]) -> bool:
        """Whether some engine of ``model`` can run what ``needs`` names (whatever its state now)."""
        return self._scheduler.capable(model, needs)

    async def admit(self, req: SchedRequest, *, prefill_tokens: PrefillTokens = no_prefill) -> Grant:
        """A grant and placement for ``req`` (waits in the admission queue if it must)."""
        await self._scheduler.prefetch(req)   # the pod indexer's match, when it holds the index
        with tracing.stage("admission", attributes={"coordinator.priority": req.priority,
                                                    "coordinator.admission.cost_tokens": req.cost_tokens}):
            grant = await self._admission.admit(req, tracing.placing(self._scheduler.place),
                                                prefill_tokens=prefill_tokens)
        note_queue_delay(grant.waited_s)  # the request's observation record (runs in its task)
        if req.lora is not None:
            try:
                for engine in grant.placement.engines:  # both legs of a P/D pair run the adapter
                    await self._hold_adapter(grant, engine, req)
            except BaseException:
                self.release(grant)
                raise
        return grant

    async def _hold_adapter(self, grant: Grant, engine: Engine, req: SchedRequest) -> None:
        """``engine`` holds the request's adapter (loaded if it must be) and counts it running until
        the grant is released; a failed load steers a retry elsewhere (``AdapterLoadFailed`` is busy)."""
        name = req.lora
        adapter = self._adapters(name) if self._adapters is not None and name is not None else None
        if adapter is None or self._loader is None:
            return
        try:
            await self._loader.ensure(engine, adapter)
        except AdapterLoadFailed as exc:
            self.failed(engine, exc, req)
            raise
        engine.adapters.begin(adapter.name)
        grant.when_released(lambda: engine.adapters.end(adapter.name))

    @contextlib.contextmanager
    def outcome(self, engine: Engine, req: SchedRequest, phase: str, ok: str = "ok") -> Iterator[None]:
        """Around one engine call: its success or failure feeds the engine's breaker and is logged."""
        try:
            yield
        except BaseException as exc:
            self.failed(engine, exc, req)
            event(log, "leg", req.request_id, level=_level(exc), engine=engine.url, phase=phase,
                  result="cancelled" if isinstance(exc, asyncio.CancelledError) else type(exc).__name__)
            raise
        self._registry.record_success(engine)
        event(log, "leg", req.request_id, engine=engine.url, phase=phase, result=ok)

    def failed(self, engine: Engine, exc: BaseException, req: SchedRequest) -> None:
        """Feed ``engine``'s breaker with a failed call and steer a retry of ``req`` away from it."""
        if isinstance(exc, asyncio.CancelledError):
            self._registry.release_trial(engine)
        elif isinstance(exc, EngineBusy | TokenRouteMissing):
            req.exclude.add(engine.url)  # healthy, but not for this request now
            self._registry.record_success(engine)
        elif isinstance(exc, UpstreamClientError):
            self._registry.record_success(engine)
            if req.lora is not None and adapter_gone(exc, req):
                engine.adapters.unloaded(req.lora)   # the next attempt loads it again
        elif isinstance(exc, UpstreamUnavailable | UpstreamTimeout):
            req.exclude.add(engine.url)
            if self._metrics is not None:
                self._metrics.engine_failures.labels(engine.url).inc()
            if isinstance(exc, EngineUnreachable):
                self._registry.mark_failed(engine)
            else:
                self._registry.record_failure(engine)

    async def count_death(self, grant: Grant, exc: BaseException, req: SchedRequest) -> None:
        """Count each engine of the grant that failed this request and is now gone."""
        if not reached_engine(exc):
            return
        for engine in grant.placement.engines:
            if engine.url in req.exclude and await self._registry.is_gone(engine):
                req.engine_deaths += 1
                log.error("engine %s died while running request %s", engine.url, req.request_id)
                if self._metrics is not None:
                    self._metrics.engine_deaths.inc()

    def release(self, grant: Grant) -> None:
        """Give the grant's budget back; a removed engine leaves the pool once its last request ends."""
        grant.release()
        for engine in grant.placement.engines:
            self._registry.on_idle(engine)

    def has_other_engine(self, req: SchedRequest) -> bool:
        return self._scheduler.has_other_engine(req)

    async def add_prefill(self, grant: Grant, req: SchedRequest) -> Engine:
        """A trigger pair's prefill engine, chosen when its decode engine calls back, and its share of
        the budget (the prompt and one token) held on the grant; it holds the request's adapter."""
        engine = self._scheduler.place_prefill(req)
        grant.add_engine(engine, req.prompt_tokens + 1)
        grant.placement.prefill = engine
        if req.lora is not None:
            await self._hold_adapter(grant, engine, req)
        return engine

    def retrying(self, req: SchedRequest) -> AsyncRetrying:
        """The one retry policy (module doc): tenacity with jittered exponential backoff."""
        r = self.resilience

        def worth_retrying(exc: BaseException) -> bool:
            if req.engine_deaths > r.retries_after_engine_death:
                log.error("request %s is not retried: %d engines died while running it", req.request_id,
                          req.engine_deaths)
                return False
            if adapter_gone(exc, req):
                return True
            return retryable(exc) and self._scheduler.has_other_engine(req)

        def count(state: RetryCallState) -> None:
            if self._metrics is not None:
                self._metrics.retries.inc()
            log.warning("retrying %s on another engine after: %s", req.request_id,
                        state.outcome.exception() if state.outcome else None)

        wait = wait_random_exponential(multiplier=r.backoff_initial_s, max=r.backoff_max_s)
        return AsyncRetrying(stop=stop_after_attempt(1 + r.retries), wait=wait,
                             retry=retry_if_exception(worth_retrying), before_sleep=count, reraise=True)

    def count_relay(self) -> None:
        if self._metrics is not None:
            self._metrics.relays.inc()


def _level(exc: BaseException) -> int:
    return logging.WARNING if isinstance(exc, UpstreamUnavailable | UpstreamTimeout | EngineBusy) \
        else logging.INFO


class Opener(Protocol):
    """A topology's side of a streaming attempt: what ``EngineStream`` asks of ``opening.AttemptOpener``."""

    def sched_request(self, ctx: RequestContext, plan: PromptPlan,
                      generate: GenerateRequest) -> SchedRequest: ...

    async def open_attempt(self, ctx: RequestContext, generate: GenerateRequest, req: SchedRequest
                           ) -> tuple[Grant, contextlib.AsyncExitStack, AsyncIterator[StreamChunk],
                                      Leg | None]: ...


__all__ = ["Attempts", "Opener", "reached_engine", "retryable"]
