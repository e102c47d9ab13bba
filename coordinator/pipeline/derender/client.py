"""Calls to vLLM's stateless derender (batch and one-call-per-chunk streaming).

Every failure here is a ``ResponseStageError`` (see ``sidecar.STAGE_ERRORS``): inference already ran,
so nothing above may retry the engine work or blame an engine for it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from coordinator.observability import tracing
from coordinator.pipeline.context import PromptPlan, RequestContext
from coordinator.pipeline.errors import DerenderUnavailable
from coordinator.pipeline.sidecar import SidecarClient, encode

# Plain (parser-free) streaming derender only needs a prompt *suffix* to seed detokenisation
# (leading-space handling), so the per-token path does not ship the whole prompt each time.
_SEED_SUFFIX = 8


def request_view(ctx: RequestContext) -> dict[str, Any]:
    """The client request as derender needs it: every option, but not the conversation or prompt.

    Derender reads options (``skip_special_tokens``, ``tools``, ``tool_choice``, ``include_reasoning``,
    ``return_token_ids``, ``chat_template_kwargs``, ...) and never the messages; sending a one-message
    stub instead keeps each per-chunk call small however long the conversation is.
    """
    if ctx.kind == "chat":
        return {**ctx.body, "messages": [{"role": "user", "content": ""}]}
    return {**ctx.body, "prompt": "-"}  # must be non-empty to validate


def _encoded(ctx: RequestContext, key: str, value: Any) -> msgspec.Raw:
    """``value`` as JSON, encoded on the request's first call and spliced into every later one."""
    raw = ctx.encoded.get(key)
    if raw is None:
        raw = ctx.encoded[key] = msgspec.Raw(encode(value))
    return raw


class Derenderer:
    def __init__(self, sidecar: SidecarClient, *, parsers: bool) -> None:
        self._sidecar = sidecar
        # With a tool or reasoning parser the sidecar needs the full prompt on every chunk.
        self._parsers = parsers

    @property
    def parsers(self) -> bool:
        """A tool or reasoning parser is configured (chunks then carry what the parser built)."""
        return self._parsers

    async def stream_chunk(self, ctx: RequestContext, plan: PromptPlan, chunk: dict[str, Any],
                           state: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Derender one engine chunk; returns the OpenAI chunk and the next ``stream_state``."""
        if self._parsers:  # the whole prompt on every call: encoded once per prompt
            seed: Any = _encoded(ctx, f"prompt:{plan.index}", plan.prompt_token_ids)
        else:
            seed = plan.prompt_token_ids[-_SEED_SUFFIX:] if state is None else None
        body: dict[str, Any] = {"stream": True, "model": ctx.model, "generate_chunk": chunk,
                                "stream_state": state, "prompt_tokens": plan.prompt_tokens,
                                "prompt_token_ids": seed}
        options = _encoded(ctx, "options", ctx.derender_request)  # the same for every chunk
        if ctx.kind == "chat":
            body["chat_request"] = options
            path = "/v1/chat/completions/derender"
        else:
            body["completion_request"] = options
            path = "/v1/completions/derender"
        out = await self._sidecar.post(path, body, request_id=ctx.request_id, stage="derender")
        if not isinstance(out, dict) or not isinstance(out.get("chunk"), dict):
            raise DerenderUnavailable("derender returned an unexpected body")
        return out["chunk"], out.get("stream_state")

    async def batch(self, ctx: RequestContext, responses: list[dict[str, Any]]) -> dict[str, Any]:
        """Derender complete generate responses (one per prompt) into one OpenAI response."""
        if ctx.kind == "chat":
            plan = ctx.prompts[0]
            body: dict[str, Any] = {"model": ctx.model, "generate_response": responses[0],
                                    "prompt_tokens": plan.prompt_tokens,
                                    "prompt_token_ids": plan.prompt_token_ids,
                                    "chat_request": ctx.derender_request}
            path = "/v1/chat/completions/derender"
        else:
            body = {"model": ctx.model, "generate_responses": responses,
                    "prompt_tokens": [p.prompt_tokens for p in ctx.prompts],
                    "prompt_token_ids": [p.prompt_token_ids for p in ctx.prompts],
                    "completion_request": ctx.derender_request}
            path = "/v1/completions/derender"
        calls: tracing.Attributes = {"coordinator.derender.calls": 1}
        with tracing.stage("derender", ctx.record, kind="client", attributes=calls):
            out = await self._sidecar.post(path, body, request_id=ctx.request_id, stage="derender")
        if not isinstance(out, dict) or not isinstance(out.get("choices"), list):
            raise DerenderUnavailable("derender returned an unexpected body")
        return out
