"""Engine dispatch for one prompt: pick, account load, build the engine request id.

The union topology (one engine does prefill and decode). Other topologies (P/D handoff) implement
the same two calls.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

from coordinator.pipeline.context import PromptPlan, RequestContext
from coordinator.pipeline.engines.client import EngineClient
from coordinator.pipeline.engines.registry import Engine, EngineRegistry
from coordinator.pipeline.errors import UpstreamUnavailable
from coordinator.pipeline.scheduling.picker import LeastLoadPicker


class UnionDispatcher:
    def __init__(self, client: EngineClient, registry: EngineRegistry, picker: LeastLoadPicker) -> None:
        self._client = client
        self._registry = registry
        self._picker = picker

    @staticmethod
    def attempt_id(plan: PromptPlan) -> str:
        """Unique per attempt even when clients reuse an X-Request-Id: vLLM aborts *every* request sharing
        an external id, so two clients must never share one."""
        return f"{plan.generate['request_id']}-{secrets.token_hex(3)}"

    @contextlib.contextmanager
    def _occupy(self, engine: Engine, plan: PromptPlan) -> Iterator[None]:
        tokens = plan.prompt_tokens + plan.max_tokens * plan.n
        engine.inflight_requests += 1
        engine.inflight_tokens += tokens
        try:
            yield
        finally:
            engine.inflight_requests -= 1
            engine.inflight_tokens -= tokens

    async def generate(self, ctx: RequestContext, plan: PromptPlan) -> dict[str, Any]:
        engine = self._picker.pick(ctx.model, plan)
        with self._occupy(engine, plan):
            try:
                return await self._client.generate(engine, plan.generate, self.attempt_id(plan))
            except UpstreamUnavailable as exc:
                if type(exc) is UpstreamUnavailable:
                    self._registry.mark_failed(engine)
                raise

    @contextlib.asynccontextmanager
    async def stream(self, ctx: RequestContext,
                     plan: PromptPlan) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        engine = self._picker.pick(ctx.model, plan)
        with self._occupy(engine, plan):
            try:
                async with self._client.stream(engine, plan.generate, self.attempt_id(plan),
                                               include_usage=ctx.include_usage) as chunks:
                    yield chunks
            except UpstreamUnavailable as exc:
                if type(exc) is UpstreamUnavailable:  # unreachable or died; not an error it reported
                    self._registry.mark_failed(engine)
                raise
