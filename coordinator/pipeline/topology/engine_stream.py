"""The streaming engine leg of one prompt, across attempts: grant, breaker feeding, abort, ledger, relay.

One ``EngineStream`` owns what a prompt's streaming generation holds on the engine side: the
admission grant and placement of the current attempt, its open HTTP stream (closing it aborts the
engine request), the breaker feeding of the engine it runs on, and the **ledger**, the output token
ids it has handed to derender.

**Relay** (docs/relay.md). When the engine fails after chunks flowed
(connection cut, 5xx or error event mid-stream, process killed, stall past
``engine_client.stream_idle_timeout_s``), a single-prompt ``n=1`` stream is continued on another
healthy engine: the replay request's prompt is the original prompt ids plus the ledger, its
``max_tokens``/``min_tokens`` are reduced by the ledger's length, every other sampling parameter is
kept, and it runs through the whole topology again (a P/D placement re-prefills the replay ids). The
consumer sees one uninterrupted chunk sequence, so derender continues from its last committed
``stream_state`` and the stop matcher's hold-back and usage counts carry over.

The ledger holds every token handed to the consumer, not only those already committed to the
client. That is the same set at the moment it matters: the engine side failing never drops what
the consumer buffered, so each ledger token is committed before the replay's first token is.
Derender failures are raised by the consumer, never here, so they never cause a relay.

**Grammar-constrained streams** cannot be replayed that way: vLLM's grammar matcher starts at the
first output token, so a prompt ending with the ledger would start the document again mid-way. They
are *regenerated* instead: the original request (grammar, seed and all) runs again on another
engine, and its first ``len(ledger)`` tokens are checked against the ledger and dropped; the stream
goes on from there, still inside the grammar. That needs the same tokens again, so it is done for
greedy requests and seeded ones, and a sampled constrained stream without a seed gets one when it
starts (a seed drawn at random samples from the same distribution). Tokens that come out different
(engines batching differently can tip a near-tie) end the stream with ``RelayDiverged``, never a
spliced document. The client waits while the new engine regenerates what it already has.

Multi-prompt and ``n>1`` streams have no per-choice replay (one engine request carries every choice
of a prompt, and their ledgers differ): they are retried as a whole only while this stream has
handed out nothing and nothing of the request reached the client.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from coordinator.contracts.generate import GenerateRequest, StreamChunk
from coordinator.observability.events import event
from coordinator.pipeline.context import PromptPlan, RequestContext
from coordinator.pipeline.engines.capabilities import has_grammar
from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.errors import (
    RelayDiverged,
    UpstreamClientError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from coordinator.pipeline.scheduling.request import SchedRequest

if TYPE_CHECKING:
    from coordinator.observability.tracing import Leg
    from coordinator.pipeline.admission.controller import Grant
    from coordinator.pipeline.topology.attempts import Attempts, Opener

log = logging.getLogger(__name__)


@dataclass
class Attempt:
    """One engine attempt: what it holds and where it runs."""

    number: int
    grant: Grant
    stack: contextlib.AsyncExitStack   # the open engine stream(s); closing aborts what is unfinished
    chunks: AsyncIterator[StreamChunk]
    req: SchedRequest
    leg: Leg | None = None             # the attempt's span (tracing on), ended with its stream

    @property
    def engine(self) -> Engine:
        return self.grant.placement.engine


def relayable(exc: BaseException) -> bool:
    """An engine-side failure of a stream that had started: the engine, not the request, failed."""
    return isinstance(exc, UpstreamUnavailable | UpstreamTimeout) and not isinstance(exc, UpstreamClientError)


def replay_generate(plan: PromptPlan, ledger: list[int]) -> GenerateRequest:
    """The GenerateRequest that continues ``plan`` after ``ledger`` was generated.

    Prompt = original prompt ids + ledger; ``max_tokens`` and ``min_tokens`` shrink by the ledger;
    ``prompt_logprobs`` is dropped (the client already has the original prompt's). Everything else,
    ``seed`` included, is kept: greedy output continues exactly; seeded sampling continues with a
    valid sample that is not the one an uninterrupted stream would have drawn."""
    sp = plan.generate["sampling_params"].copy()
    done = len(ledger)
    sp["max_tokens"] = sp["max_tokens"] - done
    if sp.get("min_tokens"):
        sp["min_tokens"] = max(0, sp["min_tokens"] - done)
    sp.pop("prompt_logprobs", None)
    return {**plan.generate, "token_ids": [*plan.prompt_token_ids, *ledger], "sampling_params": sp}


class EngineStream:
    """A prompt's engine stream that survives engine failures (see the module docstring)."""

    def __init__(self, attempts: Attempts, topology: Opener, ctx: RequestContext, plan: PromptPlan) -> None:
        self._a = attempts
        self._t = topology
        self._ctx = ctx
        self._plan = plan
        self._single = len(ctx.prompts) <= 1 and plan.n == 1
        self.ledger: list[int] = []          # output ids handed out (n=1), semantic ids
        self.handed_tokens = 0               # tokens handed out over all choices
        self._finished: set[int] = set()     # choices whose final chunk was handed out
        self.relays = 0
        self._attempts = 0
        self._current: Attempt | None = None
        self._req = topology.sched_request(ctx, plan, plan.generate)
        self._closed = False
        sp = plan.generate.get("sampling_params") or {}
        self._regenerates = self._single and has_grammar(sp)  # relayed by regeneration (module doc)
        if self._regenerates and sp.get("seed") is None and sp.get("temperature", 1.0) != 0:
            sp["seed"] = secrets.randbits(31)  # so a regeneration draws the same tokens
        self._expected: list[int] = []        # a regeneration's tokens the client already has

    @property
    def engine(self) -> Engine | None:
        return self._current.engine if self._current is not None else None

    async def open(self) -> None:
        """The first attempt (retried on other engines while it fails to open)."""
        self._current = await self._open(self._plan.generate, self._req)

    async def _open(self, generate: GenerateRequest, req: SchedRequest) -> Attempt:
        opened: Attempt | None = None
        async for attempt in self._a.retrying(req):
            with attempt:
                self._attempts += 1
                grant, stack, chunks, leg = await self._t.open_attempt(self._ctx, generate, req)
                opened = Attempt(self._attempts, grant, stack, chunks, req, leg)
        assert opened is not None
        return opened

    async def chunks(self) -> AsyncIterator[StreamChunk]:
        """Engine chunks of every attempt, as one sequence; raises when the stream cannot go on."""
        first = True
        while True:
            attempt = self._current
            assert attempt is not None, "open() first"
            replay = self._single and attempt.req is not self._req
            offset = len(self.ledger)
            try:
                async for chunk in attempt.chunks:
                    if self._expected:
                        trimmed = self._regenerated(chunk)
                        if trimmed is None:
                            continue
                        chunk = trimmed
                    elif replay:
                        chunk = _as_original(chunk, self._plan, offset)
                    if first:  # the record's time to first engine chunk (once, not per token)
                        self._ctx.record.engine_chunk()
                        first = False
                    self._hand_out(chunk)
                    yield chunk
                await self._end(attempt, None)
                return
            except GeneratorExit:
                raise
            except BaseException as exc:
                if not relayable(exc):
                    raise
                await self._end(attempt, exc)
                if self._all_finished():
                    log.info("request %s: engine %s failed after the last token (%s); stream complete",
                             self._ctx.request_id, attempt.engine.url, exc)
                    return
                if not self._may_relay(exc, attempt):
                    raise
                self._current = await self._relay(attempt, exc)

    def _regenerated(self, chunk: StreamChunk) -> StreamChunk | None:
        """A regeneration's chunk less the tokens the client already has (None: nothing left of it);
        raises ``RelayDiverged`` when they differ."""
        choices = chunk.get("choices") or []
        if not choices:
            return chunk
        choice = choices[0]
        ids = list(choice.get("token_ids") or ())
        k = min(len(ids), len(self._expected))
        if ids[:k] != self._expected[:k]:
            event(log, "relay", self._ctx.request_id, level=logging.WARNING, prompt=self._plan.index,
                  relay=self.relays, committed=len(self.ledger), result="diverged",
                  at=len(self.ledger) - len(self._expected))
            raise RelayDiverged("The engine that took over this stream after a failure generated "
                                "different tokens from those already sent; the stream cannot go on")
        del self._expected[:k]
        if k == len(ids) and choice.get("finish_reason") is None:
            return None
        rest = choice.copy()
        rest["token_ids"] = ids[k:]
        lp = choice.get("logprobs")
        content = lp.get("content") if isinstance(lp, dict) else None
        if lp is not None and isinstance(content, list):
            rest["logprobs"] = {**lp, "content": content[k:]}
        out = _without_prompt(chunk)
        out["choices"] = [rest]
        return out

    def _hand_out(self, chunk: StreamChunk) -> None:
        for choice in chunk.get("choices") or ():
            ids = choice.get("token_ids") or ()
            self.handed_tokens += len(ids)
            if self._single:
                self.ledger.extend(ids)
            if choice.get("finish_reason") is not None:
                self._finished.add(int(choice.get("index", 0)))

    def _all_finished(self) -> bool:
        return len(self._finished) >= self._plan.n

    def _may_relay(self, exc: BaseException, attempt: Attempt) -> bool:
        r = self._a.resilience
        why = None
        if self.relays >= r.max_relays:
            why = f"resilience.max_relays ({r.max_relays}) reached"
        elif not self._single and (self.handed_tokens or self._ctx.visible):
            why = "multi-prompt and n>1 streams are retried only before their first visible chunk"
        elif self.handed_tokens and has_grammar(self._plan.generate.get("sampling_params")) and (
                not self._regenerates):
            # vLLM's grammar matcher starts from the first output token: a replay whose prompt ends
            # with the ledger would start the document again mid-way (docs/engine-capabilities.md).
            why = "a grammar-constrained stream cannot resume mid-document on another engine"
        elif self._req.engine_deaths > r.retries_after_engine_death:
            why = f"{self._req.engine_deaths} engines died while running it"
        elif not self._a.has_other_engine(self._req):
            why = "no other healthy engine"
        elif self._plan.max_tokens - len(self.ledger) < 1:
            why = "no output budget left"
        if why is not None:
            event(log, "relay", self._ctx.request_id, level=logging.WARNING, prompt=self._plan.index,
                  relay=self.relays + 1, committed=len(self.ledger), from_engine=attempt.engine.url,
                  reason=type(exc).__name__, result="refused", why=why)
            return False
        return True

    async def _relay(self, failed: Attempt, exc: BaseException) -> Attempt:
        self.relays += 1
        if self._regenerates:
            generate = self._plan.generate  # the whole request again; the ledger's part is checked off
            self._expected = list(self.ledger)
        elif self._single:
            generate = replay_generate(self._plan, self.ledger)
        else:
            generate = self._plan.generate  # nothing handed out: a plain retry from the start
        req = self._t.sched_request(self._ctx, self._plan, generate)
        req.exclude = self._req.exclude          # shared: every attempt avoids every failed engine
        req.engine_deaths = self._req.engine_deaths
        self._a.count_relay()
        try:
            attempt = await self._open(generate, req)
        except BaseException as reopen:
            event(log, "relay", self._ctx.request_id, level=logging.WARNING, prompt=self._plan.index,
                  relay=self.relays, committed=len(self.ledger), from_engine=failed.engine.url,
                  to_engine=None, reason=type(exc).__name__, result=type(reopen).__name__)
            raise
        finally:
            self._req.engine_deaths = req.engine_deaths
        self._plan.attempt += 1
        event(log, "relay", self._ctx.request_id, level=logging.WARNING, prompt=self._plan.index,
              relay=self.relays, committed=len(self.ledger),
              remaining=int(generate["sampling_params"]["max_tokens"]),
              replay_prompt_tokens=len(generate["token_ids"]), from_engine=failed.engine.url,
              to_engine=attempt.engine.url, reason=type(exc).__name__, result="ok")
        # The replay's own request id is only for scheduling; the prompt's stays the same.
        attempt.req = req
        if attempt.leg is not None:
            attempt.leg.annotate({"coordinator.relay": self.relays,
                                  "coordinator.relay.committed": len(self.ledger)})
        return attempt

    async def _end(self, attempt: Attempt, exc: BaseException | None) -> None:
        """Close the attempt's stream (aborting the engine request if unfinished), feed the breaker
        with a mid-stream failure, count a dead engine, give the grant back."""
        if self._current is attempt:
            self._current = None
        if exc is not None:
            event(log, "leg", self._ctx.request_id, level=logging.WARNING, engine=attempt.engine.url,
                  phase="stream", result=type(exc).__name__, tokens=self.handed_tokens, error=str(exc))
            if attempt.leg is not None:
                attempt.leg.failed(exc, **{"coordinator.stream.tokens": self.handed_tokens})
        try:
            await attempt.stack.aclose()
        finally:
            try:
                if exc is not None:
                    self._a.failed(attempt.engine, exc, self._req)
                    await self._a.count_death(attempt.grant, exc, self._req)
            finally:
                self._a.release(attempt.grant)

    async def aclose(self) -> None:
        """Release the current attempt (closing its stream aborts the engine request)."""
        if self._closed:
            return
        self._closed = True
        if self._current is not None:
            await self._end(self._current, None)


def _without_prompt(chunk: StreamChunk) -> StreamChunk:
    """A copy without the (replay's) prompt ids and prompt logprobs."""
    out = chunk.copy()
    out.pop("prompt_token_ids", None)
    cast(dict[str, Any], out).pop("prompt_logprobs", None)  # not a 0.32 stream field; dropped if sent
    return out


def _as_original(chunk: StreamChunk, plan: PromptPlan, offset: int) -> StreamChunk:
    """A replay chunk as the original request's: no replay prompt ids/logprobs, usage in the
    original's terms (prompt = original prompt, completion counts what came before the relay)."""
    out = _without_prompt(chunk)
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        completion = int(usage.get("completion_tokens") or 0) + offset
        out["usage"] = {**usage, "prompt_tokens": plan.prompt_tokens, "completion_tokens": completion,
                        "total_tokens": plan.prompt_tokens + completion}
    return out
