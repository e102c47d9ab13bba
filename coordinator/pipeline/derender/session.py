"""One request's engine streams, merged into the client's chunk sequence.

Every prompt of the request has its own engine stream (opened by the topology, handed in as
``open_engine``) and its own ``PromptStream`` that derenders it; one producer task per prompt puts
client chunks on a bounded queue, and the door's writer takes them in arrival order. A producer's
failure cancels its siblings; closing the session cancels the producers and closes every engine
stream, which aborts the engine requests. docs/architecture.md, "Streaming, in detail".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from coordinator.contracts.generate import StreamChunk
from coordinator.observability.events import event
from coordinator.pipeline.context import PromptPlan, RequestContext
from coordinator.pipeline.derender.client import Derenderer
from coordinator.pipeline.derender.echo import PromptEcho
from coordinator.pipeline.derender.shape import shape_usage_chunk
from coordinator.pipeline.derender.stream import Coalescing, PromptStream

log = logging.getLogger(__name__)
Chunks = AsyncIterator[StreamChunk]
OpenEngine = Callable[[RequestContext, PromptPlan], AbstractAsyncContextManager[Chunks]]


@dataclass
class _Finished:
    """Sentinel a producer puts on the queue when its prompt stream ends (with its error, if any)."""

    error: BaseException | None = None
    prompt: int = 0



class StreamSession:
    """All engine streams of one request, merged into one chunk sequence through a bounded queue."""

    def __init__(self, ctx: RequestContext, open_engine: OpenEngine, derenderer: Derenderer,
                 queue_chunks: int, coalescing: Coalescing | None = None) -> None:
        """``open_engine(ctx, plan)``: the topology's engine stream of one prompt, opened on entry
        (its first chunk in) and closed, which aborts it, on exit."""
        self.ctx = ctx
        self._open_engine = open_engine
        self._derender = derenderer
        self._queue: asyncio.Queue[dict[str, Any] | _Finished] = asyncio.Queue(maxsize=queue_chunks)
        self._coalescing = coalescing
        self._stack = contextlib.AsyncExitStack()
        self._streams: list[tuple[PromptStream, Chunks]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._end_reason: str | None = None  # None while the client still reads

    async def open(self, echoes: Sequence[PromptEcho | None] | None = None) -> None:
        """Open every prompt's engine stream (all before the first byte goes out); ``echoes``: the
        prompt each choice starts with, per prompt (``echo``)."""
        opened = await asyncio.gather(
            *(self._stack.enter_async_context(self._open_engine(self.ctx, p)) for p in self.ctx.prompts),
            return_exceptions=True)
        errors = [o for o in opened if isinstance(o, BaseException)]
        if errors:
            raise errors[0]
        self._streams = [(PromptStream(self.ctx, p, self._derender, coalescing=self._coalescing, echo=echo),
                          chunks)  # type: ignore[misc]
                         for p, chunks, echo in zip(self.ctx.prompts, opened,
                                                    echoes or [None] * len(self.ctx.prompts), strict=True)]

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Client chunks in arrival order, then the usage chunk if asked for. Raises on failure."""
        for ps, chunks in self._streams:
            self._tasks.append(asyncio.create_task(self._produce(ps, chunks)))
        pending = len(self._tasks)
        while pending:
            item = await self._queue.get()
            if isinstance(item, _Finished):
                pending -= 1
                if item.error is not None:
                    self._end_reason = f"prompt {item.prompt} failed: {type(item.error).__name__}"
                    self.ctx.record.fail(item.error, getattr(item.error, "status", 500))
                    if len(self._tasks) > 1:
                        event(log, "cancelled", self.ctx.request_id, level=logging.WARNING,
                              failed_prompt=item.prompt, error=type(item.error).__name__,
                              cancelled_siblings=self.running_tasks - 1, reason="sibling_failed")
                    raise item.error
                continue
            yield item
        self._end_reason = "done"
        if self.ctx.include_usage:
            yield self.usage_chunk()

    async def _emit(self, chunk: dict[str, Any]) -> None:
        await self._queue.put(chunk)
        self.ctx.visible = True  # from now on no engine failure may restart the request as a whole

    async def _produce(self, ps: PromptStream, chunks: Chunks) -> None:
        try:
            await ps.run(chunks, self._emit)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, which cancels the siblings
            await self._queue.put(_Finished(exc, ps.plan.index))
            return
        await self._queue.put(_Finished())

    @property
    def buffered_tokens(self) -> int:
        return sum(ps.buffered_tokens for ps, _ in self._streams)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def running_tasks(self) -> int:
        return sum(1 for t in self._tasks if not t.done())

    def usage_chunk(self) -> dict[str, Any]:
        prompt = sum(p.prompt_tokens for p in self.ctx.prompts)
        completion = sum(ps.completion_tokens for ps, _ in self._streams)
        return shape_usage_chunk(self.ctx, {
            "id": self.ctx.response_id, "object": self.ctx.object_name, "created": self.ctx.created,
            "model": self.ctx.public_model, "choices": [],
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                      "completion_tokens": completion}})

    async def aclose(self) -> None:
        """Cancel and await every producer, then close the engine streams (which aborts them)."""
        if self._closed:
            return
        self._closed = True
        if self._end_reason is None and self.running_tasks:
            event(log, "cancelled", self.ctx.request_id, reason="client_gone", cancelled=self.running_tasks)
            self.ctx.record.cancel("client_gone")  # unless the door already said why (NNRP cancel)
        self.ctx.record.usage(None, sum(ps.completion_tokens for ps, _ in self._streams))
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._stack.aclose()
