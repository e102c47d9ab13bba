"""One NNRP v1 session: the state machine between a message transport and the request runner.

It knows no web framework: a ``Transport`` moves whole messages (the FastAPI route adapts a
WebSocket to it; unit tests use a queue), and a ``Runner`` is ``Pipeline.serve``. Per session:

* hello (encoding pick) → open (API key, profile, schema version) → operations → close;
* each submit becomes an operation with its own task that pulls the pipeline's chunk stream, maps it
  with the profile's ``ChatStreamMapper`` (``responses.create``: the Responses events of
  ``nnrp/responses.py``) and pushes ``result`` frames with consecutive ``seq``; ``models.list`` is
  answered from the model catalog in one frame;
* credits: a non-terminal event waits for one; with none left the task stops pulling the stream, so
  the pipeline's bounded queue fills and the engine read stops instead of the session buffering;
* cancel (frame, ``policy.timeout_ms``, session end): the mapper is terminated synchronously, so no
  later event can pass ``_emit``, then ``response.cancelled`` goes out and the task is cancelled,
  which closes the served stream (that aborts the engine request) without waiting for the engine;
* a bad frame gets an error frame; only an unauthorized open and an idle session are closed.

All sends go through one lock: a client that stops reading slows the session's own reads too, so
nothing here queues without bound (``docs/nnrp.md``, "Wire protocol v1").

One job, one file, though a long one: the states, credits, cancels and the send lock above share
one session's state, and each transition reads the others. What stands alone lives in the profile
package (``nnrp/profile/``: frames, events, the mapping of chunks) and ``nnrp/responses.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from coordinator.config import NnrpSettings
from coordinator.nnrp import frames as F
from coordinator.nnrp.profile import (
    COMPLETED,
    MODELS_LIST,
    PROFILE,
    RESPONSES_CREATE,
    SCHEMA_VERSION,
    TERMINAL_EVENT_TYPES,
    ChatStreamMapper,
    Envelope,
    Manifest,
    ProfileError,
    error_event,
    map_chat_completion,
    parse_envelope,
)
from coordinator.nnrp.responses import ResponsesStreamMapper, map_models, map_native_response, map_response
from coordinator.observability.record import Observer, Record
from coordinator.pipeline.admission.tenants import ANONYMOUS, Tenant
from coordinator.pipeline.chat_form import ConversionUnavailable
from coordinator.pipeline.context import ChunkStream, Kind, NativeCall, RequestContext
from coordinator.pipeline.errors import BadRequest, ClientGone, PipelineError
from coordinator.pipeline.responses.chain import Opened
from coordinator.pipeline.responses.convert import ResponsesForm
from coordinator.pipeline.responses.translate import in_responses_terms

log = logging.getLogger(__name__)
ModelLister = Callable[[Callable[[str], bool]], Mapping[str, Any]]
"""The model list for a session (its tenant may be held to some adapters: ``Tenant.may_use``)."""
Gone = Callable[[], Awaitable[None]]
_RECENT = 1024  # finished operation ids remembered, so a late credit or cancel is not an error
_FLUSH_S = 2.0  # longest wait for the last frames when a session ends
_ABORT_ANSWER_S = 5.0  # longest wait for the engine's answer to an abort before a summary goes out


class Transport(Protocol):
    """Whole messages: ``str`` is a text message, ``bytes`` a binary one, None: the peer is gone."""

    async def receive(self) -> str | bytes | None: ...

    async def send(self, data: str | bytes) -> None: ...

    async def close(self, code: int, reason: str = "") -> None: ...


class ServedLike(Protocol):
    """What the session reads of ``Served``: a JSON response or a chunk stream, then ``aclose``;
    ``ctx``, the served request, for a Responses answer (it echoes the request's id and budget)."""

    @property
    def ctx(self) -> RequestContext: ...

    @property
    def response(self) -> dict[str, Any] | None: ...

    @property
    def stream(self) -> ChunkStream | None: ...

    async def aclose(self) -> None: ...


class Runner(Protocol):
    """``Pipeline.serve``: the one request runner of every door."""

    async def serve(self, kind: Kind, body: Any, request_id: str, *, priority: int | None = None,
                    gone: Gone | None = None, record: Record | None = None,
                    operation: str | None = None, tenant: Tenant = ANONYMOUS,
                    native: NativeCall | None = None) -> ServedLike: ...


class ResponsesForms(Protocol):
    """``ResponsesIntake``: a ``/v1/responses`` body → the chat form the pipeline serves (read against
    the response store), and the finished answer → the store."""

    async def open(self, body: Any, request_id: str, tenant: str) -> Opened: ...

    async def keep(self, opened: Opened, response: dict[str, Any]) -> None: ...


class Mapper(Protocol):
    """An operation's events from its output, with the one-terminal-event rule (``EventMapper``)."""

    terminated: bool

    def map_chunk(self, chunk: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]: ...

    def flush(self) -> Sequence[Mapping[str, Any]]: ...

    def complete(self) -> Mapping[str, Any] | None: ...

    def fail(self, detail: Mapping[str, Any], status: int | None = None) -> Mapping[str, Any] | None: ...

    def cancel(self, source: str, reason: str, *, operation_id: str | None = None,
               engine_abort_accepted: bool | None = None) -> Mapping[str, Any] | None: ...


@dataclass(eq=False)
class Operation:
    id: str
    request_id: str
    envelope: Envelope
    credits: int
    mapper: Mapper
    record: Record
    seq: int = 0
    closed: bool = False  # the terminal event went out (or could not)
    releasing: bool = False  # in the task's finally: it must not be cancelled again
    task: asyncio.Task[None] | None = None
    timer: asyncio.TimerHandle | None = None
    credit_ready: asyncio.Event = field(default_factory=asyncio.Event)
    started: float = field(default_factory=time.monotonic)
    first_event: float | None = None
    outcome: str | None = None
    cancel_source: str | None = None
    cancel_reason: str | None = None

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        return {"operation_id": self.id, "request_id": self.request_id, "operation": self.envelope.operation,
                "model": self.envelope.body.get("model"), "stream": self.envelope.stream,
                "state": self.outcome or "open", "events": self.seq, "credits": self.credits,
                "elapsed_ms": round((now - self.started) * 1000, 2),
                "first_event_ms": (round((self.first_event - self.started) * 1000, 2)
                                   if self.first_event is not None else None),
                "cancel_source": self.cancel_source, "cancel_reason": self.cancel_reason}


class Session:
    """Run with ``await Session(...).run()``; returns when the session is over and every operation
    it started has released what it held.

    ``models``: the model list ``models.list`` answers; ``responses``: the conversion
    ``responses.create`` needs. A manifest declaring either operation needs it (checked here, so a
    declared operation can never fail for want of its means)."""

    def __init__(self, transport: Transport, runner: Runner, settings: NnrpSettings, manifest: Manifest,
                 auth: Callable[[str | None], Tenant], *, authorization: str | None = None,
                 session_id: str | None = None, observer: Observer | None = None,
                 connection_id: str | None = None, models: ModelLister | None = None,
                 responses: ResponsesForms | None = None) -> None:
        for name, means in ((MODELS_LIST, models), (RESPONSES_CREATE, responses)):
            if manifest.operation(name) is not None and means is None:
                raise ValueError(f"the manifest declares {name} but the session was given nothing to run it")
        self._t = transport
        self._runner = runner
        self._models = models
        self._responses = responses
        self._settings = settings
        self._manifest = manifest
        self._manifest_doc = manifest.to_dict()
        self._auth = auth
        self._header_auth = authorization
        self.tenant = ANONYMOUS  # the key's tenant, once open
        self.id = session_id or uuid.uuid4().hex[:16]
        self._observer = observer  # where each operation's observation record goes
        self._connection_id = connection_id
        self.encoding: str | None = None  # chosen by hello
        self.opened = False
        self._ops: dict[str, Operation] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._recent: deque[str] = deque(maxlen=_RECENT)
        self._recent_set: set[str] = set()
        self._lock = asyncio.Lock()
        self._alive = True  # the transport still takes frames
        self._ending = False
        self._close_code = F.CLOSE_NORMAL
        self._close_reason = ""
        self._going_away = False  # the server drains: no new operations, close 1001 when none is open
        self._away = asyncio.Event()  # ends run(): going away with no operation open (or now)
        self._last_rx = time.monotonic()
        self._counter = 0
        self.frames_received = 0
        self.errors_sent = 0

    @property
    def open_operations(self) -> int:
        return len(self._ops)

    @property
    def running_tasks(self) -> int:
        return sum(1 for t in self._tasks if not t.done())

    def go_away(self, reason: str, *, now: bool = False) -> None:
        """Server shutdown: refuse new operations and close with 1001 once the open ones are done, or
        at once (``now``), cancelling them with source ``server`` (docs/shutdown.md)."""
        if not self._going_away:
            self._going_away = True
            self._close_code, self._close_reason = F.CLOSE_GOING_AWAY, reason
        if now or not self._ops:
            self._away.set()

    # -- main loop ---------------------------------------------------------------------------------
    async def run(self) -> None:
        reader = asyncio.create_task(self._read())
        beat = asyncio.create_task(self._beat())
        away = asyncio.create_task(self._away.wait())
        try:
            await asyncio.wait({reader, beat, away}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (reader, beat, away):
                t.cancel()
            await asyncio.gather(reader, beat, away, return_exceptions=True)
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                log.error("nnrp session %s failed", self.id, exc_info=reader.exception())
                self._close_code, self._close_reason = F.CLOSE_INTERNAL, "internal error"
            await self._end()

    async def _read(self) -> None:
        while not self._ending:
            data = await self._t.receive()
            if data is None:
                self._alive = False
                self._close_reason = "connection closed"
                return
            self._last_rx = time.monotonic()
            self.frames_received += 1
            try:
                await self._on_message(data)
            except F.FrameError as exc:
                await self._error(exc)

    async def _beat(self) -> None:
        """Idle timeout (no frame from the client) and the server's ping frames."""
        idle, every = self._settings.idle_timeout_s, self._settings.heartbeat_s
        tick = min(1.0, every, idle / 4)
        last_ping = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if now - self._last_rx >= idle:
                self._close_code, self._close_reason = F.CLOSE_IDLE, "idle timeout"
                return
            if self.encoding is not None and now - last_ping >= every:
                last_ping = now
                await self._send(F.ping(int(now * 1000)))

    async def _end(self) -> None:
        """Cancel every open operation (telling the client when it can still hear), release all,
        then close the transport with the session's close code."""
        self._ending = True
        reason = self._close_reason or "session closed"
        source = "server" if self._going_away and self._alive else "session"
        try:
            async with asyncio.timeout(_FLUSH_S):
                for op in list(self._ops.values()):
                    await self._cancel(op, source, reason)
                if self._tasks:  # terminal events already on their way, and the releases
                    await asyncio.wait(set(self._tasks))
        except TimeoutError:
            self._alive = False
        for op in list(self._ops.values()):  # a peer that does not read: end them without a word
            self._cancel_now(op, source, reason, force=True)
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._t.close(self._close_code, self._close_reason[:120])

    # -- frames ------------------------------------------------------------------------------------
    async def _on_message(self, data: str | bytes) -> None:
        frame = F.decode(data, max_bytes=self._settings.max_frame_bytes)
        kind = F.frame_type(frame)
        if isinstance(frame, F.Ping):
            await self._send(F.pong(frame.nonce), force_json=self.encoding is None)
            return
        if isinstance(frame, F.Pong):
            return
        if isinstance(frame, F.Hello):
            return await self._on_hello(frame)
        if isinstance(frame, F.Close):
            self._close_code, self._close_reason = F.CLOSE_NORMAL, frame.reason or "closed by client"
            self._ending = True
            return
        if self.encoding is None:
            raise F.FrameError(F.UNEXPECTED_FRAME, f"'{kind}' before hello", frame_type=kind)
        if isinstance(frame, F.Open):
            return await self._on_open(frame)
        if not self.opened:
            raise F.FrameError(F.UNEXPECTED_FRAME, f"'{kind}' before open", frame_type=kind,
                               op=getattr(frame, "op", None))
        if isinstance(frame, F.Submit):
            await self._on_submit(frame)
        elif isinstance(frame, F.Cancel):
            op = self._operation(frame.op, kind)
            if op is not None:
                await self._cancel(op, "client", frame.reason)
        elif isinstance(frame, F.Credit):
            op = self._operation(frame.op, kind)
            if op is not None:
                op.credits = min(F.MAX_CREDITS, op.credits + frame.credits)
                op.credit_ready.set()
        elif isinstance(frame, F.DiagnosticsRequest):
            await self._on_diagnostics(frame)

    async def _on_hello(self, frame: F.Hello) -> None:
        if self.encoding is not None:
            raise F.FrameError(F.UNEXPECTED_FRAME, "hello was already received", frame_type="hello")
        if F.VERSION not in frame.versions:
            raise F.FrameError(F.UNSUPPORTED_VERSION, f"this server speaks NNRP version {F.VERSION}",
                               frame_type="hello")
        encoding = F.pick_encoding(frame.encodings)
        if encoding is None:
            raise F.FrameError(F.NO_COMMON_ENCODING, f"encodings must include one of {list(F.ENCODINGS)}",
                               frame_type="hello")
        s = self._settings
        # The welcome is JSON text whatever was picked: the client learns the encoding from it.
        welcome = F.welcome(self.id, encoding, heartbeat_s=s.heartbeat_s, idle_timeout_s=s.idle_timeout_s,
                            max_frame_bytes=s.max_frame_bytes, initial_credits=s.initial_credits,
                            max_operations=s.max_operations)
        await self._send(welcome, force_json=True)
        self.encoding = encoding

    async def _on_open(self, frame: F.Open) -> None:
        if self.opened:
            raise F.FrameError(F.UNEXPECTED_FRAME, "the session is already open", frame_type="open")
        if frame.profile not in (None, PROFILE) or frame.schema_version != SCHEMA_VERSION:
            raise F.FrameError(F.UNSUPPORTED_SCHEMA_VERSION, f"this server speaks profile {PROFILE!r}, "
                               f"schema_version {SCHEMA_VERSION!r}", frame_type="open")
        try:
            self.tenant = self._auth(frame.authorization if frame.authorization is not None
                                     else self._header_auth)
        except PipelineError as exc:
            await self._error(F.FrameError(F.UNAUTHORIZED, exc.message, frame_type="open"))
            self._close_code, self._close_reason = F.CLOSE_UNAUTHORIZED, "unauthorized"
            self._ending = True
            return
        self.opened = True
        await self._send(F.opened(self.id, self._manifest_doc))

    async def _on_submit(self, frame: F.Submit) -> None:
        if frame.op in self._ops:
            raise F.FrameError(F.DUPLICATE_OPERATION, f"operation {frame.op!r} is open in this session",
                               op=frame.op, frame_type="submit")
        if self._going_away:  # a retryable refusal: the client submits again on a new session
            self._remember(frame.op)
            await self._send(F.result(frame.op, 0, error_event(
                {"message": f"{self._close_reason}; submit on a new session",
                 "type": "ServiceUnavailableError", "param": None, "code": 503})))
            return
        if len(self._ops) >= self._settings.max_operations:
            raise F.FrameError(F.TOO_MANY_OPERATIONS, f"{self._settings.max_operations} operations are "
                               "open in this session", op=frame.op, frame_type="submit")
        self._counter += 1
        request_id = f"nnrp-{self.id}-{self._counter}"
        record = self._observer.start("nnrp") if self._observer is not None else Record("nnrp")
        record.request_id, record.session_id, record.operation_id = request_id, self.id, frame.op
        record.frame_id, record.connection_id = self.frames_received, self._connection_id
        record.transport = f"websocket/{self.encoding}"
        try:
            envelope = parse_envelope(frame.envelope, self._manifest)
        except ProfileError as exc:  # the operation's one event: response.error (seq 0)
            self._remember(frame.op)
            await self._send(F.result(frame.op, 0, exc.event()))
            record.output_event()
            record.failed(type(exc).__name__, exc.status)
            record.finish()
            return
        record.operation = envelope.operation
        credits = self._settings.initial_credits if frame.credits is None else frame.credits
        mapper: Mapper = (ResponsesStreamMapper() if envelope.operation == RESPONSES_CREATE
                          else ChatStreamMapper(include_openai_chunk=envelope.include_openai_chunk))
        op = Operation(frame.op, request_id, envelope, credits, mapper, record)
        self._ops[op.id] = op
        op.task = self._spawn(self._pump(op))
        op.task.add_done_callback(lambda _: record.finish())  # even a task cancelled before it ran
        timeout = envelope.policy.timeout_ms
        if timeout is not None:
            why = f"timeout_ms {timeout} passed"
            op.timer = asyncio.get_running_loop().call_later(
                timeout / 1000, lambda: self._spawn(self._cancel(op, "timeout", why)))

    async def _on_diagnostics(self, frame: F.DiagnosticsRequest) -> None:
        if frame.op is None:
            record = {"session_id": self.id, "encoding": self.encoding, "open_operations": sorted(self._ops),
                      "operations": self._counter, "frames_received": self.frames_received,
                      "errors_sent": self.errors_sent}
            await self._send(F.diagnostics("snapshot", record))
            return
        op = self._ops.get(frame.op)
        if op is None:
            raise F.FrameError(F.UNKNOWN_OPERATION, f"no open operation {frame.op!r}", op=frame.op,
                               frame_type="diagnostics")
        await self._send(F.diagnostics("snapshot", op.snapshot(), op=op.id))

    def _operation(self, op_id: str, kind: str) -> Operation | None:
        """The open operation; None (ignored) for one that ended lately; an error for any other id."""
        op = self._ops.get(op_id)
        if op is None and op_id not in self._recent_set:
            raise F.FrameError(F.UNKNOWN_OPERATION, f"no open operation {op_id!r}", op=op_id, frame_type=kind)
        return op

    def _remember(self, op_id: str) -> None:
        if len(self._recent) == self._recent.maxlen:
            self._recent_set.discard(self._recent[0])
        self._recent.append(op_id)
        self._recent_set.add(op_id)

    # -- operations --------------------------------------------------------------------------------
    def _spawn(self, work: Awaitable[None]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _pump(self, op: Operation) -> None:
        """Run the operation through the pipeline and push its events; release whatever happens."""
        served: ServedLike | None = None
        operation = op.envelope.operation
        try:
            # A declared operation has its means (checked in __init__); parse_envelope refused the rest.
            if operation == MODELS_LIST:
                assert self._models is not None
                await self._whole(op, map_models(self._models(self.tenant.may_use)))
                return
            body = op.envelope.body
            form: ResponsesForm | None = None
            opened: Opened | None = None
            native: NativeCall | None = None
            if operation == RESPONSES_CREATE:
                assert self._responses is not None
                # The sidecar's conversion, as the HTTP door does it; from here it is a chat request,
                # or, when the sidecar cannot convert it, the engines' own route (the native chain).
                try:
                    opened = await self._responses.open(body, op.request_id, self.tenant.name)
                    if opened.turn.background:
                        raise BadRequest("background runs are not served over NNRP (an operation is the "
                                         "run); use POST /v1/responses", param="background")
                    form, body = opened.form, opened.form.chat
                except ConversionUnavailable as exc:
                    native = exc.call
            if op.envelope.policy.cache == "isolated" and "cache_salt" not in body:
                body = {**body, "cache_salt": secrets.token_hex(16)}  # shares no cached prefix
            served = await self._runner.serve("chat", body, op.request_id, record=op.record,
                                              operation=operation, tenant=self.tenant, native=native)
            if served.stream is None:
                response = served.response or {}
                events = (map_native_response(response) if native is not None
                          else map_chat_completion(response) if form is None
                          else map_response(form, response, served.ctx))
                await self._whole(op, await self._kept(opened, events))
                return
            if isinstance(op.mapper, ResponsesStreamMapper):
                if native is not None:
                    op.mapper.native()
                elif form is not None:
                    for opening in op.mapper.start(form, served.ctx):
                        await self._emit(op, dict(opening))
            chunks = served.stream.events()
            try:
                while not op.mapper.terminated:
                    await self._wait_credit(op)  # no credit: the stream is not pulled
                    try:
                        chunk = await anext(chunks)
                    except StopAsyncIteration:
                        break
                    for event in op.mapper.map_chunk(chunk):
                        await self._emit(op, dict(event))
            finally:
                closer = getattr(chunks, "aclose", None)
                if closer is not None:
                    with contextlib.suppress(Exception):
                        await closer()
            for owed in op.mapper.flush():
                await self._emit(op, dict(owed))
            done = op.mapper.complete()
            if done is not None:
                await self._emit(op, dict((await self._kept(opened, [done]))[0]))
        except PipelineError as exc:
            if operation == RESPONSES_CREATE:
                exc = in_responses_terms(exc)  # name the field the client wrote, as the HTTP door does
            failed = op.mapper.fail(exc.body()["error"], exc.status)
            if failed is not None:
                await self._emit(op, dict(failed))
        except ClientGone:
            pass
        except Exception:
            log.exception("nnrp operation %s (%s) failed", op.id, op.request_id)
            failed = op.mapper.fail({"message": "Internal server error", "type": "InternalServerError",
                                     "code": 500}, 500)
            if failed is not None:
                await self._emit(op, dict(failed))
        finally:
            op.releasing = True
            if served is not None:
                await served.aclose()  # aborts the engine request when it is still running
            self._finished(op)
            op.record.finish()
            if op.envelope.policy.diagnostics == "summary" and not self._ending:
                # The summary carries the finished observation record, with the engine's answer to
                # an abort (it went out after response.cancelled, which never waits for it).
                await op.record.delivered(_ABORT_ANSWER_S)
                record = {**op.record.to_dict(), **op.snapshot(), "released": True,
                          "transport": f"websocket/{self.encoding}"}
                with contextlib.suppress(Exception):
                    await self._send(F.diagnostics("summary", record, op=op.id))

    async def _kept(self, opened: Opened | None,
                    events: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
        """Store a stored Responses turn's answer (``response.completed``'s) before it goes out, so a
        client that chains on that event finds it, as over HTTP."""
        if opened is not None and opened.turn.kept and self._responses is not None:
            for event in events:
                if event.get("type") == COMPLETED and isinstance(event.get("response"), dict):
                    await self._responses.keep(opened, event["response"])
        return events

    async def _whole(self, op: Operation, events: Sequence[Mapping[str, Any]]) -> None:
        """A result mapped at once (non-streaming): its events, unless a cancel already ended it."""
        for event in events:
            if event["type"] in TERMINAL_EVENT_TYPES:
                if op.mapper.terminated:
                    return
                op.mapper.terminated = True
            await self._emit(op, dict(event))

    async def _wait_credit(self, op: Operation) -> None:
        while op.credits <= 0:
            op.credit_ready.clear()
            await op.credit_ready.wait()

    async def _emit(self, op: Operation, event: dict[str, Any]) -> None:
        """Push one event as the operation's next result frame. A non-terminal one needs a credit and
        is dropped once the operation was terminated (cancel); a terminal one never waits."""
        terminal = event["type"] in TERMINAL_EVENT_TYPES
        if not terminal:
            await self._wait_credit(op)
        async with self._lock:
            if op.closed or (not terminal and op.mapper.terminated):
                return
            if terminal:
                op.closed = True
                op.outcome = event["type"].removeprefix("response.")
                self._close_op(op)
                if op.outcome == "completed":
                    op.record.complete()
                elif op.outcome == "error":
                    op.record.failed(str(event["error"].get("type") or "Error"), int(event["status"]))
            else:
                op.credits -= 1
            seq, op.seq = op.seq, op.seq + 1
            if op.first_event is None:
                op.first_event = time.monotonic()
            await self._write(F.result(op.id, seq, event))
            op.record.output_event()

    async def _cancel(self, op: Operation, source: str, reason: str) -> None:
        """Stop the operation's events now, send ``response.cancelled``, abort its engine request."""
        event = self._cancel_now(op, source, reason)
        if event is not None:
            await self._emit(op, event)

    def _cancel_now(self, op: Operation, source: str, reason: str, *,
                    force: bool = False) -> dict[str, Any] | None:
        """The cancelled event, or None when another terminal event is already on its way (it is
        then left to go out, unless ``force``: the session ends and nobody reads)."""
        # The engine's answer to the abort is known only if an abort was already answered: the event
        # never waits for it (the summary diagnostics carry the answer once it came).
        event = op.mapper.cancel(source, reason, operation_id=op.id,
                                 engine_abort_accepted=op.record.abort_answer())
        if event is None and not force:
            return None
        if source == "session" and not self._alive:
            op.record.gone(source, reason)  # the connection went away
        else:
            op.record.cancel(source, reason)
        if op.task is not None and not op.releasing and op.task is not asyncio.current_task():
            op.task.cancel()  # its finally closes the served stream; a release is never interrupted
        if event is None:
            if not op.closed:
                op.closed = True
                self._close_op(op)
            return None
        op.cancel_source, op.cancel_reason = source, reason
        return dict(event)

    def _close_op(self, op: Operation) -> None:
        if op.timer is not None:
            op.timer.cancel()
        if self._ops.get(op.id) is op:
            del self._ops[op.id]
            self._remember(op.id)
        op.credit_ready.set()
        if self._going_away and not self._ops:
            self._away.set()

    def _finished(self, op: Operation) -> None:
        if not op.closed:  # ended without a terminal event (session teardown): nothing more to send
            op.closed = True
            self._close_op(op)

    # -- sending -----------------------------------------------------------------------------------
    async def _send(self, frame: dict[str, Any], *, force_json: bool = False) -> None:
        async with self._lock:
            await self._write(frame, force_json=force_json)

    async def _write(self, frame: dict[str, Any], *, force_json: bool = False) -> None:
        """Under the lock. A failed send means the peer is gone: later frames are dropped."""
        if not self._alive:
            return
        data = F.encode(frame, "json" if force_json or self.encoding is None else self.encoding)
        try:
            await self._t.send(data)
        except Exception:
            self._alive = False

    async def _error(self, exc: F.FrameError) -> None:
        self.errors_sent += 1
        await self._send(exc.frame(), force_json=self.encoding is None)
