"""Tracing without a coordinator: the extra is optional, and the spans' shape and propagation rules."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from coordinator.config import TracingSettings
from coordinator.observability import tracing
from coordinator.observability.record import Observer, current

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = ("Settings(render={'url': 'http://127.0.0.1:9'}, engines=[{'url': 'http://127.0.0.1:9'}], "
            "models=[{'name': 'm'}]")
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def build(extra: str = "", *, block_otel: bool) -> str:
    block = "import sys; sys.modules['opentelemetry'] = None\n" if block_otel else ""
    return (block + "import sys\nfrom coordinator.app import build_components\n"
            "from coordinator.config import Settings\n"
            f"c = build_components({SETTINGS}{extra}))\n"
            "print(type(c.pipeline.observer).__name__, any(m.startswith('opentelemetry') and v is not None for m, v in list(sys.modules.items())))\n")


def test_off_by_default_and_runs_without_opentelemetry() -> None:
    out = run(build(block_otel=True))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["Observer", "False"]
    out = run(build(block_otel=False))  # installed but off: still never imported
    assert out.stdout.split() == ["Observer", "False"], out.stderr


def test_enabled_without_opentelemetry_is_a_clear_startup_error() -> None:
    out = run(build(", tracing={'enabled': True}", block_otel=True))
    assert out.returncode != 0
    assert "TracingUnavailable" in out.stderr and "pip install 'llm-coordinator[tracing]'" in out.stderr


def test_enabled_builds_its_own_provider() -> None:
    out = run(build(", tracing={'enabled': True, 'exporter': 'console', 'sample_ratio': 0.5}", block_otel=False))
    assert out.stdout.split() == ["TracingObserver", "True"], out.stderr
    provider = tracing.build_provider(TracingSettings(enabled=True, service_name="coord-a", sample_ratio=0.25))
    try:
        assert provider.resource.attributes["service.name"] == "coord-a"
        assert "ParentBased" in type(provider.sampler).__name__ and "0.25" in provider.sampler.get_description()
    finally:
        provider.shutdown()


@pytest.fixture
def spans() -> Iterator[tuple[tracing.TracingObserver, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = tracing.build_observer(TracingSettings(), None, provider)
    assert isinstance(observer, tracing.TracingObserver)
    yield observer, exporter
    provider.shutdown()


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exporter.get_finished_spans()}


def test_stage_spans_are_children_and_calls_carry_their_traceparent(
        spans: tuple[tracing.TracingObserver, InMemorySpanExporter]) -> None:
    observer, exporter = spans
    record = observer.start("internal", request_id="r1")
    record.operation, record.model = "chat.completions.create", "m"
    token = current.set(record)
    try:
        headers: dict[str, str] = {}
        with tracing.stage("render", kind="client") as span:
            assert span is not None
            tracing.inject(headers)
        place = tracing.placing(lambda req: None if req == "full" else type("P", (), {
            "engine": type("E", (), {"url": "http://e1"})(), "prefill": None, "matched_tokens": 3})())
        assert place("full") is None  # no room: no span yet
        assert place("ok") is not None
    finally:
        current.reset(token)
    record.usage(5, 7)
    record.finish()
    got = by_name(exporter)
    request = got["chat.completions.create"]
    assert request.kind is SpanKind.SERVER
    assert request.attributes is not None and request.attributes["gen_ai.usage.output_tokens"] == 7
    render, sched = got["render"], got["scheduling"]
    assert render.parent is not None and render.parent.span_id == request.context.span_id
    assert sched.parent is not None and sched.parent.span_id == request.context.span_id
    assert sched.attributes == {"coordinator.engine.url": "http://e1", "coordinator.scheduling.cached_tokens": 3,
                                "coordinator.scheduling.calls": 2}
    # The render call's traceparent names the render span (so the sidecar's spans hang under it).
    _, trace_id, parent_id, flags = headers["traceparent"].split("-")
    assert (trace_id, parent_id) == (f"{request.context.trace_id:032x}", f"{render.context.span_id:016x}")
    assert int(flags, 16) & 1  # sampled
    # After the request ended, its calls (an abort, say) carry nothing.
    late: dict[str, str] = {}
    token = current.set(record)
    tracing.inject(late)
    current.reset(token)
    assert late == {}


def test_untraced_requests_send_nothing() -> None:
    record = Observer().start("internal")
    token = current.set(record)
    try:
        headers: dict[str, str] = {}
        tracing.inject(headers)
        with tracing.stage("render") as span:
            assert span is None
        place = tracing.placing(len)
        assert place is len  # the scheduler itself: nothing wrapped
    finally:
        current.reset(token)
    assert headers == {}


def test_middleware_continues_the_client_trace_and_ends_after_the_response(
        spans: tuple[tracing.TracingObserver, InMemorySpanExporter]) -> None:
    observer, exporter = spans
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        record = observer.start("http", request_id="r2", operation="chat.completions.create")
        record.output_event()
        record.finish()
        assert exporter.get_finished_spans() == ()  # the response is not sent yet
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01".encode())]}
    asyncio.run(tracing.TraceContextMiddleware(app)(scope, lambda: None, send))  # type: ignore[arg-type]
    assert len(sent) == 2
    got = by_name(exporter)
    request = got["POST /v1/chat/completions"]
    assert f"{request.context.trace_id:032x}" == CLIENT_TRACE
    assert request.parent is not None and f"{request.parent.span_id:016x}" == CLIENT_SPAN
    assert request.attributes is not None and request.attributes["http.response.status_code"] == 200
    write = got["write"]
    assert write.parent is not None and write.parent.span_id == request.context.span_id
    assert write.end_time is not None and request.end_time is not None and write.end_time <= request.end_time


def test_an_unsampled_client_trace_stays_unsampled(spans: tuple[tracing.TracingObserver, InMemorySpanExporter]
                                                   ) -> None:
    observer, exporter = spans
    headers: dict[str, str] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        record = observer.start("http", request_id="r3", operation="chat.completions.create")
        token = current.set(record)
        with tracing.stage("render"):
            tracing.inject(headers)
        current.reset(token)
        record.finish()

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00".encode())]}
    asyncio.run(tracing.TraceContextMiddleware(app)(scope, lambda: None, lambda m: None))  # type: ignore[arg-type]
    assert exporter.get_finished_spans() == ()
    # Passed on as unsampled, in the client's trace: the engines do not record it either.
    _, trace_id, _, flags = headers["traceparent"].split("-")
    assert trace_id == CLIENT_TRACE and not int(flags, 16) & 1
    assert trace.get_current_span() is trace.INVALID_SPAN


def test_a_websocket_session_parents_each_operation_on_the_upgrade_traceparent(
        spans: tuple[tracing.TracingObserver, InMemorySpanExporter]) -> None:
    observer, exporter = spans

    async def app(scope: Any, receive: Any, send: Any) -> None:
        async def operation(n: int) -> None:  # NNRP runs each operation in a task of the session
            record = observer.start("nnrp", request_id=f"op-{n}")
            record.operation = "chat.completions.create"
            record.finish()
        await asyncio.gather(operation(1), operation(2))

    scope = {"type": "websocket", "path": "/nnrp/v1",
             "headers": [(b"traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01".encode())]}
    asyncio.run(tracing.TraceContextMiddleware(app)(scope, lambda: None, lambda m: None))  # type: ignore[arg-type]
    got = exporter.get_finished_spans()
    assert [s.name for s in got] == ["nnrp chat.completions.create"] * 2
    assert len({s.context.span_id for s in got}) == 2  # one span per operation, not per session
    assert all(f"{s.context.trace_id:032x}" == CLIENT_TRACE and s.parent is not None
               and f"{s.parent.span_id:016x}" == CLIENT_SPAN for s in got)


def test_an_unreachable_collector_does_not_hold_up_shutdown() -> None:
    from coordinator.embedded import free_port

    dead = f"http://127.0.0.1:{free_port()}/v1/traces"
    observer = tracing.build_observer(TracingSettings(enabled=True, endpoint=dead))
    assert isinstance(observer, tracing.TracingObserver) and observer.tracer is not None
    observer.tracer.start_span("pending").end()  # batched, never deliverable
    started = time.monotonic()
    observer.shutdown()
    assert time.monotonic() - started < tracing.SHUTDOWN_WAIT_S + 1
