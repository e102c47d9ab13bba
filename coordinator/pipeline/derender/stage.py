"""The derender stage's one face: token ids in, the client's answer out, batch or stream.

The pipeline hands it whole engine outputs (``answer``), or a prompt's engine stream to run to its
end internally (``collect``, for stop strings in a non-streaming request), or the topology's stream
opener for a streaming request (``session``). It keeps the open sessions, which the gauges read.
"""

from __future__ import annotations

import weakref
from contextlib import AbstractAsyncContextManager
from typing import Any, cast

from coordinator.contracts.generate import GenerateResponse
from coordinator.pipeline.context import PromptPlan, RequestContext
from coordinator.pipeline.derender import batch
from coordinator.pipeline.derender.client import Derenderer
from coordinator.pipeline.derender.session import Chunks, OpenEngine, StreamSession
from coordinator.pipeline.derender.stream import Coalescing, PromptStream


class Derender:
    def __init__(self, client: Derenderer, queue_chunks: int, coalescing: Coalescing | None = None) -> None:
        self.client = client  # the sidecar calls themselves (prompt echo derenders with it too)
        self._queue_chunks = queue_chunks
        self._coalescing = coalescing or Coalescing()
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

    async def answer(self, ctx: RequestContext, responses: list[GenerateResponse]) -> dict[str, Any]:
        """The JSON answer from every prompt's whole engine response: one derender call, with what
        native does around its detokenizer applied before and after (``batch.py``, which rewrites
        the engine's answers as plain dicts: the typed view ends here)."""
        plain = cast(list[dict[str, Any]], responses)
        trimmed, blank = batch.trim(ctx, plain)
        out = await self.client.batch(ctx, trimmed)
        batch.finish(ctx, out, plain, trimmed, blank)
        return out

    async def collect(self, ctx: RequestContext, plan: PromptPlan,
                      stream: AbstractAsyncContextManager[Chunks]) -> GenerateResponse:
        """Run one prompt's engine stream internally until done or stopped (stop strings need
        incremental text); the engine response it would have been."""
        ps = PromptStream(ctx, plan, self.client, collect=True, coalescing=self._coalescing)

        async def discard(_: dict[str, Any]) -> None:
            return None

        async with stream as chunks:
            await ps.run(chunks, discard)
        return cast(GenerateResponse, batch.collected(ctx, plan, ps))

    def session(self, ctx: RequestContext, open_engine: OpenEngine) -> StreamSession:
        """A stream session over ``open_engine``'s streams, not opened yet (``StreamSession.open``)."""
        session = StreamSession(ctx, open_engine, self.client, self._queue_chunks, self._coalescing)
        self._sessions.add(session)
        return session
