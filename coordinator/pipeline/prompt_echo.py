"""``echo`` and prompt logprobs around the engine calls (what they look like: ``derender/echo.py``).

Render asks the engine to score the prompt (``sampling_params.prompt_logprobs``) when the client
wants prompt logprobs, or echo with logprobs. A non-streaming engine answer carries them; vLLM's
generate *stream* does not (``GenerateStreamResponseBase`` has no such field), so:

* a streamed completion that echoes logprobs first asks the engine for them in a one-step call
  (``Dispatcher.score_prompt``), then streams without them (the stream then reads the prompt's KV
  from the prefix cache instead of recomputing it, which scoring forbids);
* any other stream drops them from its request: native streams never show them;
* a non-streaming prompt that streamed internally (stop strings) is scored the same way.

Then derender decodes what the engine sent as ids, and the answer gets the prompt written in.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from coordinator.contracts.generate import GenerateResponse
from coordinator.pipeline.context import PromptPlan, RequestContext
from coordinator.pipeline.derender import Derenderer
from coordinator.pipeline.derender.echo import (
    PromptEcho,
    apply_batch,
    build,
    chat_echo_text,
    echoes_logprobs,
    engine_prompt_logprobs,
    needs_decoding,
)
from coordinator.pipeline.topology.dispatcher import Dispatcher


def wanted(ctx: RequestContext) -> bool:
    """Whether anything of the prompt goes into the answer."""
    return (bool(ctx.body.get("echo")) or bool(ctx.body.get("return_prompt_text"))
            or any(engine_prompt_logprobs(p) is not None for p in ctx.prompts))


async def _prompt_text(ctx: RequestContext, plan: PromptPlan, derender: Derenderer) -> str | None:
    if ctx.kind != "chat" or not ctx.body.get("return_prompt_text"):
        return None
    return await derender.prompt_text(ctx, plan)


async def complete(ctx: RequestContext, out: dict[str, Any], responses: list[GenerateResponse],
                   dispatch: Dispatcher, derender: Derenderer) -> None:
    """Write the prompt into a non-streaming answer (``responses``: the engines', one per prompt)."""
    if not wanted(ctx):
        return

    async def one(plan: PromptPlan, resp: GenerateResponse) -> PromptEcho:
        k = engine_prompt_logprobs(plan)
        plp = resp.get("prompt_logprobs") if k is not None else None
        if k is not None and not isinstance(plp, list):  # the prompt streamed internally
            plp = await dispatch.score_prompt(ctx, plan, k)
        decoded = await derender.decode_prompt(ctx, plan, plp) if needs_decoding(ctx, plan, plp) else None
        return replace(build(ctx, plan, plp, decoded), prompt_text=await _prompt_text(ctx, plan, derender))

    echoes = await asyncio.gather(*(one(p, r) for p, r in zip(ctx.prompts, responses, strict=True)))
    apply_batch(ctx, out, list(echoes))


async def for_streams(ctx: RequestContext, dispatch: Dispatcher,
                      derender: Derenderer) -> list[PromptEcho | None]:
    """Each prompt's echo, ready before its stream opens (None: nothing to echo)."""
    if not wanted(ctx):
        return [None] * len(ctx.prompts)

    async def one(plan: PromptPlan) -> PromptEcho | None:
        sp = plan.generate["sampling_params"]
        k = engine_prompt_logprobs(plan)
        sp.pop("prompt_logprobs", None)
        sp.pop("skip_reading_prefix_cache", None)  # render sets it from prompt_logprobs
        if ctx.kind == "chat":
            text, prompt = chat_echo_text(ctx), await _prompt_text(ctx, plan, derender)
            return PromptEcho(text=text, prompt_text=prompt) if text or prompt is not None else None
        if not ctx.body.get("echo"):
            return None
        plp = await dispatch.score_prompt(ctx, plan, k) if k is not None and echoes_logprobs(ctx) else None
        decoded = await derender.decode_prompt(ctx, plan, plp) if needs_decoding(ctx, plan, plp) else None
        echo = build(ctx, plan, plp, decoded)
        return PromptEcho(text=echo.text, logprobs=echo.logprobs, only=echo.only)  # streams carry no field

    return list(await asyncio.gather(*(one(p) for p in ctx.prompts)))
