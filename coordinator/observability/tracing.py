"""OpenTelemetry spans for each stage of a request (the optional extra ``tracing``; off by default).

Shape (docs/tracing.md): one server span per request, whichever door it came through, and one child
span per stage: ``render``, ``admission``, ``scheduling``, ``engine.<role>`` (each engine leg: union,
prefill, decode, native; a retry or a relay adds its own admission, scheduling and leg),
``derender`` (one per prompt stream, not per call) and ``write``. The W3C ``traceparent`` a client
sends is continued, and ``traceparent``/``tracestate`` go to the render sidecar and the engines on
every call, parented by the stage span making the call, so vLLM's own spans join the trace.

Why it hangs on the observation record: every door already starts a ``Record`` through the pipeline's
``Observer`` and finishes it exactly once, and deep stages already find it through
``record.current``. ``TracingObserver`` starts the request span with the record and ends it with the
record (or, over HTTP, once the response is sent, see ``TraceContextMiddleware``), so no door needs
code of its own, and the record's fields become the span's attributes.

Why it costs nothing when off: OpenTelemetry is imported only when tracing is enabled (the
coordinator runs without the extra); no middleware is installed; every hook first reads one module
flag, and none runs per token (the derender span is per prompt stream, the write span is built at the
end from the record's first/last event times).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, MutableMapping
from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import urlsplit

from coordinator.observability.record import Door, Observer, Record, RequestCollectors, current

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, SpanKind, Status, Tracer
    from opentelemetry.trace import TracerProvider as ApiTracerProvider
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from coordinator.config import TracingSettings

Kind = Literal["server", "client", "internal"]
Attributes = dict[str, str | int | float | bool]
P = TypeVar("P")

INSTALL_HINT = "pip install 'llm-coordinator[tracing]'"
# gen_ai.operation.name (OpenTelemetry GenAI conventions) of the coordinator's operations.
GEN_AI_OPERATIONS = {"chat.completions.create": "chat", "completions.create": "text_completion",
                     "messages.create": "chat"}
HTTP_PATHS = {"chat.completions.create": "/v1/chat/completions", "completions.create": "/v1/completions"}

SHUTDOWN_WAIT_S = 3.0  # the longest shutdown waits for batched spans to reach the collector
_enabled = False  # set once any coordinator in this process traces: the off path is this one read
_NOOP: AbstractContextManager[None] = contextlib.nullcontext()


class TracingUnavailable(RuntimeError):
    """``tracing.enabled`` is set but OpenTelemetry is not installed: the coordinator must not start
    silently untraced."""


# -- setup ----------------------------------------------------------------------------------------
def build_provider(settings: TracingSettings) -> TracerProvider:
    """A TracerProvider as configured: parent-based ratio sampler, ``service.name``, a batch processor
    with the OTLP/HTTP or console exporter. Not installed as the global provider, so several
    coordinators (tests, embedders) can run in one process with their own."""
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as exc:
        raise TracingUnavailable(f"tracing.enabled is set but OpenTelemetry is not installed: {INSTALL_HINT}"
                                 ) from exc
    exporter: SpanExporter
    if settings.exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise TracingUnavailable("tracing.exporter is otlp but opentelemetry-exporter-otlp-proto-http "
                                     f"is not installed: {INSTALL_HINT}") from exc
        exporter = OTLPSpanExporter(endpoint=settings.endpoint)
    else:
        exporter = ConsoleSpanExporter()
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: settings.service_name}),
                              sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def build_observer(settings: TracingSettings, metrics: RequestCollectors | None = None,
                   provider: ApiTracerProvider | None = None) -> Observer:
    """The pipeline's observer: a plain ``Observer`` when tracing is off, else a ``TracingObserver``.

    ``provider``: an OpenTelemetry ``TracerProvider`` the embedding application (or a test, e.g. with
    an in-memory exporter) owns; it turns tracing on whatever ``settings.enabled`` says, and is
    never shut down here. Without one and with ``settings.enabled``, one is built from the settings
    and shut down by ``TracingObserver.shutdown``."""
    if provider is None and not settings.enabled:
        return Observer(metrics)
    owned: TracerProvider | None = None
    if provider is None:
        provider = owned = build_provider(settings)
    return TracingObserver(metrics, tracer=provider.get_tracer("llm-coordinator"), otel=_Otel(),
                           provider=owned)


class _Otel:
    """The OpenTelemetry names this module uses, imported when tracing is on (never at import time)."""

    def __init__(self) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.context import Context
            from opentelemetry.trace import SpanKind, Status, StatusCode
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise TracingUnavailable(f"tracing is on but OpenTelemetry is not installed: {INSTALL_HINT}"
                                     ) from exc
        self._trace = trace
        self._status, self._error = Status, StatusCode.ERROR
        self.empty = Context
        self.kinds: dict[Kind, SpanKind] = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT,
                                            "internal": SpanKind.INTERNAL}
        # W3C trace context only (traceparent, tracestate), what vLLM and llm-d read; explicit so that
        # an OTEL_PROPAGATORS setting meant for something else cannot change what the engines get.
        self.propagator: TraceContextTextMapPropagator = TraceContextTextMapPropagator()

    def error(self, text: str) -> Status:
        return self._status(self._error, text)

    def in_context(self, span: Span) -> Context:
        return self._trace.set_span_in_context(span)

    def current_span(self) -> Span:
        return self._trace.get_current_span()

    def use(self, span: Span) -> AbstractContextManager[Span]:
        return self._trace.use_span(span, end_on_exit=False)


# -- the observer ------------------------------------------------------------------------------------
@dataclass
class TracingObserver(Observer):
    """An ``Observer`` that also opens a request span for every record it starts and ends it with the
    record: the doors and the pipeline stay as they are."""

    tracer: Tracer | None = None
    otel: _Otel | None = None
    provider: TracerProvider | None = None  # built from the settings: shut down with the coordinator
    traces: dict[Record, RequestTrace] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        global _enabled
        _enabled = True

    def start(self, door: Door, **fields: Any) -> Record:
        record = super().start(door, **fields)
        assert self.tracer is not None and self.otel is not None
        arrival = _arrival.get()
        asgi = arrival is not None and arrival.http and arrival.trace is None and door == "http"
        if arrival is not None and asgi:
            parent: Context | None = arrival.parent or self.otel.empty()
            start_ns, name = arrival.start_ns, arrival.name
            attributes: Attributes = dict(arrival.attributes)
        else:
            # NNRP: the WebSocket upgrade's traceparent, if any; a direct Pipeline.serve continues
            # whatever span its caller has open.
            parent = (arrival.parent or self.otel.empty()) if arrival is not None else None
            start_ns, name, attributes = time.time_ns(), record.operation or "request", {}
        attributes["coordinator.door"] = door
        if record.request_id:
            attributes["coordinator.request_id"] = record.request_id
        span = self.tracer.start_span(name, context=parent, kind=self.otel.kinds["server"],
                                      attributes=attributes, start_time=start_ns)
        trace = RequestTrace(self, record, span, asgi=asgi)
        self.traces[record] = trace
        if arrival is not None and asgi:
            arrival.trace = trace
        return record

    def finished(self, record: Record) -> None:
        super().finished(record)
        trace = self.traces.get(record)
        if trace is not None and not trace.asgi:
            trace.end(trace.wall(record.ended))

    def shutdown(self) -> None:
        """Flush and stop the provider built from the settings (blocking: run it off the loop), for at
        most ``SHUTDOWN_WAIT_S``: an unreachable collector makes the exporter retry for seconds, and
        must not hold up the coordinator's exit (what is left is dropped)."""
        if self.provider is not None:
            flush = threading.Thread(target=self.provider.shutdown, name="tracing-shutdown", daemon=True)
            flush.start()
            flush.join(SHUTDOWN_WAIT_S)


class RequestTrace:
    """One request's span and what its stage spans need (parent context, clock, propagation)."""

    def __init__(self, observer: TracingObserver, record: Record, span: Span, *, asgi: bool) -> None:
        assert observer.tracer is not None and observer.otel is not None
        self.observer = observer
        self.tracer: Tracer = observer.tracer
        self.otel: _Otel = observer.otel
        self.record = record
        self.span = span
        self.context = self.otel.in_context(span)
        self.trace_id = span.get_span_context().trace_id
        self.asgi = asgi  # ended by the middleware once the response is sent, not by the record
        self.ended = False
        self._mono, self._wall = time.monotonic(), time.time_ns()

    def wall(self, monotonic: float | None) -> int:
        """A ``time.monotonic()`` reading (the record's clock) as epoch nanoseconds (the span clock)."""
        if monotonic is None:
            return time.time_ns()
        return self._wall + int((monotonic - self._mono) * 1e9)

    def stage(self, name: str, kind: Kind, attributes: Attributes | None) -> AbstractContextManager[Span]:
        return self.tracer.start_as_current_span(name, context=self.context, kind=self.otel.kinds[kind],
                                                 attributes=attributes)

    def start(self, name: str, kind: Kind, attributes: Attributes | None,
              start_ns: int | None = None) -> Span:
        return self.tracer.start_span(name, context=self.context, kind=self.otel.kinds[kind],
                                      attributes=attributes, start_time=start_ns)

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """``traceparent``/``tracestate`` of the stage span making the call (the request span when the
        call is made outside one)."""
        ctx = self.otel.current_span().get_span_context()
        self.otel.propagator.inject(headers, context=None if ctx.trace_id == self.trace_id else self.context)

    def end(self, end_ns: int | None = None) -> None:
        """Close the request span with what the record learned, and the write span (from the record's
        first and last event: no per-chunk work)."""
        if self.ended:
            return
        self.ended = True
        self.observer.traces.pop(self.record, None)
        end_ns = end_ns if end_ns is not None else time.time_ns()
        r, span = self.record, self.span
        if r.first_event is not None:
            last = end_ns if self.asgi else min(end_ns, self.wall(r.last_event))
            write = self.start("write", "internal", _drop_none({
                "coordinator.output.events": r.output_events, "coordinator.transport": r.transport}),
                self.wall(r.first_event))
            write.end(end_time=max(last, self.wall(r.first_event)))
        if not self.asgi:
            operation = r.operation or "request"
            span.update_name(f"nnrp {operation}" if r.door == "nnrp" else operation)
        span.set_attributes(_drop_none({
            "coordinator.request_id": r.request_id,
            "gen_ai.operation.name": GEN_AI_OPERATIONS.get(r.operation or ""),
            "gen_ai.request.model": r.model,
            "gen_ai.usage.input_tokens": r.prompt_tokens,
            "gen_ai.usage.output_tokens": r.completion_tokens,
            "http.response.status_code": r.status,
            "coordinator.outcome": r.outcome,
            "coordinator.stream": r.stream,
            "coordinator.route": r.route,
            "coordinator.transport": r.transport,
            "coordinator.session_id": r.session_id,
            "coordinator.operation_id": r.operation_id,
            "coordinator.cancel_source": r.cancel_source,
            "error.type": r.error_family,
        }))
        if r.outcome == "error" and (r.status or 500) >= 500:
            span.set_status(self.otel.error(r.error_family or "error"))
        span.end(end_time=end_ns)


def _drop_none(values: dict[str, str | int | float | bool | None]) -> Attributes:
    return {k: v for k, v in values.items() if v is not None}


def _trace(record: Record | None) -> RequestTrace | None:
    """The request's trace: the given record's, else the current request's (``record.current``)."""
    if not _enabled:
        return None
    if record is None:
        record = current.get()
    if record is None:
        return None
    sink = record.sink
    if not isinstance(sink, TracingObserver):
        return None
    return sink.traces.get(record)


# -- what the pipeline calls ---------------------------------------------------------------------------
def stage(name: str, record: Record | None = None, *, kind: Kind = "internal",
          attributes: Attributes | None = None) -> AbstractContextManager[Span | None]:
    """A stage span, a child of the request span, current for the block (so calls made inside carry
    its ``traceparent``); yields None, doing nothing, when the request is not traced."""
    trace = _trace(record)
    if trace is None:
        return _NOOP
    return trace.stage(name, kind, attributes)


def annotate(span: Span | None, attributes: dict[str, str | int | float | bool | None]) -> None:
    """Add what a stage learned by its end (None values are left out)."""
    if span is not None and span.is_recording():
        span.set_attributes(_drop_none(attributes))


def inject(headers: MutableMapping[str, str]) -> None:
    """Add ``traceparent`` (and ``tracestate``) to an outgoing call of a traced request; nothing when
    tracing is off or the call belongs to no traced request (probes, model lists)."""
    trace = _trace(None)
    if trace is not None:
        trace.inject(headers)


def placing(place: Callable[[P], Any]) -> Callable[[P], Any]:
    """``place`` (the scheduler) recording a ``scheduling`` span for the call that placed the request.

    Admission may call ``place`` many times for a waiting request, from whichever task freed capacity;
    the span is parented explicitly (not by the calling task), and only the deciding call (or a
    failing one) gets a span, with the number of calls that found no room as an attribute."""
    trace = _trace(None)
    if trace is None:
        return place
    tried = 0

    def traced(req: P) -> Any:
        nonlocal tried
        started = time.time_ns()
        try:
            placement = place(req)
        except Exception as exc:
            span = trace.start("scheduling", "internal", {"coordinator.scheduling.calls": tried + 1}, started)
            span.record_exception(exc)
            span.set_status(trace.otel.error(type(exc).__name__))
            span.end()
            raise
        tried += 1
        if placement is None:
            return None
        prefill = getattr(placement, "prefill", None)
        span = trace.start("scheduling", "internal", _drop_none({
            "coordinator.engine.url": placement.engine.url,
            "coordinator.engine.prefill_url": prefill.url if prefill is not None else None,
            "coordinator.scheduling.cached_tokens": getattr(placement, "matched_tokens", None),
            "coordinator.scheduling.calls": tried}), started)
        span.end()
        return placement

    return traced


def leg_attributes(role: str, engine_url: str, engine_request_id: str | None = None,
                   **extra: str | int | float | bool | None) -> dict[str, str | int | float | bool | None]:
    """The attributes of one engine leg: the engine (as OpenTelemetry's client conventions name it)
    and the id vLLM gives the request (``gen_ai.request.id`` in vLLM's own spans)."""
    parts = urlsplit(engine_url)
    return {"coordinator.engine.role": role, "coordinator.engine.url": engine_url,
            "server.address": parts.hostname, "server.port": parts.port,
            "gen_ai.request.id": engine_request_id, **extra}


def engine_leg(role: str, engine_url: str, engine_request_id: str | None = None,
               **extra: str | int | float | bool | None) -> AbstractContextManager[Span | None]:
    """A non-streaming engine leg (``engine.<role>``), current for the call."""
    if not _enabled:
        return _NOOP
    return stage(f"engine.{role}", kind="client",
                 attributes=_drop_none(leg_attributes(role, engine_url, engine_request_id, **extra)))


class Leg:
    """A streaming engine leg: open from the request to the engine until the stream is closed, which
    happens in another task than the one that opened it (so it is never the task's current span
    except while the stream is being opened)."""

    def __init__(self, trace: RequestTrace, span: Span) -> None:
        self._trace = trace
        self.span = span

    def opening(self) -> AbstractContextManager[Span]:
        """Current while the stream is opened: the engine call carries this leg's ``traceparent``, and
        an exception raised opening it is recorded on the leg."""
        return self._trace.otel.use(self.span)

    def failed(self, exc: BaseException, **attributes: str | int | float | bool | None) -> None:
        """The stream broke mid-way (what a relay then continues)."""
        if self.span.is_recording():
            self.span.record_exception(exc)
            self.span.set_status(self._trace.otel.error(type(exc).__name__))
            self.span.set_attributes(_drop_none(attributes))

    def annotate(self, attributes: dict[str, str | int | float | bool | None]) -> None:
        annotate(self.span, attributes)

    def end(self) -> None:
        self.span.end()


def stream_leg(role: str, engine_url: str, engine_request_id: str | None = None, *,
               ends_with: contextlib.AsyncExitStack,
               **extra: str | int | float | bool | None) -> Leg | None:
    """A streaming engine leg for the current request, ended when ``ends_with`` (the stack holding the
    engine stream) closes: the leg lasts as long as its stream. None when the request is not traced."""
    trace = _trace(None)
    if trace is None:
        return None
    span = trace.start(f"engine.{role}", "client",
                       _drop_none(leg_attributes(role, engine_url, engine_request_id, **extra)))
    leg = Leg(trace, span)
    ends_with.callback(leg.end)
    return leg


def opening(leg: Leg | None) -> AbstractContextManager[Span | None]:
    return _NOOP if leg is None else leg.opening()


# -- HTTP: the client's traceparent, and the span's end once the response is sent ---------------------
@dataclass(eq=False)
class _Arrival:
    """What the middleware learned of a request before any door ran."""

    parent: Context | None          # the client's trace context (None: it sent none)
    start_ns: int
    name: str                       # ``POST /v1/chat/completions``
    attributes: Attributes
    http: bool                      # an HTTP request (not a WebSocket session)
    trace: RequestTrace | None = None


_arrival: ContextVar[_Arrival | None] = ContextVar("coordinator_trace_arrival", default=None)

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Any], Callable[[MutableMapping[str, Any]], Any]], Any]


class TraceContextMiddleware:
    """Pure ASGI (so the request runs in the same task and context as the door): reads the client's
    ``traceparent``/``tracestate``, and ends an HTTP request's span when the response has been sent.

    It starts no span itself: only requests that start an observation record (the inference routes)
    are traced, never ``/health``, ``/metrics`` or ``/ready`` polls. Installed only when tracing is on.
    """

    def __init__(self, app: ASGIApp, otel: _Otel | None = None) -> None:
        self.app = app
        self._otel = otel or _Otel()

    async def __call__(self, scope: Scope, receive: Callable[[], Any],
                       send: Callable[[MutableMapping[str, Any]], Any]) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        carrier = _trace_headers(scope.get("headers") or ())
        parent = self._otel.propagator.extract(carrier) if carrier else None
        path = str(scope.get("path", ""))
        method = str(scope.get("method", "GET")) if kind == "http" else "GET"
        arrival = _Arrival(parent, time.time_ns(), f"{method} {path}",
                           {"http.request.method": method, "url.path": path, "http.route": path},
                           http=kind == "http")
        token = _arrival.set(arrival)
        try:
            await self.app(scope, receive, send)
        finally:
            _arrival.reset(token)
            if arrival.trace is not None:
                arrival.trace.end()


def _trace_headers(headers: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in headers:
        if key in (b"traceparent", b"tracestate"):
            out[key.decode("latin-1")] = value.decode("latin-1")
    return out

