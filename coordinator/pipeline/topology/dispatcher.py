"""Engine dispatch for one prompt: the pipeline's way into the topologies, with retries and relay.

Each attempt is opened by ``opening.py`` (admit → place → run the placement's unit, legs.py: union
or handoff in ``handoff.py``, trigger in ``trigger.py``). A retry happens before the first chunk, always on an
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
from coordinator.pipeline.context import PromptPlan, RequestContext
from coordinator.pipeline.engines.capabilities import TOKENIZER, Capability, has_grammar, needs_of
from coordinator.pipeline.engines.client import EngineClient
from coordinator.pipeline.errors import BadRequest
from coordinator.pipeline.structured import constraint_field
from coordinator.pipeline.topology.attempts import Attempts
from coordinator.pipeline.topology.encode import EncodeLeg
from coordinator.pipeline.topology.engine_stream import EngineStream
from coordinator.pipeline.topology.opening import AttemptOpener
from coordinator.pipeline.topology.trigger import TriggerBoard


class Dispatcher:
    """The token-only topologies (union, handoff, trigger, each after an optional encode leg) over the
    shared attempt rules (``Attempts``)."""

    def __init__(self, client: EngineClient, attempts: Attempts, topology: TopologySettings,
                 board: TriggerBoard | None = None, encoder: EncodeLeg | None = None) -> None:
        self._attempts = attempts
        self._opener = AttemptOpener(client, attempts, topology, board, encoder)

    # -- public: what the pipeline calls ----------------------------------------------------------
    async def generate(self, ctx: RequestContext, plan: PromptPlan) -> GenerateResponse:
        """Non-streaming: nothing reaches the client before the whole answer, so any engine failure
        may be retried elsewhere."""
        req = self._opener.sched_request(ctx, plan, plan.generate)
        async for attempt in self._attempts.retrying(req):
            with attempt:
                return await self._opener.generate_once(plan.generate, req)
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
                           stop=plan.stop, block_hashes=plan.block_hashes, media=plan.media)
        out = await self.generate(ctx, score)
        plp = out.get("prompt_logprobs")
        return plp if isinstance(plp, list) else None

    @contextlib.asynccontextmanager
    async def stream(self, ctx: RequestContext,
                     plan: PromptPlan) -> AsyncIterator[AsyncIterator[StreamChunk]]:
        """Streaming: retries cover admission and opening the engine stream (every leg up to the
        decode engine's HTTP 200, or its first chunk for trigger); once chunks flow, an engine
        failure is relayed to another engine (``EngineStream``) or ends the response."""
        leg = EngineStream(self._attempts, self._opener, ctx, plan)
        try:
            await leg.open()
            yield leg.chunks()
        finally:
            await leg.aclose()

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


__all__ = ["Dispatcher"]
