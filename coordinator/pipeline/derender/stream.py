"""Streaming derender of one engine stream: per-choice ``stream_state``, stop strings, commit rule.

The sidecar is stateless; this object owns the state. For each engine chunk the committed state of
that choice goes to derender, and the returned state is committed only after the derendered chunk
has been handed to the client writer (``emit`` returned). A failed derender or a cancelled hand-off
leaves the committed state where it was.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from coordinator.pipeline.context import PromptPlan, RequestContext
from coordinator.pipeline.derender.client import Derenderer
from coordinator.pipeline.derender.fixups import (
    compact_tool_call_deltas,
    eos_stop_reason,
    stops_on_token,
    without_stop_token,
)
from coordinator.pipeline.derender.shape import role_chunk, shape_stream_chunk
from coordinator.pipeline.derender.stop import StopMatcher

Emit = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class ChoiceState:
    matcher: StopMatcher
    stream_state: dict[str, Any] | None = None
    tokens: int = 0                       # output tokens that count for usage
    done: bool = False
    stopped_early: bool = False           # ended by a stop string while the engine was still generating
    finish_reason: str | None = None
    stop_reason: Any = None
    # Only kept when the caller needs the tokens afterwards (non-streaming requests with stop strings).
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)


class PromptStream:
    """Turns one prompt's engine chunks into client chunks with the global choice index."""

    def __init__(self, ctx: RequestContext, plan: PromptPlan, derenderer: Derenderer, *,
                 collect: bool = False) -> None:
        self.ctx = ctx
        self.plan = plan
        self._derenderer = derenderer
        self._collect = collect
        # Chunk keys depend on whether a parser built the delta; a stand-in derenderer has none.
        self._parsers = bool(getattr(derenderer, "parsers", False))
        self.choices = {i: ChoiceState(StopMatcher(plan.stop)) for i in range(plan.n)}

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices.values())

    @property
    def finished(self) -> bool:
        return all(c.done for c in self.choices.values())

    async def run(self, chunks: AsyncIterator[dict[str, Any]], emit: Emit) -> None:
        """Consume engine chunks until every choice is finished (normally or by a stop string)."""
        role_pending = self.ctx.kind == "chat" and not self._collect
        async for chunk in chunks:
            choices = chunk.get("choices") or []
            if not choices:
                continue  # engine usage chunk: usage is recomputed by the session from our own counts
            if role_pending:  # native opens every chat choice with a role chunk once output starts
                role_pending = False
                for i in range(self.plan.n):
                    await emit(role_chunk(self.ctx, self.plan, self.plan.index * self.plan.n + i))
            await self._one(chunk, choices[0], emit)
            if self.finished and any(c.stopped_early for c in self.choices.values()):
                return  # leaving closes the engine stream, which aborts what it still generates
        # Otherwise the engine's own [DONE] ended the loop: nothing to abort.

    async def _one(self, chunk: dict[str, Any], choice: dict[str, Any], emit: Emit) -> None:
        st = self.choices.get(int(choice.get("index", 0)))
        if st is None or st.done:
            return  # a choice already ended by a stop string keeps generating until its siblings end
        new_ids: list[int] = choice.get("token_ids") or []
        if stops_on_token(choice, self.plan.stop):
            chunk = {**chunk, "choices": [without_stop_token(choice)]}
        out, next_state = await self._derenderer.stream_chunk(self.ctx, self.plan, chunk, st.stream_state)
        engine_finish = choice.get("finish_reason")
        out_choice = out["choices"][0] if out.get("choices") else None
        stop_hit: str | None = None
        if out_choice is not None and self.plan.stop.active:
            text = _text_of(self.ctx, out_choice)
            res = st.matcher.feed(text or "", len(new_ids))
            released = res.text
            stop_hit = res.stop
            if stop_hit is None and engine_finish is not None:
                released += st.matcher.flush()
            _set_text(self.ctx, out_choice, released, keep_none=text is None)
            if stop_hit is not None:
                out_choice["finish_reason"] = "stop"
                out_choice["stop_reason"] = stop_hit
        if out_choice is not None:
            out_choice["index"] = self.plan.index * self.plan.n + int(out_choice.get("index", 0))
            if engine_finish is not None and stop_hit is None:
                eos_stop_reason(out_choice, self.ctx.body.get("stop_token_ids"))
            if self.ctx.kind == "chat":
                compact_tool_call_deltas(out_choice)
        out["id"] = self.ctx.response_id
        out["created"] = self.ctx.created
        if self._collect or shape_stream_chunk(self.ctx, out, parsers=self._parsers):
            await emit(out)
        # Handed to the writer (or held back as native would): commit.
        st.stream_state = next_state
        st.tokens += len(new_ids)
        if self._collect:
            st.token_ids.extend(new_ids)
            lp = choice.get("logprobs")
            if isinstance(lp, dict) and isinstance(lp.get("content"), list):
                st.logprobs.extend(lp["content"])
        if stop_hit is not None:
            st.done, st.finish_reason, st.stop_reason = True, "stop", stop_hit
            st.stopped_early = engine_finish is None
        elif engine_finish is not None:
            st.done, st.finish_reason, st.stop_reason = True, engine_finish, choice.get("stop_reason")


def _text_of(ctx: RequestContext, choice: dict[str, Any]) -> str | None:
    if ctx.kind == "chat":
        delta = choice.get("delta") or {}
        v = delta.get("content")
    else:
        v = choice.get("text")
    return v if isinstance(v, str) else None


def _set_text(ctx: RequestContext, choice: dict[str, Any], text: str, *, keep_none: bool) -> None:
    if ctx.kind == "chat":
        delta = choice.setdefault("delta", {})
        if text or not keep_none:
            delta["content"] = text
    else:
        choice["text"] = text
