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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from coordinator.observability.events import event
from coordinator.observability.record import Observer, Record, current
from coordinator.pipeline import prompt_echo
from coordinator.pipeline.admission.front import FrontGate
from coordinator.pipeline.admission.tenants import ANONYMOUS, Tenant
from coordinator.pipeline.catalog import ModelCatalog
from coordinator.pipeline.context import ChunkStream, Kind, NativeCall, RequestContext
from coordinator.pipeline.derender import Derender, StreamSession, request_view
from coordinator.pipeline.errors import (
    BadRequest,
    ClientGone,
    Gone,
    PipelineError,
    TokenRouteMissing,
    first_leaf,
    unless_gone,
)
from coordinator.pipeline.native_route import NativeRoute, NativeStream
from coordinator.pipeline.render import RenderStage
from coordinator.pipeline.structured import name_constraint
from coordinator.pipeline.token_ids import check_client_ids
from coordinator.pipeline.topology.dispatcher import Dispatcher
from coordinator.pipeline.validation import validate_request

log = logging.getLogger(__name__)
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
                 derender: Derender, strict: bool, front: FrontGate | None = None,
                 observer: Observer | None = None, native: NativeRoute | None = None) -> None:
        self.catalog = catalog
        self.derender = derender  # its open sessions feed the gauges
        self.observer = observer  # where finished observation records go (doors start theirs here)
        self._render = render
        self._dispatch = dispatcher
        self._strict = strict
        self._front = front or FrontGate()  # tenants' rate limits, admission's early refusal
        self._native = native  # the engines' own API: render's fallback, other APIs' native chain
        self.inflight = 0  # client requests between begin() and their release

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
                response = await unless_gone(gone, self.complete(ctx))
                usage = response.get("usage") or {}
                record.usage(usage.get("prompt_tokens"), usage.get("completion_tokens"))
                record.route = ctx.route
                await stack.aclose()
                return Served(ctx, response=response)
            # Opening may wait in the admission queue: a client that leaves meanwhile gives up its place.
            session = await unless_gone(gone, self.open_stream(ctx))
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
        """The prompt's token count as render makes it: validated, rendered, never queued or sent."""
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
        entry, adapter = self.catalog.resolve_named(body.get("model"))
        body = {**body, "model": entry.name}
        check_client_ids(body, await self.catalog.vocab_size(entry), completion=kind == "completion")
        stream = bool(body.get("stream"))
        include_usage = bool(stream and (body.get("stream_options") or {}).get("include_usage"))
        ctx = RequestContext(kind=kind, request_id=request_id or uuid.uuid4().hex, body=body,
                             model=entry.name, stream=stream, include_usage=include_usage,
                             priority=priority or 0, tenant=tenant.name, adapter=adapter)
        if body.get("priority") is not None:  # the body's own wins (validated as an integer)
            ctx.priority = int(body["priority"])
        await self._enter(ctx, record, tenant, admit)
        started = time.perf_counter()
        await self._render(ctx, entry)
        ctx.record.render_ms = render_ms = round((time.perf_counter() - started) * 1000, 2)
        ctx.record.prompt_tokens = prompt_tokens = sum(p.prompt_tokens for p in ctx.prompts)
        event(log, "render", ctx.request_id, model=ctx.model, tokenizer_source=ctx.tokenizer_source,
              route=ctx.route, prompts=len(ctx.prompts), prompt_tokens=prompt_tokens, latency_ms=render_ms)
        if admit and ctx.route == "tokens":  # the native route's engines compile their own grammars
            self._dispatch.check_capable(ctx)
        ctx.derender_request = request_view(ctx)
        if admit:
            await self._front.after_render(ctx, tenant)
        return ctx

    async def begin_native(self, call: NativeCall, body: Any, request_id: str, priority: int | None,
                           record: Record | None, tenant: Tenant) -> RequestContext:
        """``begin`` for another API's request on the native chain: the model resolved, the tenant's
        limits and admission's early refusal applied, the prompt's size estimated (``native_api.py``)."""
        if not isinstance(body, dict):
            raise BadRequest("Request body must be a JSON object")
        entry, adapter = self.catalog.resolve_named(body.get("model"))
        body = {**body, "model": entry.name}
        own = body.get("priority")  # Responses has one (vLLM's); the engine checks its type
        ctx = RequestContext(kind="chat", request_id=request_id, body=body, model=entry.name,
                             stream=body.get("stream") is True, include_usage=False, tenant=tenant.name,
                             priority=own if type(own) is int else priority or 0, adapter=adapter)
        await self._enter(ctx, record, tenant, admit=True)
        await self._render.native_api(ctx, entry, call)
        ctx.record.prompt_tokens = sum(p.prompt_tokens for p in ctx.prompts)
        await self._front.after_render(ctx, tenant)
        return ctx

    async def native_count_tokens(self, call: NativeCall, body: dict[str, Any], request_id: str) -> int:
        """``/v1/messages/count_tokens`` on the native chain: a native engine counts (exactly, with its
        own conversion and template); without one, the sidecar's error (``call.reason``)."""
        name = self.catalog.resolve(body.get("model")).name
        if self._native is None:
            raise call.reason
        return await self._native.count_tokens(name, {**body, "model": name}, request_id, call.reason)

    async def _enter(self, ctx: RequestContext, record: Record | None, tenant: Tenant, admit: bool) -> None:
        """Before the prompt is known: the door's record filled, then the front gate (unless nothing
        will be queued)."""
        if record is not None:
            ctx.record = record
            record.model, record.stream, record.tenant = ctx.public_model, ctx.stream, tenant.name
        if admit:
            await self._front.before_render(ctx, tenant)

    # -- non-streaming -------------------------------------------------------------------------
    async def complete(self, ctx: RequestContext) -> dict[str, Any]:
        """One JSON response. Stop strings need incremental text, so those prompts stream internally."""
        native = self._native
        if ctx.route == "native" and native is not None:  # render fallback (render.py)
            return await native.complete(ctx)
        try:
            async with asyncio.TaskGroup() as tg:  # one failure cancels and awaits the siblings
                tasks = [tg.create_task(self.derender.collect(ctx, p, self._dispatch.stream(ctx, p))
                                        if p.stop.active else self._dispatch.generate(ctx, p))
                         for p in ctx.prompts]
        except BaseExceptionGroup as group:
            error = first_leaf(group)
            if isinstance(error, TokenRouteMissing) and native is not None and native.takes_over(ctx, error):
                return await native.complete(ctx)
            raise error from None
        responses = [t.result() for t in tasks]
        ctx.record.engine_chunk()  # the engines' whole output is in
        out = await self.derender.answer(ctx, responses)
        await prompt_echo.complete(ctx, out, responses, self._dispatch, self.derender.client)
        return out

    # -- streaming -----------------------------------------------------------------------------
    async def open_stream(self, ctx: RequestContext) -> StreamSession | NativeStream:
        """Open every engine stream before the first byte goes to the client."""
        native = self._native
        if ctx.route == "native" and native is not None:  # render fallback (render.py)
            return await native.open_stream(ctx)
        session = self.derender.session(ctx, self._dispatch.stream)
        try:
            await session.open(await prompt_echo.for_streams(ctx, self._dispatch, self.derender.client))
        except TokenRouteMissing as exc:  # no engine serves token ids; nothing was sent yet
            await session.aclose()
            if native is None or not native.takes_over(ctx, exc):
                raise
            return await native.open_stream(ctx)
        except BaseException:
            await session.aclose()
            raise
        return session
