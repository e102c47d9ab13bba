"""Opening one attempt of a prompt: admit it, run the encode leg when the model has encode engines
(EPD, ``encode.py``), then let its placement's unit (union / handoff or trigger legs) open the engine
stream or run the request.

Admission is entered here, once per attempt, because each attempt needs its own grant: a retry
before the first chunk, or a relay after it, goes to another engine with the tokens that engine's
budget must hold. The dispatcher asks for the first attempt, ``EngineStream`` for a relay's; neither
calls back into the other.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from coordinator.config import TopologySettings
from coordinator.contracts.generate import GenerateRequest, GenerateResponse, StreamChunk
from coordinator.observability import tracing
from coordinator.pipeline.admission.controller import Grant
from coordinator.pipeline.context import PromptPlan, RequestContext
from coordinator.pipeline.engines.capabilities import needs_of
from coordinator.pipeline.engines.client import EngineClient
from coordinator.pipeline.scheduling.request import SchedRequest
from coordinator.pipeline.topology.attempts import Attempts
from coordinator.pipeline.topology.encode import EncodeLeg
from coordinator.pipeline.topology.handoff import HandoffLegs
from coordinator.pipeline.topology.legs import Legs, attempt_id
from coordinator.pipeline.topology.trigger import PrefillLegFailed, TriggerBoard, TriggerLegs


class AttemptOpener:
    """The topology's side of an attempt (``attempts.Opener``): what it asks of scheduling and
    admission, and which legs run it."""

    def __init__(self, client: EngineClient, attempts: Attempts, topology: TopologySettings,
                 board: TriggerBoard | None = None, encoder: EncodeLeg | None = None) -> None:
        self._client = client
        self._attempts = attempts
        self._encoder = encoder
        self._handoff: Legs = HandoffLegs(client, attempts, topology)
        self._trigger: Legs = TriggerLegs(client, attempts, topology, board)

    def sched_request(self, ctx: RequestContext, plan: PromptPlan, generate: GenerateRequest) -> SchedRequest:
        """What admission and the scheduler see of one attempt of ``generate`` (the plan's own
        request, or a relay's replay of it). With token obfuscation the prefix index sees the ids
        the engines see (physical ones)."""
        salt = generate.get("cache_salt")
        ids = generate.get("token_ids")
        ids = ids if isinstance(ids, list) else plan.prompt_token_ids
        obfuscator = self._client.obfuscator
        if obfuscator is not None:
            ids = obfuscator.to_physical(ids)
        # Render's hashes are of the plan's own (logical) ids: not for a relay's replay, nor for the
        # physical ids obfuscation sends.
        hashes = plan.block_hashes if obfuscator is None and ids is plan.prompt_token_ids else None
        sp = generate["sampling_params"]
        return SchedRequest(request_id=generate["request_id"], model=ctx.model, prompt_token_ids=ids,
                            max_tokens=int(sp["max_tokens"]), n=plan.n, priority=ctx.priority,
                            tenant=ctx.tenant, cache_salt=salt if isinstance(salt, str) else None,
                            block_hashes=hashes, needs=needs_of(sp),
                            scores_prompt=sp.get("prompt_logprobs") is not None, lora=ctx.adapter,
                            media=plan.media)

    async def open_attempt(self, ctx: RequestContext, generate: GenerateRequest, req: SchedRequest
                           ) -> tuple[Grant, contextlib.AsyncExitStack, AsyncIterator[StreamChunk],
                                      tracing.Leg | None]:
        """Admit, then let the placement's unit open the stream; on failure nothing stays held."""
        grant = await self._admit(req)
        stack = contextlib.AsyncExitStack()
        try:
            rid = attempt_id(generate["request_id"])
            generate = await self._encode(generate, req)
            chunks, leg = await self._legs(grant).stream(stack, grant, generate, req, rid, ctx.include_usage)
            return grant, stack, chunks, leg
        except BaseException as exc:
            cause = _cause(exc)
            await stack.aclose()
            await self._attempts.count_death(grant, cause, req)
            self._attempts.release(grant)
            if cause is not exc:
                raise cause from None
            raise

    async def generate_once(self, generate: GenerateRequest, req: SchedRequest) -> GenerateResponse:
        """One non-streaming attempt: admit, let the placement's unit run it, release."""
        grant = await self._admit(req)
        stack = contextlib.AsyncExitStack()
        try:
            rid = attempt_id(generate["request_id"])
            generate = await self._encode(generate, req)
            return await self._legs(grant).generate(stack, grant, generate, req, rid)
        except BaseException as exc:
            cause = _cause(exc)
            await self._attempts.count_death(grant, cause, req)
            if cause is not exc:
                raise cause from None
            raise
        finally:
            await stack.aclose()
            self._attempts.release(grant)

    async def _encode(self, generate: GenerateRequest, req: SchedRequest) -> GenerateRequest:
        """EPD: the prompt's images go to an encode engine first (never fails the attempt)."""
        return generate if self._encoder is None else await self._encoder.prime(generate, req)

    def _legs(self, grant: Grant) -> Legs:
        return self._trigger if grant.placement.trigger else self._handoff

    async def _admit(self, req: SchedRequest) -> Grant:
        return await self._attempts.admit(req, prefill_tokens=lambda p: req.prompt_tokens + 1)


def _cause(exc: BaseException) -> BaseException:
    """A failed trigger prefill leg fails the attempt with the prefill engine's own error."""
    return exc.cause if isinstance(exc, PrefillLegFailed) else exc
