"""Streaming derender of one engine stream: per-choice ``stream_state``, stop strings, commit rule.

The sidecar is stateless; this object owns the state. The committed state of a choice goes to each
derender call, and the returned state is committed only after the derendered chunk has been handed
to the client writer (``emit`` returned). A failed derender or a cancelled hand-off leaves the
committed state where it was.

**Coalescing.** The engine stream is read by its own task into per-choice buffers while a derender
call is in flight. When the call returns, everything buffered for that choice (up to
``max_tokens_per_call`` tokens) is merged into one ``generate_chunk`` and derendered in one call. At
low load a call finds one engine chunk waiting and nothing changes; under load the calls per token
fall by themselves, which is what lets one sidecar keep up with engines that stream thousands of
tokens per second. A merged call commits all of its tokens at once, after emit, like a single one.
Derender is chunking-invariant for text, logprobs and parser deltas; the one thing merging could
change is *where* a stop string ends generation, so a merged call that hits a stop string is
discarded and replayed one token per call from the committed state: usage and text are then exactly
those of one call per token.

**Parsers.** Not every vLLM 0.32 parser is chunking-invariant: with the ``olmo3`` reasoning parser,
content that arrives in the same delta as ``</think>`` is dropped (the same tokens in deltas of 1 and
3 give the full answer, deltas of 7 lose its first word, one delta of 64 loses all of it; native
``vllm serve`` has the same loss with ``--stream-interval`` > 1). So the derenderer's ``mode()`` says
per stream whether calls may be merged: for parsers measured to be exact (docs/parsers.md) they are,
for the others every call carries one token (engine chunks of several tokens are split too).

**Sidecar affinity.** Each choice keeps its calls on the sidecar that served its last call
(``ChoiceState.route``), where the parser session of the stream lives; when that sidecar fails the
pool retries on another, which replays the stream from ``stream_state``.

**Back-pressure.** The buffers hold at most ``buffer_tokens`` engine tokens per prompt stream; when
they are full the reader stops reading, so a client that reads slowly holds the engine's socket
instead of the coordinator's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, cast

from coordinator.contracts.generate import StreamChunk
from coordinator.observability import tracing
from coordinator.observability.events import event
from coordinator.pipeline.context import PromptPlan, RequestContext
from coordinator.pipeline.derender import token_names
from coordinator.pipeline.derender.client import Derenderer
from coordinator.pipeline.derender.echo import PromptEcho, apply_stream, echo_chunk
from coordinator.pipeline.derender.fixups import (
    compact_tool_call_deltas,
    eos_stop_reason,
    native_top_logprobs,
    stops_on_token,
    stream_token_ids,
    without_stop_token,
)
from coordinator.pipeline.derender.shape import role_chunk, shape_stream_chunk
from coordinator.pipeline.derender.stop import StopMatcher
from coordinator.pipeline.errors import PipelineError, first_leaf
from coordinator.pipeline.sidecar import Affinity

Emit = Callable[[dict[str, Any]], Awaitable[None]]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Coalescing:
    """How engine chunks are grouped into derender calls (``stream.*`` in the config)."""

    enabled: bool = True
    max_tokens_per_call: int = 32
    buffer_tokens: int = 2048


@dataclass
class ChoiceState:
    matcher: StopMatcher
    stream_state: Any = None             # the sidecar's state as raw JSON (msgspec.Raw), passed back as is
    tokens: int = 0                       # output tokens that count for usage
    done: bool = False
    stopped_early: bool = False           # ended by a stop string while the engine was still generating
    finish_reason: str | None = None
    stop_reason: Any = None
    # Only kept when the caller needs the tokens afterwards (non-streaming requests with stop strings).
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    route: Affinity = field(default_factory=Affinity)  # the sidecar holding this stream's session
    echoed: bool = False                  # the prompt's echo went out on this choice's first chunk
    named_offset: int = 0                 # return_tokens_as_token_ids: text_offset of the next token


class PromptStream:
    """Turns one prompt's engine chunks into client chunks with the global choice index."""

    def __init__(self, ctx: RequestContext, plan: PromptPlan, derenderer: Derenderer, *,
                 collect: bool = False, coalescing: Coalescing | None = None,
                 echo: PromptEcho | None = None) -> None:
        self.ctx = ctx
        self.plan = plan
        self._echo = echo  # the prompt, written before each choice's output (derender/echo.py)
        self._derenderer = derenderer
        self._collect = collect
        self._coalescing = coalescing or Coalescing()
        # Chunk keys depend on whether a parser built the delta; both are known once ``run`` starts.
        self._parsers = False
        self._token_by_token = False
        self.choices = {i: ChoiceState(StopMatcher(plan.stop)) for i in range(plan.n)}
        self.derender_calls = 0
        self._buffers: ChoiceBuffers | None = None
        self._roles_started = False
        self._roles_sent = asyncio.Event()

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices.values())

    @property
    def finished(self) -> bool:
        return all(c.done for c in self.choices.values())

    @property
    def buffered_tokens(self) -> int:
        """Engine tokens read but not yet derendered (what a slow client makes the coordinator hold)."""
        return self._buffers.buffered_tokens if self._buffers is not None else 0

    async def run(self, chunks: AsyncIterator[StreamChunk], emit: Emit) -> None:
        """Consume engine chunks until every choice is finished (normally or by a stop string).

        Returning early (every choice done, one of them by a stop string) lets the caller close the
        engine stream, which aborts what the engine still generates. Traced as one ``derender`` span
        for the whole stream (its calls counted), never one per call: at low load a call is a token."""
        mode = await self._derenderer.mode()
        self._parsers, self._token_by_token = mode.parsers, not mode.coalesce
        with tracing.stage("derender", self.ctx.record, kind="client",
                           attributes={"coordinator.prompt.index": self.plan.index}) as span:
            try:
                await self._run(chunks, emit)
            finally:
                if span is not None:
                    tracing.annotate(span, {"coordinator.derender.calls": self.derender_calls,
                                            "coordinator.derender.tokens": self.completion_tokens})

    async def _run(self, chunks: AsyncIterator[StreamChunk], emit: Emit) -> None:
        if not self._coalescing.enabled:
            async for chunk in chunks:
                entry = _entry(chunk)
                if entry is not None:  # a choice-less chunk is the engine's usage: recomputed from our counts
                    await self._step([entry], emit)
                    if self.finished and any(c.stopped_early for c in self.choices.values()):
                        return
            return
        buffers = self._buffers = ChoiceBuffers(self.plan.n, self._coalescing.buffer_tokens)
        reader = asyncio.create_task(self._read(chunks, buffers))
        try:
            try:
                async with asyncio.TaskGroup() as tg:
                    for i in range(self.plan.n):
                        tg.create_task(self._drain(i, buffers, emit))
            except BaseExceptionGroup as group:
                raise first_leaf(group) from None
            if not any(c.stopped_early for c in self.choices.values()):
                await reader  # every choice finished: let it read the engine's [DONE] (no abort needed)
                if buffers.error is not None:
                    raise buffers.error
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader

    async def _read(self, chunks: AsyncIterator[StreamChunk], buffers: ChoiceBuffers) -> None:
        try:
            async for chunk in chunks:
                entry = _entry(chunk)
                if entry is not None:
                    await buffers.put(*entry)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the drains raise it once they have passed on what came before
            await buffers.close(exc)
            return
        await buffers.close()

    async def _drain(self, index: int, buffers: ChoiceBuffers, emit: Emit) -> None:
        """Derender one choice's buffered chunks, as many per call as have piled up."""
        st = self.choices.get(index)
        if st is None:
            return
        while not st.done:
            group = await buffers.take(index, self._coalescing.max_tokens_per_call)
            if group is None:
                return  # the engine stream ended
            await self._step(group, emit)
        await buffers.discard(index)  # ended by a stop string: what the engine still sends is dropped
        if self.finished and any(c.stopped_early for c in self.choices.values()):
            await buffers.close()  # nothing left to read: the caller closes (and aborts) the engine stream

    async def _step(self, group: list[tuple[dict[str, Any], dict[str, Any]]], emit: Emit) -> None:
        if self.ctx.kind == "chat" and not self._collect:
            await self._open_roles(emit)
        if self._token_by_token:
            for piece in split_tokens(group):
                await self._one(*piece, emit, replayable=False)
            return
        for part in finish_alone(group):
            chunk, choice = merge_group(part) if len(part) > 1 else part[0]
            if not await self._one(chunk, choice, emit, replayable=len(choice.get("token_ids") or []) > 1):
                for piece in split_tokens(part):  # a stop string inside a merged call: token by token
                    await self._one(*piece, emit, replayable=False)

    async def _open_roles(self, emit: Emit) -> None:
        """Native opens every chat choice with a role chunk once output starts; a choice's content
        never overtakes its role chunk."""
        if self._roles_sent.is_set():
            return
        if self._roles_started:
            await self._roles_sent.wait()
            return
        self._roles_started = True
        prompt_text = self._echo.prompt_text if self._echo is not None else None
        for i in range(self.plan.n):
            chunk = role_chunk(self.ctx, self.plan, self.plan.index * self.plan.n + i)
            chunk["prompt_text"] = prompt_text
            await emit(chunk)
        if self._echo is not None and self._echo.text:
            for i in range(self.plan.n):
                index = self.plan.index * self.plan.n + i
                await emit(echo_chunk(self.ctx, self.plan, index, self._echo.text))
        self._roles_sent.set()

    async def _one(self, chunk: dict[str, Any], choice: dict[str, Any], emit: Emit, *,
                   replayable: bool) -> bool:
        """Derender, emit, commit. False (nothing emitted or committed) when ``replayable`` and a stop
        string ended the text inside the call: the caller then replays it one token per call."""
        st = self.choices.get(int(choice.get("index", 0)))
        if st is None or st.done:
            return True  # a choice already ended by a stop string keeps generating until its siblings end
        new_ids: list[int] = choice.get("token_ids") or []
        if self.ctx.kind == "completion":
            native_top_logprobs(choice, self.ctx.body)
        if stops_on_token(choice, self.plan.stop):
            chunk = {**chunk, "choices": [without_stop_token(choice)]}
        self.derender_calls += 1
        try:
            out, next_state = await self._derenderer.stream_chunk(self.ctx, self.plan, chunk, st.stream_state,
                                                                  route=st.route)
        except PipelineError as exc:  # a response-stage failure: never retried on an engine
            event(log, "derender_error", self.ctx.request_id, level=logging.WARNING, prompt=self.plan.index,
                  choice=int(choice.get("index", 0)), attempt=self.plan.attempt, error=type(exc).__name__,
                  status=exc.status, detail=exc.message)
            raise
        engine_finish = choice.get("finish_reason")
        out_choice = out["choices"][0] if out.get("choices") else None
        next_offset: int | None = None
        stop_hit: str | None = None
        if out_choice is not None and self.plan.stop.active:
            text = _text_of(self.ctx, out_choice)
            before = replace(st.matcher) if replayable else None
            res = st.matcher.feed(text or "", len(new_ids))
            if res.stop is not None and before is not None:
                st.matcher = before
                return False
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
            named = token_names.wanted(self.ctx.body)
            if self.ctx.kind == "chat":
                compact_tool_call_deltas(out_choice)
                if named:
                    token_names.name_chat(out_choice, choice)
            else:
                if named:
                    next_offset = token_names.name_completion(out_choice, choice, st.named_offset)
                if self.ctx.body.get("return_token_ids"):
                    first_ids = self.plan.prompt_token_ids if st.tokens == 0 else None
                    stream_token_ids(out_choice, new_ids, first_ids)
                if self._echo is not None:
                    apply_stream(self._echo, self.plan, out_choice, first=not st.echoed)
        out["id"] = self.ctx.response_id
        out["created"] = self.ctx.created
        if self.ctx.adapter is not None:  # derender ran as the base model; the answer names the adapter
            out["model"] = self.ctx.adapter
        if self._collect or shape_stream_chunk(self.ctx, out, parsers=self._parsers):
            await emit(out)
        # Handed to the writer (or held back as native would): commit.
        st.echoed = st.echoed or (self._echo is not None and out_choice is not None)
        if next_offset is not None:
            st.named_offset = next_offset
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
        return True


Entry = tuple[dict[str, Any], dict[str, Any]]  # (engine chunk, its one choice)


def _entry(chunk: StreamChunk) -> Entry | None:
    """The chunk and its one choice as the plain dicts derender rewrites into the client's shapes:
    the typed view of the engine's wire ends here."""
    choices = chunk.get("choices") or []
    return (cast(dict[str, Any], chunk), cast(dict[str, Any], choices[0])) if choices else None


class ChoiceBuffers:
    """Engine chunks waiting for derender, per choice, bounded in tokens over all choices.

    ``put`` waits while the bound is reached (so the reader stops reading the engine stream);
    ``take`` hands a drain everything waiting for its choice, up to a token cap."""

    def __init__(self, n: int, capacity_tokens: int) -> None:
        self._queues: dict[int, deque[Entry]] = {i: deque() for i in range(n)}
        self._capacity = capacity_tokens
        self._tokens = 0
        self._dropped: set[int] = set()
        self._closed = False
        self._error: BaseException | None = None
        self._changed = asyncio.Condition()

    @property
    def buffered_tokens(self) -> int:
        return self._tokens

    async def put(self, chunk: dict[str, Any], choice: dict[str, Any]) -> None:
        index = int(choice.get("index", 0))
        async with self._changed:
            await self._changed.wait_for(lambda: self._tokens < self._capacity or self._closed)
            if self._closed or index in self._dropped or index not in self._queues:
                return
            self._queues[index].append((chunk, choice))
            self._tokens += _cost(choice)
            self._changed.notify_all()

    async def take(self, index: int, max_tokens: int) -> list[Entry] | None:
        """The next group for ``index`` (at least one chunk); None once the stream ended and nothing
        is left; raises the reader's error after what came before it."""
        queue = self._queues[index]
        async with self._changed:
            await self._changed.wait_for(lambda: bool(queue) or self._closed)
            if not queue:
                if self._error is not None:
                    raise self._error
                return None
            group = [queue.popleft()]
            taken = _cost(group[0][1])
            while queue and taken + _cost(queue[0][1]) <= max_tokens:
                group.append(queue.popleft())
                taken += _cost(group[-1][1])
            self._tokens -= taken
            self._changed.notify_all()
            return group

    async def discard(self, index: int) -> None:
        """Drop what is buffered for a finished choice and ignore what still comes for it."""
        async with self._changed:
            self._dropped.add(index)
            self._tokens -= sum(_cost(c) for _, c in self._queues[index])
            self._queues[index].clear()
            self._changed.notify_all()

    async def close(self, error: BaseException | None = None) -> None:
        async with self._changed:
            self._closed = True
            self._error = self._error or error
            self._changed.notify_all()

    @property
    def error(self) -> BaseException | None:
        return self._error


def _cost(choice: dict[str, Any]) -> int:
    """Buffer cost of a chunk: its tokens (a finish-only chunk still counts one)."""
    return max(1, len(choice.get("token_ids") or ()))


def merge_group(group: list[Entry]) -> Entry:
    """Engine chunks of one choice as one chunk: tokens, logprobs and per-token lists concatenated in
    order; finish and stop reason, usage and the other top-level keys from the last chunk."""
    first_chunk, _ = group[0]
    last_chunk, last_choice = group[-1]
    merged: dict[str, Any] = dict(last_choice)
    merged["token_ids"] = [t for _, c in group for t in (c.get("token_ids") or ())]
    contents = [c["logprobs"]["content"] for _, c in group
                if isinstance(c.get("logprobs"), dict) and isinstance(c["logprobs"].get("content"), list)]
    if contents:
        merged["logprobs"] = {**(last_choice.get("logprobs") or {}),
                              "content": [e for lst in contents for e in lst]}
    for key in ("routed_experts", "sampling_mask"):
        parts = [c.get(key) for _, c in group]
        if all(isinstance(p, list) for p in parts):
            merged[key] = [e for p in parts for e in p]  # type: ignore[union-attr]
    chunk = {**last_chunk, "choices": [merged]}
    if "prompt_token_ids" in first_chunk:  # only the engine's first chunk carries it
        chunk["prompt_token_ids"] = first_chunk["prompt_token_ids"]
    return chunk, merged


def split_tokens(group: list[Entry]) -> list[Entry]:
    """The same output as one-token chunks (finish and stop reason on the last token of the last one)."""
    pieces: list[Entry] = []
    for chunk, choice in group:
        ids = list(choice.get("token_ids") or ())
        lp = choice.get("logprobs")
        content = lp.get("content") if isinstance(lp, dict) else None
        if len(ids) <= 1:
            pieces.append((chunk, choice))
            continue
        for j, tok in enumerate(ids):
            last = j == len(ids) - 1
            piece = {**choice, "token_ids": [tok],
                     "finish_reason": choice.get("finish_reason") if last else None,
                     "stop_reason": choice.get("stop_reason") if last else None}
            if isinstance(content, list) and len(content) == len(ids):
                piece["logprobs"] = {**lp, "content": [content[j]]}  # type: ignore[dict-item]
            for key in ("routed_experts", "sampling_mask"):
                value = choice.get(key)
                if isinstance(value, list) and len(value) == len(ids):
                    piece[key] = [value[j]]
            pieces.append(({**chunk, "choices": [piece]}, piece))
    return pieces


def finish_alone(group: list[Entry]) -> list[list[Entry]]:
    """A merged group that ends the choice, as (the tokens before the last) + (the last token).

    Native's finishing chunk holds only what the last token makes: after a tool call's arguments it
    is an empty delta with ``finish_reason: "tool_calls"``, not the arguments' tail with the finish
    on it. Splitting the last token off costs one call per stream and keeps that boundary exact."""
    if group[-1][1].get("finish_reason") is None:
        return [group]
    pieces = split_tokens(group)
    if len(pieces) < 2:
        return [group]
    return [pieces[:-1], pieces[-1:]]



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
