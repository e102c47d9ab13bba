"""Tracing end to end: real render sidecar (behind a proxy that records what each call carried),
simulated engines (which record the ``traceparent`` of every generate call), spans in memory.

What a user of Jaeger/Tempo relies on: one trace per request, one child span per stage in the order
the request went through them, the client's trace continued, and the sidecar's and engines' calls
carrying a ``traceparent`` that names the stage span that made them; with tracing off, nothing on the
wire changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.requests import Request
from starlette.responses import Response

from coordinator import embedded
from coordinator.app import build_app
from coordinator.config import EngineSettings, Settings
from coordinator.observability.record import Observer
from coordinator.observability.tracing import TracingObserver
from tests.conftest import SERVED, CoordinatorFactory
from tests.faults.proxy import FaultProxy, Rule
from tests.support import CoordinatorServer, sse_events, wait_until
from token_engine.simulator import SimConfig, SimulatedEngine

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CHAT = "/v1/chat/completions"


class RecordingProxy(FaultProxy):
    """The render sidecar behind a proxy that remembers each call's path and ``traceparent``."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.seen: list[tuple[str, str | None]] = []

    async def _answer(self, rule: Rule, request: h11.Request, body: bytes
                      ) -> tuple[int, list[tuple[str, str]], bytes]:
        header = next((v.decode() for k, v in request.headers if k.lower() == b"traceparent"), None)
        self.seen.append((request.target.decode().split("?", 1)[0], header))
        return await super()._answer(rule, request, body)

    def traceparents(self, suffix: str) -> list[str | None]:
        return [tp for path, tp in self.seen if path.endswith(suffix)]


@pytest.fixture
def sidecar(render_sidecar: Any) -> Iterator[RecordingProxy]:
    with RecordingProxy(render_sidecar.url) as proxy:
        yield proxy


@pytest.fixture
def sims() -> Iterator[tuple[SimulatedEngine, SimulatedEngine]]:
    cfg = SimConfig(model=SERVED, mode="context", decode_s_per_token=0.002)
    with SimulatedEngine(cfg) as a, SimulatedEngine(cfg) as b:
        yield a, b


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


Traced = Callable[..., CoordinatorServer]


@pytest.fixture
def traced(coordinator_factory: CoordinatorFactory, exporter: InMemorySpanExporter,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Traced]:
    """``coordinator_factory`` for coordinators built with a TracerProvider that keeps spans in memory."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    def make(*args: Any, **overrides: Any) -> CoordinatorServer:
        with monkeypatch.context() as m:
            m.setattr(embedded, "build_app", lambda s: build_app(s, tracer_provider=provider))
            return coordinator_factory(*args, **overrides)

    yield make
    provider.shutdown()


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 12, "temperature": 0, **extra}


def post(coord: CoordinatorServer, body: dict[str, Any], request_id: str,
         headers: dict[str, str] | None = None) -> tuple[dict[str, Any], int]:
    """The request's usage (streams: when asked for) and the number of events written (SSE data
    frames before [DONE])."""
    r = httpx.post(f"{coord.url}{CHAT}", json=body, timeout=60,
                   headers={"X-Request-Id": request_id, **(headers or {})})
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return r.json()["usage"], 1
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    return events[-2].get("usage") or {}, len(events) - 1


def request_trace(exporter: InMemorySpanExporter, request_id: str) -> tuple[ReadableSpan, list[ReadableSpan]]:
    """The request's server span (once ended) and every other span of its trace, by start time."""
    def server() -> ReadableSpan | None:
        return next((s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER
                     and (s.attributes or {}).get("coordinator.request_id") == request_id), None)

    assert wait_until(lambda: server() is not None, 10), "the request span never ended"
    root = server()
    assert root is not None
    rest = [s for s in exporter.get_finished_spans()
            if s.context.trace_id == root.context.trace_id and s is not root]
    return root, sorted(rest, key=lambda s: s.start_time or 0)


def named(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def parent_of(traceparent: str | None) -> tuple[int, int]:
    """(trace id, parent span id) a ``traceparent`` header names."""
    assert traceparent is not None, "the call carried no traceparent"
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00" and int(flags, 16) & 1
    return int(trace_id, 16), int(span_id, 16)


def attr(span: ReadableSpan, key: str) -> Any:
    return (span.attributes or {})[key]


@pytest.mark.parametrize("stream", [False, True])
def test_one_request_is_one_trace_with_every_stage_in_order(
        traced: Traced, sidecar: RecordingProxy, sims: tuple[SimulatedEngine, SimulatedEngine],
        exporter: InMemorySpanExporter, stream: bool) -> None:
    sim = sims[0]
    coord = traced(sidecar.url, [sim.url])
    rid = f"traced-{stream}"
    body = chat(stream=True, stream_options={"include_usage": True}) if stream else chat()
    usage, events = post(coord, body, rid)
    root, stages = request_trace(exporter, rid)

    assert root.name == f"POST {CHAT}" and root.parent is None  # no client trace: a new one
    assert attr(root, "gen_ai.request.model") == SERVED
    assert attr(root, "gen_ai.operation.name") == "chat"
    assert attr(root, "gen_ai.usage.input_tokens") == usage["prompt_tokens"]
    assert attr(root, "gen_ai.usage.output_tokens") == usage["completion_tokens"] == 12
    assert attr(root, "http.response.status_code") == 200
    assert [s.name for s in stages] == ["render", "admission", "scheduling", "engine.union", "derender", "write"]
    assert all(s.parent is not None and s.parent.span_id == root.context.span_id for s in stages)
    assert all(root.start_time <= s.start_time and s.end_time <= root.end_time for s in stages)  # type: ignore[operator]
    render, _, scheduling, leg, derender, write = stages
    assert attr(scheduling, "coordinator.engine.url") == sim.url
    assert attr(leg, "coordinator.engine.url") == sim.url and attr(leg, "coordinator.engine.role") == "union"
    received = sim.state()["history"][-1]
    assert attr(leg, "gen_ai.request.id") == f"generate-tokens-{received['request_id']}"  # vLLM's own id
    assert attr(write, "coordinator.output.events") == events

    # Every outgoing call carried a traceparent naming the stage span that made it.
    trace_id = root.context.trace_id
    assert parent_of(received["traceparent"]) == (trace_id, leg.context.span_id)
    assert [parent_of(tp) for tp in sidecar.traceparents(f"{CHAT}/render")] == [(trace_id, render.context.span_id)]
    derenders = sidecar.traceparents(f"{CHAT}/derender")
    assert derenders and all(parent_of(tp) == (trace_id, derender.context.span_id) for tp in derenders)
    assert attr(derender, "coordinator.derender.calls") == len(derenders)  # one span, however many calls
    if stream:
        assert len(derenders) >= 2


def test_the_client_trace_is_continued(traced: Traced, sidecar: RecordingProxy,
                                       sims: tuple[SimulatedEngine, SimulatedEngine],
                                       exporter: InMemorySpanExporter) -> None:
    sim = sims[0]
    coord = traced(sidecar.url, [sim.url])
    post(coord, chat(stream=True), "continued", {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    root, stages = request_trace(exporter, "continued")
    assert f"{root.context.trace_id:032x}" == CLIENT_TRACE
    assert root.parent is not None and f"{root.parent.span_id:016x}" == CLIENT_SPAN
    assert len(stages) == 6
    assert f"{parent_of(sim.state()['history'][-1]['traceparent'])[0]:032x}" == CLIENT_TRACE
    assert all(f"{parent_of(tp)[0]:032x}" == CLIENT_TRACE for tp in sidecar.traceparents("/derender"))


def test_tracing_off_sends_nothing_and_records_nothing(
        traced: Traced, coordinator_factory: CoordinatorFactory, sidecar: RecordingProxy,
        sims: tuple[SimulatedEngine, SimulatedEngine], exporter: InMemorySpanExporter) -> None:
    traced(sidecar.url, [sims[1].url])  # another coordinator in the process traces: that changes nothing here
    plain = coordinator_factory(sidecar.url, [sims[0].url])
    assert type(plain.components.pipeline.observer) is Observer
    assert Settings().tracing.enabled is False
    for stream in (False, True):
        # Not even a client's own traceparent is passed on: the coordinator is not a transparent proxy.
        post(plain, chat(stream=stream), f"plain-{stream}", {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert [h["traceparent"] for h in sims[0].state()["history"]] == [None, None]
    assert len(sidecar.seen) >= 4 and all(tp is None for _, tp in sidecar.seen)
    assert exporter.get_finished_spans() == ()


def test_handoff_traces_prefill_and_decode_as_separate_legs(
        traced: Traced, sidecar: RecordingProxy, exporter: InMemorySpanExporter) -> None:
    with (SimulatedEngine(SimConfig(model=SERVED, kv_role="prefill", engine_id="p0")) as p,
          SimulatedEngine(SimConfig(model=SERVED, kv_role="decode", engine_id="d0")) as d):
        coord = traced(sidecar.url, [], engines=[{"url": p.url, "role": "prefill"}, {"url": d.url, "role": "decode"}],
                       topology={"pd_min_uncached_tokens": 0})
        post(coord, chat(stream=True), "handoff")
        root, stages = request_trace(exporter, "handoff")
        names = [s.name for s in stages]
        assert names == ["render", "admission", "scheduling", "engine.prefill", "engine.decode", "derender", "write"]
        scheduling, prefill, decode = stages[2:5]
        assert attr(scheduling, "coordinator.engine.prefill_url") == p.url
        assert attr(prefill, "coordinator.engine.url") == p.url and attr(decode, "coordinator.engine.url") == d.url
        assert prefill.end_time <= decode.start_time  # type: ignore[operator]
        trace_id = root.context.trace_id
        assert parent_of(p.state()["history"][-1]["traceparent"]) == (trace_id, prefill.context.span_id)
        assert parent_of(d.state()["history"][-1]["traceparent"]) == (trace_id, decode.context.span_id)


def test_a_relay_adds_a_leg_and_the_failed_one_says_why(
        traced: Traced, sidecar: RecordingProxy, sims: tuple[SimulatedEngine, SimulatedEngine],
        exporter: InMemorySpanExporter) -> None:
    coord = traced(sidecar.url, [s.url for s in sims], engine_client={"stream_idle_timeout_s": 1.0})
    post(coord, chat(stream=True, max_tokens=30), "baseline")
    victim = max(sims, key=lambda s: s.state()["generate_calls"])
    other = next(s for s in sims if s is not victim)
    victim.set_faults(calls=1, drop_after_tokens=7)
    usage, _ = post(coord, chat(stream=True, max_tokens=30, stream_options={"include_usage": True}), "relayed")
    assert usage["completion_tokens"] == 30
    root, stages = request_trace(exporter, "relayed")
    legs = named(stages, "engine.union")
    assert [attr(leg, "coordinator.engine.url") for leg in legs] == [victim.url, other.url]
    assert legs[0].status.status_code is StatusCode.ERROR and attr(legs[0], "coordinator.stream.tokens") >= 6
    assert attr(legs[1], "coordinator.relay") == 1 and legs[1].status.status_code is not StatusCode.ERROR
    assert len(named(stages, "admission")) == len(named(stages, "scheduling")) == 2
    assert len(named(stages, "derender")) == 1  # the stream's derender goes on across the relay
    trace_id = root.context.trace_id
    for sim, leg in ((victim, legs[0]), (other, legs[1])):
        assert parent_of(sim.state()["history"][-1]["traceparent"]) == (trace_id, leg.context.span_id)


async def test_an_nnrp_operation_is_one_trace_too(traced: Traced, sidecar: RecordingProxy,
                                                  sims: tuple[SimulatedEngine, SimulatedEngine],
                                                  exporter: InMemorySpanExporter) -> None:
    from coordinator.nnrp.client import NnrpClient

    coord = traced(sidecar.url, [sims[0].url])
    assert isinstance(coord.components.pipeline.observer, TracingObserver)
    async with await NnrpClient.connect(coord.url.replace("http://", "ws://") + "/nnrp/v1") as client:
        op = await client.chat(chat(stream=True))
        events = await op.collect()
    assert events[-1]["type"] == "response.completed"
    spans = exporter.get_finished_spans
    assert wait_until(lambda: any(s.kind is SpanKind.SERVER for s in spans()), 10)
    root = next(s for s in spans() if s.kind is SpanKind.SERVER)
    assert root.name == "nnrp chat.completions.create"
    assert attr(root, "coordinator.door") == "nnrp" and attr(root, "gen_ai.usage.output_tokens") == 12
    stages = sorted((s for s in spans() if s.context.trace_id == root.context.trace_id and s is not root),
                    key=lambda s: s.start_time or 0)
    assert [s.name for s in stages] == ["render", "admission", "scheduling", "engine.union", "derender", "write"]
    assert attr(stages[-1], "coordinator.output.events") == len(events)


@pytest.mark.parametrize("stream", [False, True])
def test_the_native_route_is_traced_too(traced: Traced, model_dir: Path, exporter: InMemorySpanExporter,
                                        stream: bool) -> None:
    """Render down: the local tokenizer renders and the engine's own OpenAI API answers (decisions.md)."""
    from tests.integration.test_native_route_sim import FakeNativeEngine, dead_render, models

    class Native(FakeNativeEngine):
        def __init__(self) -> None:
            super().__init__()
            self.traceparents: list[str | None] = []

        async def _chat(self, request: Request) -> Response:
            self.traceparents.append(request.headers.get("traceparent"))
            return await super()._chat(request)

    with Native() as native:
        coord = traced(dead_render(), [], models=models(model_dir),
                       engines=[EngineSettings(url=native.url, native_api=True)])
        post(coord, chat(stream=stream), f"native-{stream}")
        root, stages = request_trace(exporter, f"native-{stream}")
        assert [s.name for s in stages] == ["render", "admission", "scheduling", "engine.native", "write"]
        assert attr(stages[0], "coordinator.tokenizer_source") == "local"
        assert attr(root, "coordinator.route") == "native"
        assert parent_of(native.traceparents[-1]) == (root.context.trace_id, stages[3].context.span_id)
