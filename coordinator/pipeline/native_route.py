"""The native route: a request served by an engine's own OpenAI API instead of the token-only path.

Why it exists: render and derender live in the same sidecar, so a request tokenized locally while the
sidecar is down (``render.py``, the render fallback) cannot be derendered; and an engine fleet whose
token-only route is missing (every attempt answered a bare 404 or a 501) cannot take token ids at all.
Engines marked ``native_api`` (``vllm serve --enable-scale-out``) tokenize, sample and detokenize
themselves, so such a request can still be answered.

Rules, in one place:

* **When.** ``ctx.route == "native"`` (set by the render fallback, or by the native chain for a
  Messages or Responses body, ``native_api.py``), or the token-only route raised
  ``TokenRouteMissing`` before anything reached the client (``ctx.visible`` false). Never after a
  chunk was sent, never with token obfuscation on (the engine would see plain ids and text: refused,
  fail closed, 503), never for P/D: union placements on ``native_api`` engines only.
* **Admission and placement** as on the token-only path: one reservation for the whole request
  (every prompt's ids + ``max_tokens * n``), the scheduler's filters and scorers over the union
  engines marked ``native_api``. The attempt rules are the token-only path's own
  (``topology/attempts.py``): the same breaker feeding, queue-delay accounting, death counting and
  retry policy (jittered backoff, ``resilience.retries``, ``retries_after_engine_death``), so a failure
  before the first chunk may go to another native engine; the budget is released however the
  request ends.
* **The body** is the client's validated OpenAI body (``model`` = the served name) plus an explicit
  ``max_tokens`` when the client set none (the coordinator's default cap, and what admission
  reserved). The engine's response ``id`` becomes ``ctx.response_id``; everything else is the engine's.
  Another API's body (``ctx.native_api``) goes to that API's route and keeps the engine's ids.
* **Streaming** passes the engine's SSE chunks through. Closing the stream (client gone, failure)
  closes the engine response, which vLLM turns into an abort.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from coordinator.observability import tracing
from coordinator.observability.events import event
from coordinator.pipeline.admission.controller import Grant
from coordinator.pipeline.catalog import ModelEntry
from coordinator.pipeline.context import RequestContext
from coordinator.pipeline.engines.capabilities import NATIVE_API
from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.engines.http_errors import EngineUnreachable
from coordinator.pipeline.engines.native import NativeClient
from coordinator.pipeline.engines.registry import EngineRegistry
from coordinator.pipeline.errors import (
    PipelineError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from coordinator.pipeline.scheduling.request import SchedRequest
from coordinator.pipeline.topology.attempts import Attempts
from coordinator.pipeline.topology.legs import attempt_id

log = logging.getLogger(__name__)

# The body fields that bound the output, per API (the first is set when the client set none).
_BUDGET_FIELDS: dict[str, tuple[str, ...]] = {
    "chat": ("max_tokens", "max_completion_tokens"), "completion": ("max_tokens",),
    "messages": ("max_tokens",), "responses": ("max_output_tokens",)}


class NativeRouteRefused(PipelineError):
    """Token obfuscation is on: nothing may go to an engine's OpenAI API (fail closed)."""

    status = 503
    type = "ServiceUnavailableError"


class NativeRoute:
    """Admission, placement on a ``native_api`` union engine, the call, breaker feeding and release."""

    def __init__(self, client: NativeClient, registry: EngineRegistry, attempts: Attempts, *,
                 obfuscated: Callable[[], bool] = lambda: False) -> None:
        """``obfuscated`` says whether token obfuscation is on (read per request)."""
        self.client = client
        self._registry = registry
        self._attempts = attempts
        self._obfuscated = obfuscated
        self._context_lengths: dict[str, int] = {}

    # -- may the request take this route? ------------------------------------------------------
    def refusal(self, model: str, why: str) -> PipelineError | None:
        """The error to answer instead, when the native route cannot serve ``model``; ``why`` says what
        made the token-only route impossible (it leads the message)."""
        if self._obfuscated():
            return NativeRouteRefused(f"{why}, and token obfuscation forbids the native OpenAI route")
        if not self._native_engines(model):
            return UpstreamUnavailable(f"{why}, and no engine serves the OpenAI API for model {model!r} "
                                       f"(learned from each engine, or engines[].native_api)")
        return None

    def available(self) -> bool:
        """Some healthy engine could serve a request through its OpenAI API now (readiness)."""
        return not self._obfuscated() and any(
            e.can(NATIVE_API) and e.role == "union" and e.healthy for e in self._registry.engines)

    def takes_over(self, ctx: RequestContext, error: PipelineError) -> bool:
        """After the token-only route failed with ``error`` (TokenRouteMissing): switch to this route
        when nothing was sent yet and the route may serve the model."""
        if ctx.visible or self.refusal(ctx.model, error.message) is not None:
            return False
        ctx.route = "native"
        event(log, "native_route", ctx.request_id, level=logging.WARNING, reason=error.message)
        return True

    async def context_length(self, entry: ModelEntry) -> int | None:
        """``max_model_len`` when render never answered: configured or learned, else what a native
        engine reports on ``/v1/models`` (remembered)."""
        if entry.max_model_len is not None:
            return entry.max_model_len
        if entry.name in self._context_lengths:
            return self._context_lengths[entry.name]
        for engine in self._native_engines(entry.name):
            found = await self.client.max_model_len(engine, entry.name)
            if found is not None:
                self._context_lengths[entry.name] = found
                return found
        return None

    # -- serving -------------------------------------------------------------------------------
    async def complete(self, ctx: RequestContext) -> dict[str, Any]:
        """A non-streaming request through an engine's OpenAI API."""
        req, body = self._prepare(ctx)
        async for attempt in self._attempts.retrying(req):
            with attempt:
                out = await self._complete_once(ctx, body, req)
                if ctx.native_api is None:  # another API's answer keeps the engine's own id
                    out["id"] = ctx.response_id
                return out
        raise AssertionError("unreachable: tenacity re-raises the last failure")

    async def open_stream(self, ctx: RequestContext) -> NativeStream:
        """Open the engine stream (HTTP 200) before the client's response headers go out."""
        req, body = self._prepare(ctx)
        async for attempt in self._attempts.retrying(req):
            with attempt:
                return await self._open_once(ctx, body, req)
        raise AssertionError("unreachable: tenacity re-raises the last failure")

    async def _complete_once(self, ctx: RequestContext, body: dict[str, Any],
                             req: SchedRequest) -> dict[str, Any]:
        grant = await self._attempts.admit(req)
        engine = grant.placement.engine
        try:
            with self._attempts.outcome(engine, req, "native"), tracing.engine_leg("native", engine.url):
                return await self.client.complete(engine, ctx.native_api or ctx.kind, body, _attempt_id(ctx))
        except BaseException as exc:
            await self._attempts.count_death(grant, exc, req)
            raise
        finally:
            self._attempts.release(grant)

    async def _open_once(self, ctx: RequestContext, body: dict[str, Any], req: SchedRequest) -> NativeStream:
        grant = await self._attempts.admit(req)
        engine = grant.placement.engine
        stack = contextlib.AsyncExitStack()
        leg = tracing.stream_leg("native", engine.url, ends_with=stack)
        try:
            with self._attempts.outcome(engine, req, "native", ok="streaming"), tracing.opening(leg):
                chunks = await stack.enter_async_context(
                    self.client.stream(engine, ctx.native_api or ctx.kind, body, _attempt_id(ctx)))
        except BaseException as exc:
            await stack.aclose()
            await self._attempts.count_death(grant, exc, req)
            self._attempts.release(grant)
            raise
        return NativeStream(ctx, self._attempts, grant, stack, chunks, req)

    async def count_tokens(self, model: str, body: dict[str, Any], request_id: str,
                           why: UpstreamUnavailable | UpstreamTimeout) -> int:
        """A Messages prompt's token count from a native engine's own route (nothing is generated, so
        nothing is admitted); an engine that cannot be reached gives way to the next."""
        require(self, model, why.message, type(why))
        error: PipelineError = why
        for engine in self._native_engines(model):
            try:
                return await self.client.count_tokens(engine, body, request_id)
            except EngineUnreachable as exc:
                error = exc
        raise error

    # -- helpers -------------------------------------------------------------------------------
    def _prepare(self, ctx: RequestContext) -> tuple[SchedRequest, dict[str, Any]]:
        error = self.refusal(ctx.model, "the token-only route is unavailable")
        if error is not None:
            raise error
        ctx.route = "native"
        plans = ctx.prompts
        body = dict(ctx.body)
        if ctx.adapter is not None:  # the engine's own API runs the adapter by its name
            body["model"] = ctx.adapter
        budget = _BUDGET_FIELDS[ctx.native_api or ctx.kind]
        if plans and all(body.get(f) is None for f in budget):
            body[budget[0]] = min(p.max_tokens for p in plans)
        # One reservation for the whole request: the first prompt's ids (what the engine's prefix cache
        # will hold), and every other prompt and output token in max_tokens.
        first = plans[0].prompt_token_ids if plans else []
        cost = sum(p.prompt_tokens + p.max_tokens * p.n for p in plans) - len(first)
        salt = body.get("cache_salt")
        req = SchedRequest(request_id=ctx.request_id, model=ctx.model, prompt_token_ids=first,
                           max_tokens=max(1, cost), priority=ctx.priority, tenant=ctx.tenant,
                           cache_salt=salt if isinstance(salt, str) else None,
                           needs=frozenset({NATIVE_API}), lora=ctx.adapter)
        return req, body

    def _native_engines(self, model: str) -> list[Engine]:
        """Union engines serving their OpenAI API (configured or learned) for ``model`` whatever their
        state, healthy ones first."""
        engines = [e for e in self._registry.engines
                   if e.can(NATIVE_API) and e.role == "union" and e.serves(model)]
        return sorted(engines, key=lambda e: not e.healthy)


def require(route: NativeRoute, model: str, why: str,
            error: type[UpstreamUnavailable] | type[UpstreamTimeout]) -> None:
    """Raise ``route.refusal``'s answer when the route cannot serve ``model``: the caller's ``error``
    type (502, or 504 after a timeout) for a missing engine; the obfuscation refusal as it is."""
    refusal = route.refusal(model, why)
    if refusal is not None:
        raise error(refusal.message) if isinstance(refusal, UpstreamUnavailable) else refusal


class NativeStream:
    """One native engine stream as the SSE writer sees it; owns the grant until closed."""

    def __init__(self, ctx: RequestContext, attempts: Attempts, grant: Grant,
                 stack: contextlib.AsyncExitStack, chunks: AsyncIterator[dict[str, Any]],
                 req: SchedRequest) -> None:
        self.ctx = ctx
        self._attempts = attempts
        self._grant = grant
        self._stack = stack
        self._chunks = chunks
        self._req = req
        self._closed = False

    @property
    def buffered_tokens(self) -> int:
        return 0  # chunks are passed on one at a time; the engine's socket holds the rest

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The engine's chunks with the response id rewritten. Raises on failure (after feeding the
        engine's breaker: a mid-stream failure is the engine's)."""
        engine = self._grant.placement.engine
        rewrite = self.ctx.native_api is None  # another API's events keep the engine's own ids
        try:
            async for chunk in self._chunks:
                if rewrite:
                    chunk["id"] = self.ctx.response_id
                self.ctx.visible = True
                yield chunk
        except (UpstreamUnavailable, UpstreamTimeout) as exc:
            self._attempts.failed(engine, exc, self._req)
            event(log, "leg", self._req.request_id, level=logging.WARNING, engine=engine.url,
                  phase="stream", result=type(exc).__name__, error=str(exc))
            raise

    async def aclose(self) -> None:
        """Close the engine response (vLLM aborts the request) and give the budget back."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._stack.aclose()
        finally:
            self._attempts.release(self._grant)


def _attempt_id(ctx: RequestContext) -> str:
    return attempt_id(ctx.request_id, "n")
