"""The request lifecycle, HTTP-free: validate → render → dispatch → derender.

Front doors (OpenAI HTTP, NNRP) call ``serve``: one request, counted in flight, raced against the
client leaving, answered as JSON or as an open chunk stream the door writes and then closes. The
stages (``begin``, ``complete``, ``open_stream``) stay public for tests and benchmarks. Everything
acquired for a request is released in ``finally`` blocks here, whichever way the request ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from coordinator.observability.events import event
from coordinator.observability.record import Observer, Record, current
from coordinator.pipeline import prompt_echo
from coordinator.pipeline.admission.rate_limits import TenantLimiter
from coordinator.pipeline.admission.tenants import ANONYMOUS, Tenant
from coordinator.pipeline.catalog import ModelCatalog
from coordinator.pipeline.context import ChunkStream, Kind, NativeCall, PromptPlan, RequestContext
from coordinator.pipeline.derender import batch
from coordinator.pipeline.derender.client import Derenderer, request_view
from coordinator.pipeline.derender.session import StreamSession
from coordinator.pipeline.derender.stream import Coalescing, PromptStream
from coordinator.pipeline.errors import BadRequest, ClientGone, PipelineError, TokenRouteMissing, first_leaf
from coordinator.pipeline.native_route import NativeStream
from coordinator.pipeline.render import RenderStage
from coordinator.pipeline.structured import name_constraint
from coordinator.pipeline.token_ids import check_client_ids
from coordinator.pipeline.topology.dispatcher import Dispatcher
from coordinator.pipeline.validation import validate_request

log = logging.getLogger(__name__)
T = TypeVar("T")
Gone = Callable[[], Awaitable[None]]  # completes when the client has left
OPERATIONS: dict[Kind, str] = {"chat": "chat.completions.create", "completion": "completions.create"}


@dataclass
class Served:
    """What ``Pipeline.serve`` hands a front door: a JSON response, or a stream to write and close."""

    ctx: RequestContext
    response: dict[str, Any] | None = None
    stream: ChunkStream | None = None
    _release: Callable[[], Awaitable[None]] | None = field(default=None, repr=False)

    async def aclose(self) -> None:
        """Release the stream (engine requests, quotas, the in-flight count); idempotent."""
        release, self._release = self._release, None
        if release is not None:
            await release()


class Pipeline:
    def __init__(self, *, catalog: ModelCatalog, render: RenderStage, dispatcher: Dispatcher,
                 derenderer: Derenderer, strict: bool, queue_chunks: int,
                 coalescing: Coalescing | None = None,
                 early_refusal: Callable[[int, str], None] | None = None,
                 limiter: TenantLimiter | None = None,
                 observer: Observer | None = None) -> None:
        self.catalog = catalog
        self.observer = observer  # where finished observation records go (doors start theirs here)
        self._render = render
        self._dispatch = dispatcher
        self._derender = derenderer
        self._strict = strict
        self._queue_chunks = queue_chunks
        self._coalescing = coalescing or Coalescing()
        self._early_refusal = early_refusal  # admission's "queue full" check, run before render
        self._limiter = limiter  # tenants' requests and tokens per minute
        self.inflight = 0  # client requests between begin() and their release
        self._sessions: weakref.WeakSet[StreamSession] = weakref.WeakSet()

    @property
    def buffered_tokens(self) -> int:
        """Engine tokens held by open streams, waiting for derender or for their client."""
        return sum(s.buffered_tokens for s in list(self._sessions))

    @property
    def open_sessions(self) -> int:
        """Streaming sessions not closed yet (each owns engine streams and producer tasks)."""
        return sum(1 for s in list(self._sessions) if not s.closed)

    @property
    def producer_tasks(self) -> int:
        """Producer tasks still running (each reads one engine stream for an open session)."""
        return sum(s.running_tasks for s in list(self._sessions))

    # -- lifecycle -----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def track(self) -> AsyncIterator[None]:
        """Counts a request as in flight for as long as the caller holds it."""
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    async def serve(self, kind: Kind, body: Any, request_id: str, *, priority: int | None = None,
                    gone: Gone | None = None, record: Record | None = None,
                    operation: str | None = None, tenant: Tenant = ANONYMOUS,
                    native: NativeCall | None = None) -> Served:
        """One client request, whatever the door: validate → render → admission → scheduling →
        generate → derender. Raises a ``PipelineError`` for the client, or ``ClientGone`` when ``gone``
        completes first (what was acquired is released either way). A streaming answer holds its
        resources until the door awaits ``Served.aclose()``.

        ``priority`` is the door's own priority signal (e.g. a header), used when the body has none.
        ``tenant``: whose request (the door authenticated its key); its limits apply.
        ``record`` is the door's observation record: the pipeline fills its part and the door finishes
        it; without one the pipeline makes its own and finishes it when the request is released.
        ``native``: ``body`` is another API's, for the engines' own route (``native_api.py``)."""
        own = record is None
        if record is None:
            record = self.observer.start("internal") if self.observer is not None else Record("internal")
        record.request_id, record.operation = request_id, operation or OPERATIONS.get(kind, kind)
        current.set(record)  # for admission and engine aborts, here and in the tasks this request makes
        stack = contextlib.AsyncExitStack()
        if own:
            stack.callback(record.finish)  # runs last, after every release
        await stack.enter_async_context(self.track())
        try:
            ctx = await (self.begin(kind, body, request_id, priority, record, tenant=tenant) if native is None
                         else self.begin_native(native, body, request_id, priority, record, tenant))
            if not ctx.stream:
                response = await _unless_gone(gone, self.complete(ctx))
                usage = response.get("usage") or {}
                record.usage(usage.get("prompt_tokens"), usage.get("completion_tokens"))
                record.route = ctx.route
                await stack.aclose()
                return Served(ctx, response=response)
            # Opening may wait in the admission queue: a client that leaves meanwhile gives up its place.
            session = await _unless_gone(gone, self.open_stream(ctx))
            record.route = ctx.route
            stack.push_async_callback(session.aclose)
        except BaseException as exc:
            if isinstance(exc, ClientGone):
                record.gone()
            elif isinstance(exc, Exception):
                if isinstance(exc, PipelineError):
                    name_constraint(exc, body)
                record.fail(exc, exc.status if isinstance(exc, PipelineError) else 500)
            else:
                record.cancel("cancelled")  # the caller's task was cancelled (unless the door said why)
            await stack.aclose()
            raise
        return Served(ctx, stream=session, _release=stack.aclose)

    async def prompt_tokens(self, kind: Kind, body: Any, request_id: str) -> int:
        """The prompt's token count as render makes it (a token-counting route): validated and
        rendered, never queued, nothing sent to an engine."""
        ctx = await self.begin(kind, body, request_id, admit=False)
        return sum(p.prompt_tokens for p in ctx.prompts)

    async def begin(self, kind: Kind, body: Any, request_id: str | None,
                    priority: int | None = None, record: Record | None = None, *,
                    admit: bool = True, tenant: Tenant = ANONYMOUS) -> RequestContext:
        """Validate and render; after this the prompt token ids are known.

        ``priority`` applies when the body has no ``priority`` (default 0). ``admit=False``: skip
        admission's early "queue full" refusal and the tenant's rate limits (nothing will be queued).
        The tenant's requests per minute are charged before render, its tokens per minute after."""
        body = validate_request(kind, body, strict=self._strict)
        entry = self.catalog.resolve(body.get("model"))
        body = {**body, "model": entry.name}
        check_client_ids(body, await self.catalog.vocab_size(entry), completion=kind == "completion")
        stream = bool(body.get("stream"))
        include_usage = bool(stream and (body.get("stream_options") or {}).get("include_usage"))
        ctx = RequestContext(kind=kind, request_id=request_id or uuid.uuid4().hex, body=body,
                             model=entry.name, stream=stream, include_usage=include_usage,
                             priority=_priority(body, priority), tenant=tenant.name)
        limiter = await self._front(ctx, record, tenant, admit)
        started = time.perf_counter()
        await self._render(ctx, entry)
        ctx.record.render_ms = render_ms = round((time.perf_counter() - started) * 1000, 2)
        ctx.record.prompt_tokens = prompt_tokens = sum(p.prompt_tokens for p in ctx.prompts)
        event(log, "render", ctx.request_id, model=ctx.model, tokenizer_source=ctx.tokenizer_source,
              route=ctx.route, prompts=len(ctx.prompts), prompt_tokens=prompt_tokens, latency_ms=render_ms)
        if admit and ctx.route == "tokens":  # the native route's engines compile their own grammars
            self._dispatch.check_capable(ctx)
        ctx.derender_request = request_view(ctx)
        await self._charge_tokens(ctx, tenant, limiter)
        return ctx

    async def begin_native(self, call: NativeCall, body: Any, request_id: str, priority: int | None,
                           record: Record | None, tenant: Tenant) -> RequestContext:
        """``begin`` for another API's request on the native chain: the model resolved, the tenant's
        limits and admission's early refusal applied, the prompt's size estimated (``native_api.py``)."""
        if not isinstance(body, dict):
            raise BadRequest("Request body must be a JSON object")
        entry = self.catalog.resolve(body.get("model"))
        body = {**body, "model": entry.name}
        own = body.get("priority")  # Responses has one (vLLM's); the engine checks its type
        ctx = RequestContext(kind="chat", request_id=request_id, body=body, model=entry.name,
                             stream=body.get("stream") is True, include_usage=False, tenant=tenant.name,
                             priority=own if type(own) is int else priority or 0)
        limiter = await self._front(ctx, record, tenant, admit=True)
        await self._render.native_api(ctx, entry, call)
        ctx.record.prompt_tokens = sum(p.prompt_tokens for p in ctx.prompts)
        await self._charge_tokens(ctx, tenant, limiter)
        return ctx

    async def native_count_tokens(self, call: NativeCall, body: dict[str, Any], request_id: str) -> int:
        """``/v1/messages/count_tokens`` on the native chain: a native engine counts (exactly, with its
        own conversion and template); without one, the sidecar's error (``call.reason``)."""
        entry = self.catalog.resolve(body.get("model"))
        route = self._render.native_route
        if route is None:
            raise call.reason
        return await route.count_tokens(entry.name, {**body, "model": entry.name}, request_id, call.reason)

    async def _front(self, ctx: RequestContext, record: Record | None, tenant: Tenant,
                     admit: bool) -> TenantLimiter | None:
        """What every request meets before its prompt is known: its record filled, the tenant's
        requests per minute charged and admission's early "queue full" refusal. Returns the limiter
        that charges its tokens after (None: no limits apply)."""
        if record is not None:
            ctx.record = record
            record.model, record.stream, record.tenant = ctx.model, ctx.stream, tenant.name
        limiter = self._limiter if admit else None
        if limiter is not None:
            ctx.rate_headers = await limiter.requests(tenant)
        if admit and self._early_refusal is not None:
            self._early_refusal(ctx.priority, tenant.name)
        return limiter

    @staticmethod
    async def _charge_tokens(ctx: RequestContext, tenant: Tenant, limiter: TenantLimiter | None) -> None:
        """What OpenAI counts against tokens per minute: the prompt plus every token it may write."""
        if limiter is not None:
            cost = sum(p.prompt_tokens + p.max_tokens * p.n for p in ctx.prompts)
            ctx.rate_headers.update(await limiter.tokens(tenant, cost))

    # -- non-streaming -------------------------------------------------------------------------
    async def complete(self, ctx: RequestContext) -> dict[str, Any]:
        """One JSON response. Stop strings need incremental text, so those prompts stream internally."""
        native = self._render.native_route
        if ctx.route == "native" and native is not None:  # render fallback (render.py)
            return await native.complete(ctx)
        try:
            async with asyncio.TaskGroup() as tg:  # one failure cancels and awaits the siblings
                tasks = [tg.create_task(self._collect(ctx, p) if p.stop.active
                                        else self._dispatch.generate(ctx, p)) for p in ctx.prompts]
        except BaseExceptionGroup as group:
            error = first_leaf(group)
            if isinstance(error, TokenRouteMissing) and native is not None and native.takes_over(ctx, error):
                return await native.complete(ctx)
            raise error from None
        responses = [t.result() for t in tasks]
        ctx.record.engine_chunk()  # the engines' whole output is in
        trimmed, blank = batch.trim(ctx, responses)
        out = await self._derender.batch(ctx, trimmed)
        batch.finish(ctx, out, responses, trimmed, blank)
        await prompt_echo.complete(ctx, out, responses, self._dispatch, self._derender)
        return out

    async def _collect(self, ctx: RequestContext, plan: PromptPlan) -> dict[str, Any]:
        """Stream one prompt internally until done or stopped; return it as a GenerateResponse."""
        ps = PromptStream(ctx, plan, self._derender, collect=True, coalescing=self._coalescing)

        async def discard(_: dict[str, Any]) -> None:
            return None

        async with self._dispatch.stream(ctx, plan) as chunks:
            await ps.run(chunks, discard)
        return batch.collected(ctx, plan, ps)

    # -- streaming -----------------------------------------------------------------------------
    async def open_stream(self, ctx: RequestContext) -> StreamSession | NativeStream:
        """Open every engine stream before the first byte goes to the client."""
        native = self._render.native_route
        if ctx.route == "native" and native is not None:  # render fallback (render.py)
            return await native.open_stream(ctx)
        session = StreamSession(ctx, self._dispatch.stream, self._derender, self._queue_chunks,
                                self._coalescing)
        self._sessions.add(session)
        try:
            await session.open(await prompt_echo.for_streams(ctx, self._dispatch, self._derender))
        except TokenRouteMissing as exc:  # no engine serves token ids; nothing was sent yet
            await session.aclose()
            if native is None or not native.takes_over(ctx, exc):
                raise
            return await native.open_stream(ctx)
        except BaseException:
            await session.aclose()
            raise
        return session


def _priority(body: dict[str, Any], door: int | None) -> int:
    if body.get("priority") is not None:
        return int(body["priority"])  # validated as an integer
    return door if door is not None else 0


async def _unless_gone(gone: Gone | None, work: Awaitable[T]) -> T:
    """Run ``work`` but cancel it (releasing everything it holds) if the client leaves first."""
    if gone is None:
        return await work
    main = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({main, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not main.done():
            main.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await main
            watch.cancel()
            raise ClientGone()
        watch.cancel()
    return main.result()
