"""One observation record per operation, whichever door it came through.

Why one record: the HTTP door, the NNRP door and the pipeline each know part of what happened to a
request (the door: ids, transport, what it wrote and when; the pipeline: model, render, queue delay,
engine timings, usage, errors). Each fills its part of the same ``Record`` where it learns it, and
the record is finished exactly once when the request ends; the finished record is the single source
of the ``request`` log event, the request-level Prometheus collectors and NNRP's diagnostics
summary, so the three never disagree.

Deep pipeline stages (admission, the engine client) reach the request's record through the
``current`` context variable, set by ``Pipeline.serve`` in the request's task (tasks it creates
inherit it), instead of every signature on the way carrying it.

Aborts finish asynchronously (the engine client's abort is fire-and-forget so it never delays the
client): ``finish()`` on a record with aborts still in flight completes when they have answered, so
``engine_abort_accepted`` in the log event and the summary is the engine's answer, not a guess.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from coordinator.observability.events import event

log = logging.getLogger("coordinator.request")

Door = Literal["http", "nnrp", "internal"]
Outcome = Literal["completed", "error", "cancelled"]
CLIENT_CLOSED = 499  # nginx's "client closed request": the client left or cancelled


class Sink(Protocol):
    """Where finished records go (``Observer``); ``inter_event`` is fed while the stream runs."""

    def finished(self, record: Record) -> None: ...

    def inter_event(self, record: Record, gap_s: float) -> None: ...


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


@dataclass(eq=False, slots=True)
class Record:
    """What one operation did. Times are ``time.monotonic()``; ``*_ms`` members in ``to_dict`` count
    from ``started`` (the request's arrival at its door)."""

    door: Door
    sink: Sink | None = field(default=None, repr=False)
    started: float = field(default_factory=time.monotonic)
    # -- identity (door) --------------------------------------------------------------------------
    request_id: str | None = None
    connection_id: str | None = None   # peer address of the TCP connection
    session_id: str | None = None      # NNRP session
    operation_id: str | None = None    # NNRP operation id (submit's ``op``)
    frame_id: int | None = None        # NNRP: the submit's ordinal among the session's frames
    transport: str | None = None       # http/json, http/sse, websocket/json, websocket/msgpack
    # -- request (pipeline) ------------------------------------------------------------------------
    model: str | None = None           # served model name (never the client's string: label safety)
    tenant: str | None = None          # the API key's tenant (docs/tenants.md)
    operation: str | None = None       # chat.completions.create, completions.create
    stream: bool | None = None
    route: str | None = None           # tokens, native
    render_ms: float | None = None
    queue_delay_s: float | None = None  # longest admission wait over the request's engine requests
    first_engine_chunk: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # -- output (door) -----------------------------------------------------------------------------
    first_event: float | None = None
    last_event: float | None = None
    output_events: int = 0
    # -- outcome ----------------------------------------------------------------------------------
    status: int | None = None          # the HTTP status the request ended with (499: client left)
    outcome: Outcome | None = None
    error_family: str | None = None    # the PipelineError type (or the exception type)
    cancel_source: str | None = None   # client, timeout, session, client_gone
    cancel_reason: str | None = None
    client_gone: bool = False          # the client's connection went away before the end
    ended_by_server: bool = False      # cut at the drain deadline (the client got a 503, it did not leave)
    engine_abort_accepted: bool | None = None
    ended: float | None = None
    _aborts: list[asyncio.Future[bool]] = field(default_factory=list, repr=False)
    _finishing: bool = field(default=False, repr=False)
    _done: asyncio.Event | None = field(default=None, repr=False)

    # -- filling ----------------------------------------------------------------------------------
    def output_event(self) -> None:
        """One event written to the client (an SSE chunk, an NNRP result frame)."""
        now = time.monotonic()
        if self.first_event is None:
            self.first_event = now
        elif self.sink is not None and self.last_event is not None:
            self.sink.inter_event(self, now - self.last_event)
        self.last_event = now
        self.output_events += 1

    def engine_chunk(self) -> None:
        if self.first_engine_chunk is None:
            self.first_engine_chunk = time.monotonic()

    def queued(self, waited_s: float) -> None:
        self.queue_delay_s = max(self.queue_delay_s or 0.0, waited_s)

    def usage(self, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        if prompt_tokens is not None:
            self.prompt_tokens = prompt_tokens
        if completion_tokens is not None:
            self.completion_tokens = completion_tokens

    def fail(self, exc: BaseException, status: int | None = None) -> None:
        """The first failure wins (a later one is a consequence of it)."""
        self.failed(type(exc).__name__, status if status is not None else int(getattr(exc, "status", 500)))

    def failed(self, family: str, status: int) -> None:
        """A failure known by its error type's name and status (e.g. from an error event)."""
        if self.outcome is None:
            self.outcome, self.error_family, self.status = "error", family, status

    def cancel(self, source: str, reason: str | None = None) -> None:
        """The operation was cancelled (client, timeout, session end, client gone); first one wins."""
        if self.outcome is not None:
            return
        self.outcome = "cancelled"
        self.status = CLIENT_CLOSED
        self.cancel_source = source
        self.cancel_reason = reason

    def gone(self, source: str = "client_gone", reason: str | None = None) -> None:
        """The client's connection went away: counted as a disconnect, and a cancellation if unfinished.
        Not when the server itself ended the request (``ended_by_server``): the client was still there."""
        if self.ended_by_server:
            return
        self.client_gone = True
        self.cancel(source, reason)

    def server_ended(self, family: str, status: int) -> None:
        """The server ended the request (the drain deadline at shutdown) through the same path a leaving
        client takes; recorded as the error the client got, not as a disconnect."""
        self.failed(family, status)
        self.ended_by_server = True

    def complete(self, status: int = 200) -> None:
        if self.outcome is None:
            self.outcome, self.status = "completed", status

    def abort_sent(self, answer: asyncio.Future[bool]) -> None:
        """An engine abort for this request is on its way; ``answer`` says whether it was accepted."""
        self._aborts.append(answer)

    # -- ending -----------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self._finishing

    def finish(self) -> None:
        """End the record (idempotent): the sink gets it now, or once pending engine aborts answered."""
        if self._finishing:
            return
        self._finishing = True
        self.ended = time.monotonic()
        if self.outcome is None:
            self.complete()
        pending = [f for f in self._aborts if not f.done()]
        if not pending:
            self._deliver()
            return
        left = len(pending)

        def one_done(_: asyncio.Future[bool]) -> None:
            nonlocal left
            left -= 1
            if left == 0:
                self._deliver()

        for f in pending:
            f.add_done_callback(one_done)

    def _settle_aborts(self) -> None:
        answer = self.abort_answer()
        self.engine_abort_accepted = answer if answer is not None or not self._aborts else False

    def _deliver(self) -> None:
        self._settle_aborts()
        if self._done is not None:
            self._done.set()
        if self.sink is not None:
            try:
                self.sink.finished(self)
            except Exception:  # observing must never break a request
                log.exception("observation record %s could not be delivered", self.request_id)

    async def delivered(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until the finished record went out, aborts answered included."""
        if self._done is None:
            self._done = asyncio.Event()
            if self._finishing and all(f.done() for f in self._aborts):
                self._settle_aborts()
                self._done.set()
        try:
            async with asyncio.timeout(timeout_s):
                await self._done.wait()
        except TimeoutError:
            return False
        return True

    def abort_answer(self) -> bool | None:
        """What the engine said to this request's aborts so far (None: none sent or none answered)."""
        answers = [f.result() for f in self._aborts
                   if f.done() and not f.cancelled() and f.exception() is None]
        return all(answers) if answers else None

    # -- views ------------------------------------------------------------------------------------
    def since(self, t: float | None) -> float | None:
        return None if t is None else t - self.started

    @property
    def e2e_s(self) -> float:
        return (self.ended if self.ended is not None else time.monotonic()) - self.started

    def to_dict(self) -> dict[str, Any]:
        """The record as documented (docs/observability.md): the ``request`` event's fields and NNRP's
        summary members."""
        return {
            "door": self.door, "request_id": self.request_id, "connection_id": self.connection_id,
            "session_id": self.session_id, "operation_id": self.operation_id, "frame_id": self.frame_id,
            "transport": self.transport, "model": self.model, "tenant": self.tenant,
            "operation": self.operation,
            "stream": self.stream, "route": self.route, "status": self.status, "outcome": self.outcome,
            "error_family": self.error_family, "cancel_source": self.cancel_source,
            "cancel_reason": self.cancel_reason, "client_gone": self.client_gone,
            "engine_abort_accepted": self.engine_abort_accepted,
            "queue_delay_ms": _ms(self.queue_delay_s), "render_ms": self.render_ms,
            "first_engine_chunk_ms": _ms(self.since(self.first_engine_chunk)),
            "first_event_ms": _ms(self.since(self.first_event)), "output_events": self.output_events,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "e2e_ms": _ms(self.e2e_s),
        }


current: contextvars.ContextVar[Record | None] = contextvars.ContextVar("coordinator_record", default=None)


def on_engine_abort(answer: asyncio.Future[bool]) -> None:
    """Called by the engine client for every abort it sends: the current request's record learns it."""
    record = current.get()
    if record is not None:
        record.abort_sent(answer)


def note_queue_delay(waited_s: float) -> None:
    """Called where admission granted an engine request (in the request's own task)."""
    record = current.get()
    if record is not None:
        record.queued(waited_s)


class RequestCollectors(Protocol):
    """The request-level collectors ``Observer`` feeds (``Metrics`` has them)."""

    def request_finished(self, record: Record) -> None: ...

    def inter_event(self, record: Record, gap_s: float) -> None: ...


@dataclass
class Observer:
    """The sink of finished records: one ``request`` log event each, and the request-level metrics."""

    metrics: RequestCollectors | None = None
    records: list[Record] | None = None  # keeps finished records when a list is given (tests)

    def start(self, door: Door, **fields: Any) -> Record:
        return Record(door=door, sink=self, **fields)

    def finished(self, record: Record) -> None:
        fields = record.to_dict()
        rid = fields.pop("request_id") or "-"
        failed = record.outcome == "error" and (record.status or 500) >= 500
        level = logging.WARNING if failed else logging.INFO
        event(log, "request", rid, level=level, **fields)
        if self.metrics is not None:
            self.metrics.request_finished(record)
        if self.records is not None:
            self.records.append(record)

    def inter_event(self, record: Record, gap_s: float) -> None:
        if self.metrics is not None and record.stream:
            self.metrics.inter_event(record, gap_s)
