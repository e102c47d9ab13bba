"""StreamSession: bounded hand-off, commit-after-hand-off, sibling cancellation, cleanup.

The dispatcher and the derender sidecar are replaced by in-memory stand-ins so the session's own
rules can be observed exactly; the real parts are exercised in tests/integration and tests/e2e.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from coordinator.pipeline.context import PromptPlan, RequestContext, StopSpec
from coordinator.pipeline.derender.client import StreamMode
from coordinator.pipeline.derender.session import StreamSession
from coordinator.pipeline.derender.stream import Coalescing
from coordinator.pipeline.errors import UpstreamUnavailable


def plan(i: int, stop: tuple[str, ...] = ()) -> PromptPlan:
    return PromptPlan(index=i, generate={"request_id": f"cmpl-x-{i}", "token_ids": [1, 2],
                                         "sampling_params": {"max_tokens": 100}},
                      prompt_token_ids=[1, 2], n=1, stop=StopSpec(stop))


class FakeEngine:
    """Per prompt: a list of token ids to stream, optionally failing after some chunks."""

    def __init__(self, tokens: dict[int, list[int]], fail_after: dict[int, int] | None = None) -> None:
        self.tokens = tokens
        self.fail_after = fail_after or {}
        self.pulled: dict[int, int] = dict.fromkeys(tokens, 0)
        self.closed: set[int] = set()
        self.opened: set[int] = set()

    @contextlib.asynccontextmanager
    async def stream(self, ctx: RequestContext, p: PromptPlan) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        self.opened.add(p.index)

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            toks = self.tokens[p.index]
            for k, t in enumerate(toks):
                if self.fail_after.get(p.index) == k:
                    raise UpstreamUnavailable("engine died")
                self.pulled[p.index] += 1
                await asyncio.sleep(0)
                yield {"request_id": "r", "choices": [{"index": 0, "token_ids": [t],
                                                        "finish_reason": "length" if k == len(toks) - 1 else None}]}

        try:
            yield chunks()
        finally:
            self.closed.add(p.index)


class FakeDerender:
    """Text of token t is chr(t); state counts calls so commits can be checked."""

    def __init__(self, fail_on_token: int | None = None) -> None:
        self.fail_on_token = fail_on_token
        self.states_seen: list[Any] = []

    async def mode(self) -> StreamMode:
        return StreamMode(parsers=False, coalesce=True)

    async def stream_chunk(self, ctx: RequestContext, p: PromptPlan, chunk: dict[str, Any],
                           state: dict[str, Any] | None, **_: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        self.states_seen.append(state)
        ch = chunk["choices"][0]
        if ch["token_ids"] == [self.fail_on_token]:
            raise UpstreamUnavailable("derender failed")
        n = (state or {"n": 0})["n"] + 1
        out = {"id": "x", "choices": [{"index": 0, "text": "".join(chr(t) for t in ch["token_ids"]),
                                       "finish_reason": ch["finish_reason"]}]}
        return out, {"n": n}


class SlowDerender(FakeDerender):
    """Each call takes a moment, during which the engine's chunks pile up."""

    async def stream_chunk(self, ctx: RequestContext, p: PromptPlan, chunk: dict[str, Any],
                           state: dict[str, Any] | None, **_: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        await asyncio.sleep(0.005)
        return await super().stream_chunk(ctx, p, chunk, state)


def ctx_for(plans: list[PromptPlan]) -> RequestContext:
    c = RequestContext(kind="completion", request_id="x", body={}, model="m", stream=True, include_usage=True)
    c.prompts = plans
    return c


@pytest.mark.parametrize("coalescing", [Coalescing(enabled=False), Coalescing(max_tokens_per_call=8, buffer_tokens=16)])
async def test_slow_client_bounds_what_the_session_pulls(coalescing: Coalescing) -> None:
    engine = FakeEngine({0: [65] * 5000})
    s = StreamSession(ctx_for([plan(0)]), engine.stream, FakeDerender(), queue_chunks=4,  # type: ignore[arg-type]
                      coalescing=coalescing)
    await s.open()
    events = s.events()
    first = await events.__anext__()          # the client reads one chunk, then stalls
    assert first["choices"][0]["text"].startswith("A")
    await asyncio.sleep(0.1)
    held = engine.pulled[0]
    # Queue (4 chunks of at most max_tokens_per_call) + the buffer + one call in flight + one being read.
    bound = 4 * coalescing.max_tokens_per_call + coalescing.buffer_tokens + coalescing.max_tokens_per_call + 2
    if not coalescing.enabled:
        bound = 4 + 2
    assert held <= bound, f"the session pulled {held} tokens for a client that stopped reading"
    await asyncio.sleep(0.1)
    assert engine.pulled[0] == held, "reading from the engine stopped (back-pressure), it did not slow down"
    await events.aclose()
    await s.aclose()
    assert engine.closed == {0}


async def test_coalescing_merges_chunks_that_pile_up_during_a_call() -> None:
    engine = FakeEngine({0: [65 + i % 26 for i in range(200)]})
    der = SlowDerender()
    s = StreamSession(ctx_for([plan(0)]), engine.stream, der, queue_chunks=64,  # type: ignore[arg-type]
                      coalescing=Coalescing(max_tokens_per_call=32, buffer_tokens=1000))
    await s.open()
    events = [e async for e in s.events()]
    await s.aclose()
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text == "".join(chr(65 + i % 26) for i in range(200))
    assert events[-1]["usage"]["completion_tokens"] == 200
    assert len(der.states_seen) <= 200 // 4, "calls per token fall when chunks pile up"
    assert max(len(e["choices"][0]["text"]) for e in events if e["choices"]) <= 32


async def test_the_finishing_token_gets_a_chunk_of_its_own_when_chunks_pile_up() -> None:
    """Native's last chunk is what the last token makes (after a tool call: an empty delta with the
    finish), so a merged call never carries the finish on text from the tokens before it."""
    engine = FakeEngine({0: [65 + i % 26 for i in range(200)]})
    der = SlowDerender()
    s = StreamSession(ctx_for([plan(0)]), engine.stream, der, queue_chunks=64,  # type: ignore[arg-type]
                      coalescing=Coalescing(max_tokens_per_call=32, buffer_tokens=1000))
    await s.open()
    events = [e async for e in s.events() if e["choices"]]
    await s.aclose()
    assert len(der.states_seen) < 200, "chunks were merged"
    *rest, last = events
    assert last["choices"][0] == {"index": 0, "text": chr(65 + 199 % 26), "finish_reason": "length"}
    assert all(e["choices"][0]["finish_reason"] is None for e in rest)
    assert "".join(e["choices"][0]["text"] for e in events) == "".join(chr(65 + i % 26) for i in range(200))


async def test_state_is_committed_only_after_successful_derender() -> None:
    engine = FakeEngine({0: [65, 66, 67, 68]})
    der = FakeDerender(fail_on_token=67)
    s = StreamSession(ctx_for([plan(0)]), engine.stream, der, queue_chunks=8)  # type: ignore[arg-type]
    await s.open()
    got = []
    with pytest.raises(UpstreamUnavailable):
        async for ev in s.events():
            got.append(ev)
    await s.aclose()
    assert [e["choices"][0]["text"] for e in got] == ["A", "B"]
    # The failing call was made with the state committed after "B", and nothing advanced past it.
    assert der.states_seen == [None, {"n": 1}, {"n": 2}]
    assert s._streams[0][0].choices[0].stream_state == {"n": 2}


async def test_one_failing_prompt_cancels_and_closes_its_siblings() -> None:
    engine = FakeEngine({0: [65] * 50, 1: [66] * 50, 2: [67] * 50}, fail_after={1: 3})
    s = StreamSession(ctx_for([plan(0), plan(1), plan(2)]), engine.stream, FakeDerender(),  # type: ignore[arg-type]
                      queue_chunks=2)
    await s.open()
    assert engine.opened == {0, 1, 2}, "every engine stream is open before the first event"
    with pytest.raises(UpstreamUnavailable):
        async for _ in s.events():
            pass
    await s.aclose()
    assert engine.closed == {0, 1, 2}
    assert all(t.done() for t in s._tasks)


async def test_merge_remaps_choice_index_and_sums_usage() -> None:
    engine = FakeEngine({0: [65, 66], 1: [67], 2: [68, 69, 70]})
    s = StreamSession(ctx_for([plan(0), plan(1), plan(2)]), engine.stream, FakeDerender(),  # type: ignore[arg-type]
                      queue_chunks=8)
    await s.open()
    events = [e async for e in s.events()]
    await s.aclose()
    texts: dict[int, str] = {}
    for e in events[:-1]:
        ch = e["choices"][0]
        texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    assert texts == {0: "AB", 1: "C", 2: "DEF"}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    assert events[-1]["usage"]["prompt_tokens"] == 6


async def test_stop_string_ends_the_stream_and_closes_the_engine_stream() -> None:
    engine = FakeEngine({0: [ord(c) for c in "hello world and more"]})
    s = StreamSession(ctx_for([plan(0, stop=(" wor",))]), engine.stream, FakeDerender(),  # type: ignore[arg-type]
                      queue_chunks=8)
    await s.open()
    events = [e async for e in s.events()]
    await s.aclose()
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text == "hello"
    last = [e for e in events if e["choices"]][-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", " wor")
    assert events[-1]["usage"]["completion_tokens"] == len("hello wor")
    assert engine.closed == {0}
