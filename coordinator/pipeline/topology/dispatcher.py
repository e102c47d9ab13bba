"""Engine dispatch for one prompt: admit → place → run the topology's legs, with retries.

Union: one engine prefills and decodes. Handoff (P/D): a prefill engine computes the prompt's KV
(one token, non-streaming), the decode engine continues from the ``kv_transfer_params`` it returned.
A retry happens before the first chunk, always on an engine this request has not failed on, and
always re-runs the whole topology: a decode leg is never retried with the previous prefill's (now
stale) ``kv_transfer_params``. After chunks flowed, ``EngineStream`` relays a failed stream (see
there).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from coordinator.config import ResilienceSettings, TopologySettings
from coordinator.observability import tracing
from coordinator.observability.events import event
from coordinator.observability.metrics import Metrics
from coordinator.observability.record import note_queue_delay
from coordinator.pipeline.admission.controller import AdmissionController, Grant
from coordinator.pipeline.context import PromptPlan, RequestContext
from coordinator.pipeline.engines.client import (
    EngineClient,
    EngineStreamError,
    EngineUnreachable,
    engine_request_id,
)
from coordinator.pipeline.engines.outcome import record_failure, release
from coordinator.pipeline.engines.registry import Engine, EngineRegistry
from coordinator.pipeline.errors import (
    UpstreamUnavailable,
)
from coordinator.pipeline.scheduling.request import SchedRequest
from coordinator.pipeline.scheduling.scheduler import Scheduler
from coordinator.pipeline.topology.engine_stream import EngineStream
from coordinator.pipeline.topology.legs import attempt_id, decode_body, prefill_body

log = logging.getLogger(__name__)


def retryable(exc: BaseException) -> bool:
    """Failures of the engine, not of the request: unreachable, 5xx, broken non-streaming reply.
    Not: client errors (4xx), timeouts (the request may be what is slow), errors inside a stream."""
    return isinstance(exc, UpstreamUnavailable) and not isinstance(exc, EngineStreamError)


def reached_engine(exc: BaseException) -> bool:
    """A failure after the engine received the request: it may be the request that broke it."""
    return retryable(exc) and not isinstance(exc, EngineUnreachable)


class Dispatcher:
    def __init__(self, client: EngineClient, registry: EngineRegistry, scheduler: Scheduler,
                 admission: AdmissionController, resilience: ResilienceSettings,
                 topology: TopologySettings, metrics: Metrics | None = None) -> None:
        self._client = client
        self._registry = registry
        self._scheduler = scheduler
        self._admission = admission
        self._resilience = resilience
        self._topology = topology
        self._metrics = metrics

    # -- public: what the pipeline calls ----------------------------------------------------------
    async def generate(self, ctx: RequestContext, plan: PromptPlan) -> dict[str, Any]:
        """Non-streaming: nothing reaches the client before the whole answer, so any engine failure
        may be retried elsewhere."""
        req = self.sched_request(ctx, plan, plan.generate)
        async for attempt in self._retrying(req):
            with attempt:
                return await self._generate_once(plan.generate, req)
        raise AssertionError("unreachable: tenacity re-raises the last failure")

    @contextlib.asynccontextmanager
    async def stream(self, ctx: RequestContext,
                     plan: PromptPlan) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Streaming: retries cover admission and opening the engine stream (every leg up to the
        decode engine's HTTP 200); once chunks flow, an engine failure is relayed to another engine
        (``EngineStream``) or ends the response."""
        leg = EngineStream(self, ctx, plan)
        try:
            await leg.open()
            yield leg.chunks()
        finally:
            await leg.aclose()

    # -- what an EngineStream uses -------------------------------------------------------------------
    @property
    def resilience(self) -> ResilienceSettings:
        return self._resilience

    def has_other_engine(self, req: SchedRequest) -> bool:
        return self._scheduler.has_other_engine(req)

    def count_relay(self) -> None:
        if self._metrics is not None:
            self._metrics.relays.inc()

    def release(self, grant: Grant) -> None:
        self._release(grant)

    def attempt_failed(self, engine: Engine, exc: BaseException, req: SchedRequest) -> None:
        """A failure of an engine stream after it opened: feeds the breaker like any other."""
        self._failed(engine, exc, req)

    async def count_death(self, grant: Grant, exc: BaseException, req: SchedRequest) -> None:
        await self._count_death(grant, exc, req)

    def retrying(self, req: SchedRequest) -> AsyncRetrying:
        return self._retrying(req)

    async def open_attempt(self, ctx: RequestContext, generate: dict[str, Any], req: SchedRequest
                           ) -> tuple[Grant, contextlib.AsyncExitStack, AsyncIterator[dict[str, Any]],
                                      tracing.Leg | None]:
        return await self._open_once(ctx, generate, req)

    # -- one attempt --------------------------------------------------------------------------------
    async def _generate_once(self, generate: dict[str, Any], req: SchedRequest) -> dict[str, Any]:
        grant = await self._admit(req)
        try:
            params = await self._prefill_leg(grant, generate, req)
            engine = grant.placement.engine
            rid = attempt_id(generate["request_id"])
            with self._outcome(engine, req, _phase(grant)), \
                    tracing.engine_leg(_phase(grant), engine.url, engine_request_id(rid)):
                return await self._client.generate(engine, decode_body(generate, params), rid)
        except BaseException as exc:
            await self._count_death(grant, exc, req)
            raise
        finally:
            self._release(grant)

    async def _open_once(self, ctx: RequestContext, generate: dict[str, Any], req: SchedRequest
                         ) -> tuple[Grant, contextlib.AsyncExitStack, AsyncIterator[dict[str, Any]],
                                    tracing.Leg | None]:
        grant = await self._admit(req)
        stack = contextlib.AsyncExitStack()
        try:
            params = await self._prefill_leg(grant, generate, req)
            engine = grant.placement.engine
            rid = attempt_id(generate["request_id"])
            leg = tracing.stream_leg(_phase(grant), engine.url, engine_request_id(rid), ends_with=stack)
            with self._outcome(engine, req, _phase(grant), ok="streaming"), tracing.opening(leg):
                chunks = await stack.enter_async_context(self._client.stream(
                    engine, decode_body(generate, params), rid, include_usage=ctx.include_usage))
            return grant, stack, chunks, leg
        except BaseException as exc:
            await stack.aclose()
            await self._count_death(grant, exc, req)
            self._release(grant)
            raise

    async def _prefill_leg(self, grant: Grant, generate: dict[str, Any],
                           req: SchedRequest) -> dict[str, Any] | None:
        """Run the prefill leg if the placement has one; give its budget share back as soon as it ends.

        Releasing the prefill engine's KV is the connectors' job and works from the decode side: in
        vLLM a finished prefill keeps its blocks until the decode engine reads them, or the decode
        request ends unread (an abort there notifies the prefill engine), or the lease expires;
        aborting the finished prefill itself frees nothing. A client that leaves *during* the prefill
        leg aborts it (the engine client does), which frees its blocks at once."""
        pre = grant.placement.prefill
        if pre is None:
            return None
        rid = attempt_id(generate["request_id"], "p")
        try:
            with self._outcome(pre, req, "prefill"), \
                    tracing.engine_leg("prefill", pre.url, engine_request_id(rid)):
                resp = await self._client.generate(
                    pre, prefill_body(generate, self._topology.prefill_kv_transfer_params), rid)
        finally:
            grant.release_engine(pre)
        params = resp.get("kv_transfer_params")
        return params if isinstance(params, dict) else None

    # -- helpers --------------------------------------------------------------------------------------
    def sched_request(self, ctx: RequestContext, plan: PromptPlan, generate: dict[str, Any]) -> SchedRequest:
        """What admission and the scheduler see of one attempt of ``generate`` (the plan's own
        request, or a relay's replay of it). With token obfuscation the prefix index sees the ids
        the engines see (physical ones)."""
        salt = generate.get("cache_salt")
        ids = generate.get("token_ids")
        ids = ids if isinstance(ids, list) else plan.prompt_token_ids
        obfuscator = getattr(self._client, "obfuscator", None)
        if obfuscator is not None:
            ids = obfuscator.to_physical(ids)
        return SchedRequest(request_id=generate["request_id"], model=ctx.model, prompt_token_ids=ids,
                            max_tokens=int(generate["sampling_params"]["max_tokens"]), n=plan.n,
                            priority=ctx.priority, cache_salt=salt if isinstance(salt, str) else None)

    async def _admit(self, req: SchedRequest) -> Grant:
        with tracing.stage("admission", attributes={"coordinator.priority": req.priority,
                                                    "coordinator.admission.cost_tokens": req.cost_tokens}):
            grant = await self._admission.admit(req, tracing.placing(self._scheduler.place),
                                                prefill_tokens=lambda p: req.prompt_tokens + 1)
        note_queue_delay(grant.waited_s)  # the request's observation record (runs in its task)
        return grant

    def _retrying(self, req: SchedRequest) -> AsyncRetrying:
        r = self._resilience

        def worth_retrying(exc: BaseException) -> bool:
            if req.engine_deaths > r.retries_after_engine_death:
                log.error("request %s is not retried: %d engines died while running it", req.request_id,
                          req.engine_deaths)
                return False
            return retryable(exc) and self._scheduler.has_other_engine(req)

        def count(state: RetryCallState) -> None:
            if self._metrics is not None:
                self._metrics.retries.inc()
            log.warning("retrying %s on another engine after: %s", req.request_id,
                        state.outcome.exception() if state.outcome else None)

        wait = wait_random_exponential(multiplier=r.backoff_initial_s, max=r.backoff_max_s)
        return AsyncRetrying(stop=stop_after_attempt(1 + r.retries), wait=wait,
                             retry=retry_if_exception(worth_retrying), before_sleep=count, reraise=True)

    async def _count_death(self, grant: Grant, exc: BaseException, req: SchedRequest) -> None:
        """An engine that failed after receiving the request and is now gone may have been killed by
        it: count it, so ``retries_after_engine_death`` bounds how many engines one request can cost."""
        if not reached_engine(exc):
            return
        for engine in grant.placement.engines:
            if engine.url in req.exclude and await self._registry.is_gone(engine):
                req.engine_deaths += 1
                log.error("engine %s died while running request %s", engine.url, req.request_id)
                if self._metrics is not None:
                    self._metrics.engine_deaths.inc()

    def _release(self, grant: Grant) -> None:
        release(self._registry, grant)

    @contextlib.contextmanager
    def _outcome(self, engine: Engine, req: SchedRequest, phase: str, ok: str = "ok") -> Iterator[None]:
        """Around one engine call: its success or failure feeds the engine's breaker and is logged."""
        try:
            yield
        except BaseException as exc:
            self._failed(engine, exc, req)
            event(log, "leg", req.request_id, engine=engine.url, phase=phase,
                  result="cancelled" if isinstance(exc, asyncio.CancelledError) else type(exc).__name__)
            raise
        self._registry.record_success(engine)
        event(log, "leg", req.request_id, engine=engine.url, phase=phase, result=ok)

    def _failed(self, engine: Engine, exc: BaseException, req: SchedRequest) -> None:
        record_failure(self._registry, self._metrics, engine, exc, req)


def _phase(grant: Grant) -> str:
    return "union" if grant.placement.prefill is None else "decode"


__all__ = ["Dispatcher", "retryable"]
