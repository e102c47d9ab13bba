"""Union and Handoff legs: the placement's prefill leg first when it has one, then the engine that answers.

Union: one engine prefills and decodes; the rendered GenerateRequest goes as is. Handoff (P/D): a
prefill engine computes the prompt's KV (one token, non-streaming), then the decode engine continues
from the ``kv_transfer_params`` it returned (vLLM's P/D contract through ``/inference/v1/generate``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from coordinator.config import TopologySettings
from coordinator.contracts.generate import GenerateRequest, GenerateResponse, StreamChunk
from coordinator.observability import tracing
from coordinator.pipeline.admission.controller import Grant
from coordinator.pipeline.engines.client import EngineClient, engine_request_id
from coordinator.pipeline.scheduling.request import SchedRequest
from coordinator.pipeline.topology.attempts import Attempts
from coordinator.pipeline.topology.legs import attempt_id, decode_body, first_chunk, phase, prefill_body


class HandoffLegs:
    """The legs of a union or handoff placement (a ``Legs`` unit, see legs.py)."""

    def __init__(self, client: EngineClient, attempts: Attempts, topology: TopologySettings) -> None:
        self._client = client
        self._attempts = attempts
        self._topology = topology

    async def stream(self, stack: contextlib.AsyncExitStack, grant: Grant, generate: GenerateRequest,
                     req: SchedRequest, rid: str, include_usage: bool
                     ) -> tuple[AsyncIterator[StreamChunk], tracing.Leg | None]:
        """Run the prefill leg if any, open the decode (or union) stream up to its first chunk."""
        params = await self._prefill_leg(grant, generate, req)
        engine = grant.placement.engine
        leg = tracing.stream_leg(phase(grant), engine.url, engine_request_id(rid), ends_with=stack)
        with self._attempts.outcome(engine, req, phase(grant), ok="streaming"), tracing.opening(leg):
            chunks = await stack.enter_async_context(self._client.stream(
                engine, decode_body(generate, params), rid, include_usage=include_usage))
            chunks = await first_chunk(chunks)
        return chunks, leg

    async def generate(self, stack: contextlib.AsyncExitStack, grant: Grant, generate: GenerateRequest,
                       req: SchedRequest, rid: str) -> GenerateResponse:
        params = await self._prefill_leg(grant, generate, req)
        engine = grant.placement.engine
        with self._attempts.outcome(engine, req, phase(grant)), \
                tracing.engine_leg(phase(grant), engine.url, engine_request_id(rid)):
            return await self._client.generate(engine, decode_body(generate, params), rid)

    async def _prefill_leg(self, grant: Grant, generate: GenerateRequest,
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
            with self._attempts.outcome(pre, req, "prefill"), \
                    tracing.engine_leg("prefill", pre.url, engine_request_id(rid)):
                resp = await self._client.generate(
                    pre, prefill_body(generate, self._topology.prefill_kv_transfer_params), rid)
        finally:
            grant.release_engine(pre)
        params = resp.get("kv_transfer_params")
        return params if isinstance(params, dict) else None


__all__ = ["HandoffLegs"]
