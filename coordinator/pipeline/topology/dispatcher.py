"""Engine dispatch for one prompt: admit → place → run the placement's topology unit, with retries.

The scheduler's placement says which unit runs an attempt (legs.py): union or handoff
(``handoff.py``), or trigger (``trigger.py``). A retry happens before the first chunk, always on an
engine this request has not failed on, and always re-runs the whole topology: a decode leg is never
retried with the previous prefill's (now stale) ``kv_transfer_params``. After chunks flowed,
``EngineStream`` relays a failed stream (see there).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, cast

from coordinator.config import TopologySettings
from coordinator.contracts.generate import GenerateRequest, GenerateResponse, StreamChunk
from coordinator.observability import tracing
from coordinator.pipeline.admission.controller import Grant
from coordinator.pipeline.context import PromptPlan, RequestContext
from coordinator.pipeline.engines.capabilities import TOKENIZER, Capability, has_grammar, needs_of
from coordinator.pipeline.engines.client import EngineClient
from coordinator.pipeline.errors import BadRequest
from coordinator.pipeline.scheduling.request import SchedRequest
from coordinator.pipeline.structured import constraint_field
from coordinator.pipeline.topology.attempts import Attempts
from coordinator.pipeline.topology.engine_stream import EngineStream
from coordinator.pipeline.topology.handoff import HandoffLegs
from coordinator.pipeline.topology.legs import Legs, attempt_id
from coordinator.pipeline.topology.trigger import PrefillLegFailed, TriggerBoard, TriggerLegs


class Dispatcher:
    """The token-only topologies (union, handoff, trigger) over the shared attempt rules (``Attempts``)."""

    def __init__(self, client: EngineClient, attempts: Attempts, topology: TopologySettings,
                 board: TriggerBoard | None = None) -> None:
        self._client = client
        self._attempts = attempts
        self._handoff: Legs = HandoffLegs(client, attempts, topology)
        self._trigger: Legs = TriggerLegs(client, attempts, topology, board)

    # -- public: what the pipeline calls ----------------------------------------------------------
    async def generate(self, ctx: RequestContext, plan: PromptPlan) -> GenerateResponse:
        """Non-streaming: nothing reaches the client before the whole answer, so any engine failure
        may be retried elsewhere."""
        req = self.sched_request(ctx, plan, plan.generate)
        async for attempt in self._attempts.retrying(req):
            with attempt:
                return await self._generate_once(plan.generate, req)
        raise AssertionError("unreachable: tenacity re-raises the last failure")

    async def score_prompt(self, ctx: RequestContext, plan: PromptPlan,
                           alternatives: int) -> list[Any] | None:
        """The engine's prompt logprobs for a prompt whose answer streams (vLLM's generate stream
        carries none): one non-streaming step of the same prompt that asks for them and nothing
        else, placed like any request (by prefix affinity, so the stream that follows reads the
        prompt's KV from the same engine's prefix cache)."""
        sp = plan.generate["sampling_params"]
        scoring = sp.copy()
        for dropped in ("structured_outputs", "logprobs", "skip_reading_prefix_cache"):
            cast(dict[str, Any], scoring).pop(dropped, None)
        scoring.update({"n": 1, "max_tokens": 1, "min_tokens": 0, "prompt_logprobs": alternatives})
        generate: GenerateRequest = {**plan.generate, "request_id": f"{plan.generate['request_id']}-prompt",
                                     "sampling_params": scoring, "stream": False, "stream_options": None}
        score = PromptPlan(index=plan.index, generate=generate, prompt_token_ids=plan.prompt_token_ids, n=1,
                           stop=plan.stop, block_hashes=plan.block_hashes)
        out = await self.generate(ctx, score)
        plp = out.get("prompt_logprobs")
        return plp if isinstance(plp, list) else None

    @contextlib.asynccontextmanager
    async def stream(self, ctx: RequestContext,
                     plan: PromptPlan) -> AsyncIterator[AsyncIterator[StreamChunk]]:
        """Streaming: retries cover admission and opening the engine stream (every leg up to the
        decode engine's HTTP 200, or its first chunk for trigger); once chunks flow, an engine
        failure is relayed to another engine (``EngineStream``) or ends the response."""
        leg = EngineStream(self._attempts, self, ctx, plan)
        try:
            await leg.open()
            yield leg.chunks()
        finally:
            await leg.aclose()

    # -- the Opener side (topology/attempts.py): what an EngineStream asks of the topology ---------
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
                            scores_prompt=sp.get("prompt_logprobs") is not None)

    def check_capable(self, ctx: RequestContext) -> None:
        """Before admission: a request only an engine with a tokenizer can run (a grammar, bad_words,
        a thinking budget)
        is a client error when no engine of its model loads one: never a silent drop of the
        constraint, never a 5xx. (With token obfuscation on, the obfuscating engine client refuses
        both, ``obfuscation.sampling_to_physical``.)"""
        params = [p.generate.get("sampling_params") for p in ctx.prompts]
        needs: frozenset[Capability] = frozenset().union(*(needs_of(sp) for sp in params))
        if TOKENIZER not in needs or self._attempts.capable(ctx.model, needs):
            return
        grammar = any(has_grammar(sp) for sp in params)
        field = ((constraint_field(ctx.body) or "structured_outputs") if grammar
                 else "bad_words" if ctx.body.get("bad_words") else "thinking_token_budget")
        what = "structured outputs" if grammar else "the engine's tokenizer"
        raise BadRequest(f"'{field}' needs {what}, which no engine serving model {ctx.model!r} can "
                         "provide: its engines load no tokenizer (--tokens-only)", param=field)

    async def open_attempt(self, ctx: RequestContext, generate: GenerateRequest, req: SchedRequest
                           ) -> tuple[Grant, contextlib.AsyncExitStack, AsyncIterator[StreamChunk],
                                      tracing.Leg | None]:
        """Admit, then let the placement's unit open the stream; on failure nothing stays held."""
        grant = await self._admit(req)
        stack = contextlib.AsyncExitStack()
        try:
            rid = attempt_id(generate["request_id"])
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

    # -- one non-streaming attempt ------------------------------------------------------------------
    async def _generate_once(self, generate: GenerateRequest, req: SchedRequest) -> GenerateResponse:
        grant = await self._admit(req)
        stack = contextlib.AsyncExitStack()
        try:
            rid = attempt_id(generate["request_id"])
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

    def _legs(self, grant: Grant) -> Legs:
        return self._trigger if grant.placement.trigger else self._handoff

    async def _admit(self, req: SchedRequest) -> Grant:
        return await self._attempts.admit(req, prefill_tokens=lambda p: req.prompt_tokens + 1)


def _cause(exc: BaseException) -> BaseException:
    """A failed trigger prefill leg fails the attempt with the prefill engine's own error."""
    return exc.cause if isinstance(exc, PrefillLegFailed) else exc


__all__ = ["Dispatcher"]
