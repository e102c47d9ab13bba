"""What a topology unit is (``Legs``), and the engine request bodies of union and handoff legs.

A topology unit runs the engine legs of one attempt on a placement the scheduler made: union and
handoff (``handoff.py``), trigger (``trigger.py``). The scheduler's placement is the one rule that
says which unit a request takes; ``Dispatcher`` admits, asks the unit, and cleans up. Union sends
the rendered GenerateRequest as is. Handoff (P/D) sends a prefill leg that computes the prompt's KV
and stops after one token, then a decode leg that carries the ``kv_transfer_params`` the prefill
engine returned (vLLM's P/D contract through ``/inference/v1/generate``).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from coordinator.contracts.generate import GenerateRequest, GenerateResponse, StreamChunk

if TYPE_CHECKING:
    from coordinator.observability.tracing import Leg
    from coordinator.pipeline.admission.controller import Grant
    from coordinator.pipeline.scheduling.request import SchedRequest


class Legs(Protocol):
    """One topology's legs of an attempt. What they open they register on ``stack`` (closing it
    aborts what is unfinished); the caller admitted the grant and releases it."""

    async def stream(self, stack: contextlib.AsyncExitStack, grant: Grant, generate: GenerateRequest,
                     req: SchedRequest, rid: str, include_usage: bool
                     ) -> tuple[AsyncIterator[StreamChunk], Leg | None]:
        """Open the stream the client's chunks come from (an attempt is open once this returns)."""

    async def generate(self, stack: contextlib.AsyncExitStack, grant: Grant, generate: GenerateRequest,
                       req: SchedRequest, rid: str) -> GenerateResponse:
        """The whole non-streaming answer."""


def phase(grant: Grant) -> str:
    """The answering engine's role in this attempt, for events and spans."""
    return "union" if grant.placement.prefill is None else "decode"


def attempt_id(request_id: str, leg: str = "") -> str:
    """Unique per attempt and leg even when clients reuse an X-Request-Id: vLLM aborts *every* request
    sharing an external id, so two attempts must never share one."""
    return f"{request_id}-{leg}{secrets.token_hex(3)}"


def prefill_body(generate: GenerateRequest, kv_transfer_params: dict[str, Any]) -> GenerateRequest:
    """One token, no streaming (only non-streaming responses carry ``kv_transfer_params``), one choice,
    nothing that makes the engine generate or report more than it must."""
    sp = generate["sampling_params"].copy()
    sp["max_tokens"] = 1
    sp["n"] = 1
    sp.pop("min_tokens", None)
    sp.pop("logprobs", None)
    sp.pop("prompt_logprobs", None)
    return {**generate, "sampling_params": sp, "stream": False, "stream_options": None,
            "kv_transfer_params": dict(kv_transfer_params)}


def decode_body(generate: GenerateRequest, kv_transfer_params: dict[str, Any] | None) -> GenerateRequest:
    """The real request plus the prefill's params, verbatim. A connector that returns none (e.g. a
    shared-storage connector) needs none: the decode engine finds the KV by prompt hash."""
    if kv_transfer_params is None:
        return generate
    return {**generate, "kv_transfer_params": kv_transfer_params}


async def first_chunk(chunks: AsyncIterator[StreamChunk]) -> AsyncIterator[StreamChunk]:
    """Wait for a stream's first chunk, then the whole stream again, first chunk included.

    Why before the stream counts as open: vLLM refuses a request's sampling parameters (a grammar on
    an engine without a tokenizer) as the first SSE event of a 200 (``engines/client.py``), and the
    client must get that 4xx before any byte. The client's first byte waits for this chunk anyway."""
    first: StreamChunk | None = None
    with contextlib.suppress(StopAsyncIteration):
        first = await anext(chunks)
    return prepend(first, chunks)


async def prepend(first: StreamChunk | None, rest: AsyncIterator[StreamChunk]
                  ) -> AsyncIterator[StreamChunk]:
    if first is not None:
        yield first
    async for chunk in rest:
        yield chunk
