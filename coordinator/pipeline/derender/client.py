"""Calls to vLLM's stateless derender (batch and one-call-per-chunk streaming).

Every failure here is a ``ResponseStageError`` (see ``sidecar.STAGE_ERRORS``): inference already ran,
so nothing above may retry the engine work or blame an engine for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from coordinator.observability import tracing
from coordinator.pipeline.context import PromptPlan, RequestContext
from coordinator.pipeline.derender.echo import decode_body
from coordinator.pipeline.derender.features import FeatureBook
from coordinator.pipeline.errors import DerenderRejected, DerenderUnavailable
from coordinator.pipeline.sidecar import Affinity, SidecarClient, encode

# Plain (parser-free) streaming derender only needs a prompt *suffix* to seed detokenisation
# (leading-space handling), so the per-token path does not ship the whole prompt each time.
_SEED_SUFFIX = 8
SESSION_MISS_TYPE = "stream_session_miss"  # our sidecar's 409: resend with the full prompt ids


class _StreamAnswer(msgspec.Struct):
    """A streaming derender reply. The state stays raw JSON: the coordinator never reads it, only
    sends it back, so it is neither decoded into Python objects nor encoded again (with a parser it
    holds every output token id: tens of KB late in a long answer), and its bytes come back to the
    sidecar exactly as the sidecar wrote them, which is what its session cache compares first."""

    chunk: dict[str, Any]
    stream_state: msgspec.Raw = msgspec.Raw(b"null")


_decode_answer = msgspec.json.Decoder(_StreamAnswer).decode


@dataclass(frozen=True)
class StreamMode:
    """How a prompt stream talks to derender: whether parsers build its deltas, and whether its
    engine chunks may be merged into one call without changing what the client gets."""

    parsers: bool
    coalesce: bool


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
    def __init__(self, sidecar: SidecarClient, *, parsers: bool | None = None,
                 coalesce_with_parsers: bool | None = None) -> None:
        """``parsers``: None learns from the sidecars whether they run parsers (docs/parsers.md);
        ``coalesce_with_parsers``: None merges calls only for parsers measured to be exact."""
        self._sidecar = sidecar
        self.features = FeatureBook(sidecar, override=parsers)
        self._coalesce_with_parsers = coalesce_with_parsers

    async def mode(self) -> StreamMode:
        """The stream mode for a new prompt stream (asks the sidecars first if they need it)."""
        features = await self.features.ensure()
        coalesce = features.coalesce_exact if self._coalesce_with_parsers is None else (
            self._coalesce_with_parsers or not features.parsers)
        return StreamMode(parsers=features.parsers, coalesce=coalesce)

    async def stream_chunk(self, ctx: RequestContext, plan: PromptPlan, chunk: dict[str, Any],
                           state: Any, *, route: Affinity | None = None) -> tuple[dict[str, Any], Any]:
        """Derender one engine chunk; returns the OpenAI chunk and the next ``stream_state`` (raw
        JSON, ``msgspec.Raw``; None before the first call).

        ``route`` keeps a stream's calls on one sidecar. With parsers, vLLM needs the whole prompt on
        every call; a sidecar with the parser-session cache only needs it to start or replay a stream,
        so once the stream has a sidecar the ids stay home, and a 409 ``stream_session_miss`` (the
        sidecar restarted, evicted the session, or is another one) sends the call again with them."""
        features = self.features.pool
        if features.parsers:
            lean = features.session_cache and state is not None and route is not None and (
                route.sidecar is not None)
            if lean:
                try:
                    return await self._call(ctx, plan, chunk, state, None, route)
                except DerenderRejected as exc:
                    if not _session_miss(exc):
                        raise
            seed: Any = _encoded(ctx, f"prompt:{plan.index}", plan.prompt_token_ids)  # encoded once
        else:
            seed = plan.prompt_token_ids[-_SEED_SUFFIX:] if state is None else None
        return await self._call(ctx, plan, chunk, state, seed, route)

    async def _call(self, ctx: RequestContext, plan: PromptPlan, chunk: dict[str, Any],
                    state: Any, seed: Any, route: Affinity | None) -> tuple[dict[str, Any], Any]:
        # The chunk's request_id is the engine attempt's; a relay or retry changes it. Derender only
        # copies it into the chunk's id (which the coordinator rewrites), and our sidecar keys a
        # stream's parser session on it, so a stream keeps one id across attempts.
        chunk = {**chunk, "request_id": f"{ctx.request_id}-{plan.index}"}
        body: dict[str, Any] = {"stream": True, "model": ctx.model, "generate_chunk": chunk,
                                "stream_state": state, "prompt_tokens": plan.prompt_tokens,
                                "prompt_token_ids": seed}
        # The same for every chunk. Without ``stop``: the coordinator cuts stop strings itself
        # (stop.py), and vLLM 0.33's streaming derender refuses a request that names any (400).
        options = _encoded(ctx, "options", {k: v for k, v in ctx.derender_request.items() if k != "stop"})
        if ctx.kind == "chat":
            body["chat_request"] = options
            path = "/v1/chat/completions/derender"
        else:
            body["completion_request"] = options
            path = "/v1/completions/derender"
        out: _StreamAnswer = await self._sidecar.post(path, body, request_id=ctx.request_id,
                                                      stage="derender", affinity=route, decode=_decode_answer)
        state_json = out.stream_state
        return out.chunk, None if bytes(state_json) == b"null" else state_json

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


    async def decode_prompt(self, ctx: RequestContext, plan: PromptPlan,
                            prompt_logprobs: list[Any] | None) -> tuple[str, list[dict[str, Any]]]:
        """The prompt's text and, when the engine scored the prompt, one decoded logprob entry per
        position (``echo.decode_body``). Batch chat derender decodes without a parser unless the
        sidecar runs one, which then needs a request; the parsed message is not used, only its text."""
        body: dict[str, Any] = {"model": ctx.model, "prompt_token_ids": [],
                                "generate_response": decode_body(plan.prompt_token_ids, prompt_logprobs)}
        features = await self.features.ensure()
        if features.parsers:
            body["chat_request"] = {"model": ctx.model, "messages": [{"role": "user", "content": ""}],
                                    "logprobs": prompt_logprobs is not None}
        out = await self._sidecar.post("/v1/chat/completions/derender", body, request_id=ctx.request_id,
                                       stage="derender")
        try:
            choice = out["choices"][0]
            text = (choice.get("message") or {}).get("content") or ""
            content = (choice.get("logprobs") or {}).get("content") or []
        except (KeyError, IndexError, TypeError, AttributeError):
            raise DerenderUnavailable("derender returned an unexpected body for the prompt") from None
        return str(text), list(content)


    async def prompt_text(self, ctx: RequestContext, plan: PromptPlan) -> str:
        """The templated prompt as text (chat ``return_prompt_text``): render's ``/detokenize`` of
        the prompt's ids, special tokens included, as native's renderer wrote it."""
        out = await self._sidecar.post("/detokenize", {"model": ctx.model, "tokens": plan.prompt_token_ids},
                                       request_id=ctx.request_id, stage="derender")
        if not isinstance(out, dict) or not isinstance(out.get("prompt"), str):
            raise DerenderUnavailable("render's /detokenize returned an unexpected body")
        return str(out["prompt"])


def _session_miss(exc: DerenderRejected) -> bool:
    return exc.status == 409 and exc.type == SESSION_MISS_TYPE
