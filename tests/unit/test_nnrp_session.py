"""The NNRP session state machine over an in-memory transport and a stand-in request runner."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from pydantic import SecretStr

from coordinator.api.auth import ApiKeyCheck
from coordinator.config import NnrpSettings
from coordinator.nnrp import frames as F
from coordinator.nnrp.profile import ServingCapabilities, build_manifest
from coordinator.nnrp.session import Session
from coordinator.pipeline.context import RequestContext
from coordinator.pipeline.errors import BadRequest, PipelineError
from coordinator.pipeline.responses.chain import ResponseChain, ResponsesIntake
from coordinator.pipeline.responses.convert import ResponsesForm

KEY = "sk-test"


class Pipe:
    """Client side of an in-memory transport; the session gets ``Pipe.server``."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[str | bytes | None] = asyncio.Queue()
        self.outbox: asyncio.Queue[str | bytes] = asyncio.Queue()
        self.closed: tuple[int, str] | None = None
        pipe = self

        class Server:
            async def receive(self) -> str | bytes | None:
                return await pipe.inbox.get()

            async def send(self, data: str | bytes) -> None:
                await pipe.outbox.put(data)

            async def close(self, code: int, reason: str = "") -> None:
                pipe.closed = (code, reason)

        self.server = Server()

    def send(self, frame: dict[str, Any] | str | bytes) -> None:
        self.inbox.put_nowait(json.dumps(frame) if isinstance(frame, dict) else frame)

    async def recv(self, wait: float = 2.0) -> dict[str, Any]:
        return F.decode_server(await asyncio.wait_for(self.outbox.get(), wait))

    async def until(self, pred: Any, wait: float = 2.0) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = []
        while True:
            f = await self.recv(wait)
            got.append(f)
            if pred(f):
                return got


class FakeStream:
    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay
        self.pulled = 0
        self.closed = False

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        for i in range(self.n):
            await asyncio.sleep(self.delay)
            self.pulled += 1
            yield {"id": "chatcmpl-1", "model": "m",
                   "choices": [{"index": 0, "delta": {"content": f"t{i} "},
                                "finish_reason": "length" if i == self.n - 1 else None}]}

    async def aclose(self) -> None:
        self.closed = True

    @property
    def buffered_tokens(self) -> int:
        return 0


class FakeServed:
    def __init__(self, stream: FakeStream | None, response: dict[str, Any] | None,
                 ctx: RequestContext | None = None) -> None:
        self.stream, self.response = stream, response
        self.ctx = ctx
        self.released = False

    async def aclose(self) -> None:
        self.released = True
        if self.stream is not None:
            await self.stream.aclose()


class Runner:
    def __init__(self, n: int = 5, delay: float = 0.0, fail: PipelineError | None = None) -> None:
        self.n, self.delay, self.fail = n, delay, fail
        self.served: list[FakeServed] = []
        self.calls: list[tuple[dict[str, Any], str | None]] = []  # (body, operation) per serve
        self.tenants: list[Any] = []  # the tenant each serve ran for

    async def serve(self, kind: str, body: Any, request_id: str, *, priority: int | None = None,
                    gone: Any = None, record: Any = None, operation: str | None = None,
                    tenant: Any = None, native: Any = None) -> FakeServed:
        self.calls.append((body, operation))
        self.tenants.append(tenant)
        if self.fail is not None:
            raise self.fail
        ctx = RequestContext(kind="chat", request_id=request_id, body=body, model="m",
                             stream=bool(body.get("stream")), include_usage=True, created=7)
        if body.get("stream"):
            s = FakeServed(FakeStream(int(body.get("max_tokens", self.n)), self.delay), None, ctx)
        else:
            s = FakeServed(None, {"id": "chatcmpl-2", "model": "m", "usage": {"prompt_tokens": 1,
                                  "completion_tokens": 1, "total_tokens": 2},
                                  "choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "stop"}]},
                           ctx)
        self.served.append(s)
        return s


def env(stream: bool = True, **extra: Any) -> dict[str, Any]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    body.update(extra.pop("body", {}))
    return {"schema_version": "openai-compatible/1", "operation": "chat.completions.create", "body": body,
            **extra}


async def start(runner: Runner, **settings: Any) -> tuple[Pipe, asyncio.Task[None], Session]:
    pipe = Pipe()
    cfg = NnrpSettings(**{"idle_timeout_s": 5, "heartbeat_s": 1, "initial_credits": 100, **settings})
    session = Session(pipe.server, runner, cfg, build_manifest(ServingCapabilities()),
                      ApiKeyCheck([SecretStr(KEY)]))
    task = asyncio.create_task(session.run())
    return pipe, task, session


async def handshake(pipe: Pipe, encoding: str = "json") -> None:
    pipe.send({"type": "hello", "versions": [1], "encodings": [encoding]})
    welcome = await pipe.recv()
    assert welcome["type"] == "welcome" and welcome["encoding"] == encoding and welcome["version"] == 1
    pipe.send({"type": "open", "schema_version": "openai-compatible/1", "authorization": f"Bearer {KEY}"})
    opened = await pipe.recv()
    assert opened["type"] == "opened" and opened["manifest"]["adapter"] == "llm-coordinator"


async def results(pipe: Pipe, op: str) -> list[dict[str, Any]]:
    frames = await pipe.until(lambda f: f["type"] == "result" and f["op"] == op
                              and f["event"]["type"] in ("response.completed", "response.error",
                                                         "response.cancelled"))
    return [f for f in frames if f["type"] == "result" and f["op"] == op]


async def finish(pipe: Pipe, task: asyncio.Task[None]) -> None:
    pipe.send({"type": "close"})
    await asyncio.wait_for(task, 3)
    assert pipe.closed is not None and pipe.closed[0] == F.CLOSE_NORMAL


async def test_streaming_operation_in_order_then_completed() -> None:
    runner = Runner(n=5)
    pipe, task, _ = await start(runner)
    await handshake(pipe)
    pipe.send({"type": "submit", "op": "a", "envelope": env()})
    got = await results(pipe, "a")
    assert [f["seq"] for f in got] == list(range(6))
    assert "".join(f["event"].get("delta", "") for f in got) == "t0 t1 t2 t3 t4 "
    assert got[-1]["event"]["type"] == "response.completed" and got[-1]["event"]["finish_reason"] == "length"
    await finish(pipe, task)
    assert all(s.released for s in runner.served)


async def test_msgpack_session_and_non_streaming() -> None:
    pipe, task, _ = await start(Runner())
    pipe.send(msgspec.msgpack.encode({"type": "hello", "encodings": ["msgpack", "json"]}))
    welcome = await pipe.recv()
    assert welcome["encoding"] == "msgpack"
    pipe.send(msgspec.msgpack.encode({"type": "open", "schema_version": "openai-compatible/1",
                                      "authorization": f"Bearer {KEY}"}))
    raw = await pipe.outbox.get()
    assert isinstance(raw, bytes) and F.decode_server(raw)["type"] == "opened"
    pipe.send({"type": "submit", "op": "n", "envelope": env(stream=False)})  # JSON accepted too
    got = await results(pipe, "n")
    assert [f["event"]["type"] for f in got] == ["response.usage", "response.completed"]
    assert got[1]["event"]["response"]["id"] == "chatcmpl-2"
    await finish(pipe, task)


async def test_credits_stop_pulling_the_stream() -> None:
    runner = Runner(n=20)
    pipe, task, _ = await start(runner, initial_credits=0)
    await handshake(pipe)
    pipe.send({"type": "submit", "op": "a", "envelope": env(), "credits": 3})
    first = [await pipe.recv() for _ in range(3)]
    assert [f["seq"] for f in first] == [0, 1, 2]
    await asyncio.sleep(0.1)
    assert pipe.outbox.empty()
    assert runner.served[0].stream is not None and runner.served[0].stream.pulled == 3
    pipe.send({"type": "credit", "op": "a", "credits": 100})
    rest = await results(pipe, "a")
    assert [f["seq"] for f in rest] == list(range(3, 21))
    await finish(pipe, task)


async def test_cancel_stops_events_and_releases() -> None:
    runner = Runner(n=1000, delay=0.005)
    pipe, task, session = await start(runner)
    await handshake(pipe)
    pipe.send({"type": "submit", "op": "a", "envelope": env()})
    pipe.send({"type": "submit", "op": "b", "envelope": env(body={"max_tokens": 5})})
    await pipe.until(lambda f: f["type"] == "result" and f["op"] == "a" and f["seq"] >= 3)
    pipe.send({"type": "cancel", "op": "a", "reason": "stop it"})
    frames = await pipe.until(lambda f: f["type"] == "result" and f["event"]["type"] == "response.cancelled")
    cancelled = frames[-1]["event"]
    assert cancelled["diagnostics"] == {"source": "client", "reason": "stop it", "operation_id": "a",
                                        "engine_abort_accepted": None}
    await asyncio.sleep(0.05)
    later = []
    while not pipe.outbox.empty():
        later.append(F.decode_server(pipe.outbox.get_nowait()))
    assert not [f for f in later if f.get("op") == "a"]
    assert runner.served[0].released and session.open_operations <= 1
    pipe.send({"type": "cancel", "op": "a"})  # late cancel of an ended op: ignored
    pipe.send({"type": "submit", "op": "a", "envelope": env(body={"max_tokens": 2})})  # id reusable
    assert [f["event"]["type"] for f in await results(pipe, "a")][-1] == "response.completed"
    await finish(pipe, task)


async def test_timeout_policy_cancels() -> None:
    runner = Runner(n=1000, delay=0.01)
    pipe, task, _ = await start(runner)
    await handshake(pipe)
    pipe.send({"type": "submit", "op": "t", "envelope": env(policy={"timeout_ms": 50, "diagnostics": "summary"})})
    got = await results(pipe, "t")
    assert got[-1]["event"]["diagnostics"]["source"] == "timeout"
    summary = await pipe.recv()
    assert summary["type"] == "diagnostics" and summary["kind"] == "summary" and summary["op"] == "t"
    assert summary["record"]["state"] == "cancelled" and summary["record"]["released"] is True
    await finish(pipe, task)


async def test_socket_close_cancels_every_operation() -> None:
    runner = Runner(n=1000, delay=0.01)
    pipe, task, session = await start(runner)
    await handshake(pipe)
    for op in "abc":
        pipe.send({"type": "submit", "op": op, "envelope": env()})
    await pipe.until(lambda f: f["type"] == "result")
    pipe.inbox.put_nowait(None)
    await asyncio.wait_for(task, 3)
    assert len(runner.served) == 3 and all(s.released for s in runner.served)
    assert session.open_operations == 0 and session.running_tasks == 0


async def test_bad_frames_get_errors_and_the_session_goes_on() -> None:
    pipe, task, _ = await start(Runner(n=3), max_frame_bytes=1024)
    pipe.send({"type": "submit", "op": "x", "envelope": env()})  # before hello
    assert (await pipe.recv())["code"] == F.UNEXPECTED_FRAME
    await handshake(pipe)
    cases = [("{nope", F.MALFORMED_FRAME), (b"\xc1\xc1", F.MALFORMED_FRAME),
             ({"type": "warp"}, F.UNKNOWN_TYPE), ("x" * 2000, F.FRAME_TOO_LARGE),
             ({"type": "open", "schema_version": "openai-compatible/1"}, F.UNEXPECTED_FRAME),
             ({"type": "hello"}, F.UNEXPECTED_FRAME),
             ({"type": "credit", "op": "zzz", "credits": 1}, F.UNKNOWN_OPERATION)]
    for frame, code in cases:
        pipe.send(frame)
        err = await pipe.recv()
        assert err["type"] == "error" and err["code"] == code, (frame, err)
    pipe.send({"type": "submit", "op": "d", "envelope": env(body={"max_tokens": 50})})
    pipe.send({"type": "submit", "op": "d", "envelope": env()})
    seen = await pipe.until(lambda f: f["type"] == "error")
    assert seen[-1]["code"] == F.DUPLICATE_OPERATION and seen[-1]["op"] == "d"
    pipe.send({"type": "submit", "op": "e", "envelope": {"schema_version": "openai-compatible/1",
                                                         "operation": "responses.create", "body": {}}})
    seen += await pipe.until(lambda f: f.get("op") == "e")
    assert seen[-1] == {"type": "result", "op": "e", "seq": 0, "event": seen[-1]["event"]}
    assert seen[-1]["event"]["error"]["code"] == "unsupported_operation"
    pipe.send({"type": "ping", "nonce": 9})
    seen += await pipe.until(lambda f: f["type"] == "pong")
    assert seen[-1]["nonce"] == 9

    def d_done(f: dict[str, Any]) -> bool:
        return f["type"] == "result" and f["op"] == "d" and f["event"]["type"] == "response.completed"

    if not any(d_done(f) for f in seen):
        seen += await pipe.until(d_done)
    d = [f["seq"] for f in seen if f["type"] == "result" and f["op"] == "d"]
    assert d == list(range(51))
    await finish(pipe, task)


async def test_pipeline_error_is_response_error() -> None:
    pipe, task, _ = await start(Runner(fail=PipelineError("no engine", status=503,
                                                          type="ServiceUnavailableError")))
    await handshake(pipe)
    pipe.send({"type": "submit", "op": "a", "envelope": env()})
    got = await results(pipe, "a")
    assert got[0]["event"]["status"] == 503 and got[0]["event"]["error"]["code"] == 503
    await finish(pipe, task)


async def test_unauthorized_open_closes_4401() -> None:
    pipe, task, _ = await start(Runner())
    pipe.send({"type": "hello"})
    await pipe.recv()
    pipe.send({"type": "open", "schema_version": "openai-compatible/2", "authorization": f"Bearer {KEY}"})
    assert (await pipe.recv())["code"] == F.UNSUPPORTED_SCHEMA_VERSION  # the session goes on
    pipe.send({"type": "open", "schema_version": "openai-compatible/1", "authorization": "Bearer wrong"})
    assert (await pipe.recv())["code"] == F.UNAUTHORIZED
    await asyncio.wait_for(task, 3)
    assert pipe.closed is not None and pipe.closed[0] == F.CLOSE_UNAUTHORIZED


async def test_idle_session_is_closed_4408_and_pinged() -> None:
    pipe, task, _ = await start(Runner(), idle_timeout_s=0.6, heartbeat_s=0.1)
    pipe.send({"type": "hello"})
    await pipe.recv()
    assert (await pipe.recv())["type"] == "ping"
    await asyncio.wait_for(task, 3)
    assert pipe.closed is not None and pipe.closed[0] == F.CLOSE_IDLE


@pytest.mark.parametrize("limit", [2])
async def test_too_many_operations(limit: int) -> None:
    pipe, task, _ = await start(Runner(n=1000, delay=0.01), max_operations=limit)
    await handshake(pipe)
    for op in ("a", "b", "c"):
        pipe.send({"type": "submit", "op": op, "envelope": env()})
    frames = await pipe.until(lambda f: f["type"] == "error")
    assert frames[-1]["code"] == F.TOO_MANY_OPERATIONS and frames[-1]["op"] == "c"
    await finish(pipe, task)


# ------------------------------------------------------------------------------------------------
# responses.create and models.list
# ------------------------------------------------------------------------------------------------

MODELS = {"object": "list", "data": [{"id": "m", "object": "model", "created": 1, "owned_by": "vllm",
                                      "root": "/models/m", "parent": None, "max_model_len": 2048}]}


class Translator:
    """Stands in for the sidecar's Responses → chat conversion."""

    def __init__(self, fail: PipelineError | None = None) -> None:
        self.fail = fail
        self.bodies: list[dict[str, Any]] = []

    async def form(self, body: Any, request_id: str) -> ResponsesForm:
        self.bodies.append(body)
        if self.fail is not None:
            raise self.fail
        chat = {"model": body["model"], "messages": [{"role": "user", "content": body["input"]}],
                "stream": bool(body.get("stream")), "max_tokens": body.get("max_output_tokens", 3)}
        return ResponsesForm(chat=chat, response={"object": "response", "id": "", "model": "", "tools": []})


def intake(translator: Translator) -> ResponsesIntake:
    """The stand-in conversion behind the doors' intake, with no response store (nothing kept)."""
    return ResponsesIntake(translator, ResponseChain(None))  # type: ignore[arg-type]


async def start_full(runner: Runner, translator: Translator | None = None,
                     **settings: Any) -> tuple[Pipe, asyncio.Task[None], Session]:
    """A session whose manifest declares responses.create and models.list, as the server's does."""
    pipe = Pipe()
    cfg = NnrpSettings(**{"idle_timeout_s": 5, "heartbeat_s": 1, "initial_credits": 100, **settings})
    manifest = build_manifest(ServingCapabilities(responses=True, models_list=True))
    session = Session(pipe.server, runner, cfg, manifest, ApiKeyCheck([SecretStr(KEY)]),
                      models=lambda may_use: MODELS, responses=intake(translator or Translator()))
    task = asyncio.create_task(session.run())
    await handshake(pipe)
    return pipe, task, session


def renv(stream: bool = True, **body: Any) -> dict[str, Any]:
    return {"schema_version": "openai-compatible/1", "operation": "responses.create",
            "body": {"model": "m", "input": "hi", "stream": stream, **body}}


def mlist(**body: Any) -> dict[str, Any]:
    return {"schema_version": "openai-compatible/1", "operation": "models.list", "body": body}


async def test_responses_stream_is_the_responses_event_sequence() -> None:
    runner, translator = Runner(), Translator()
    pipe, task, _ = await start_full(runner, translator)
    pipe.send({"type": "submit", "op": "r", "envelope": renv(max_output_tokens=3)})
    got = await results(pipe, "r")
    events = [f["event"] for f in got]
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [f["seq"] for f in got] == list(range(11))
    assert [e["sequence_number"] for e in events] == list(range(11))  # numbered as the HTTP door does
    done = events[-1]["response"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "t0 t1 t2 " == done["output"][0]["content"][0]["text"]
    assert done["status"] == "incomplete" and done["incomplete_details"] == {"reason": "max_output_tokens"}
    body, operation = runner.calls[0]
    assert operation == "responses.create" and body["messages"] == [{"role": "user", "content": "hi"}]
    assert translator.bodies == [renv(max_output_tokens=3)["body"]]
    await finish(pipe, task)
    assert all(s.released for s in runner.served)


async def test_responses_non_streaming_is_one_completed_event_with_the_response() -> None:
    pipe, task, _ = await start_full(Runner())
    pipe.send({"type": "submit", "op": "r", "envelope": renv(stream=False)})
    got = await results(pipe, "r")
    assert [(f["seq"], f["event"]["type"]) for f in got] == [(0, "response.completed")]
    response = got[0]["event"]["response"]
    assert response["object"] == "response" and response["status"] == "completed"
    assert response["id"].startswith("resp_nnrp-")
    assert response["output"][0]["content"][0]["text"] == "x"
    assert response["usage"]["input_tokens"] == 1 and response["usage"]["total_tokens"] == 2
    await finish(pipe, task)


async def test_responses_errors_name_the_field_the_client_wrote() -> None:
    refused = BadRequest("'max_tokens' must be at least 1", param="max_tokens")
    pipe, task, _ = await start_full(Runner(fail=refused))
    pipe.send({"type": "submit", "op": "r", "envelope": renv(max_output_tokens=0)})
    error = (await results(pipe, "r"))[-1]["event"]
    assert error["type"] == "response.error" and error["status"] == 400
    assert error["error"]["param"] == "max_output_tokens" and "'max_output_tokens'" in error["error"]["message"]
    await finish(pipe, task)

    runner = Runner()
    pipe, task, _ = await start_full(runner, Translator(fail=BadRequest(
        "previous_response_id is not supported", param="previous_response_id")))
    pipe.send({"type": "submit", "op": "r", "envelope": renv(previous_response_id="resp_1")})
    got = await results(pipe, "r")
    assert [f["event"]["type"] for f in got] == ["response.error"]
    assert got[0]["event"]["error"]["param"] == "previous_response_id"
    assert runner.calls == []  # refused before the pipeline
    await finish(pipe, task)


async def test_responses_cancel_ends_the_stream_and_releases() -> None:
    runner = Runner(delay=0.005)
    pipe, task, session = await start_full(runner)
    pipe.send({"type": "submit", "op": "r", "envelope": renv(max_output_tokens=1000)})
    await pipe.until(lambda f: f["type"] == "result" and f["seq"] >= 5)
    pipe.send({"type": "cancel", "op": "r", "reason": "enough"})
    frames = await pipe.until(lambda f: f["type"] == "result" and f["event"]["type"] == "response.cancelled")
    assert frames[-1]["event"]["diagnostics"]["reason"] == "enough"
    await asyncio.sleep(0.05)
    later = [F.decode_server(pipe.outbox.get_nowait()) for _ in range(pipe.outbox.qsize())]
    assert [f for f in later if f.get("op") == "r"] == []  # no output_item.done, no response.completed
    assert runner.served[0].released and session.open_operations == 0
    await finish(pipe, task)


async def test_isolated_cache_salts_the_converted_chat_request() -> None:
    runner, translator = Runner(), Translator()
    pipe, task, _ = await start_full(runner, translator)
    pipe.send({"type": "submit", "op": "r", "envelope": {**renv(stream=False), "policy": {"cache": "isolated"}}})
    await results(pipe, "r")
    assert len(runner.calls[0][0]["cache_salt"]) == 32 and "cache_salt" not in translator.bodies[0]
    await finish(pipe, task)


async def test_models_list_is_one_completed_frame_without_the_pipeline() -> None:
    runner = Runner()
    pipe, task, _ = await start_full(runner)
    pipe.send({"type": "submit", "op": "m", "envelope": mlist()})
    got = await results(pipe, "m")
    assert got == [{"type": "result", "op": "m", "seq": 0,
                    "event": {"type": "response.completed", "response": MODELS}}]
    pipe.send({"type": "submit", "op": "s", "envelope": mlist(stream=True)})
    assert (await results(pipe, "s"))[0]["event"]["error"]["code"] == "unsupported_operation"
    pipe.send({"type": "submit", "op": "x", "envelope": mlist(limit=5)})
    err = (await results(pipe, "x"))[0]["event"]["error"]
    assert err["code"] == "invalid_body" and err["param"] == "body.limit"
    assert runner.calls == []
    await finish(pipe, task)


def test_a_declared_operation_needs_its_means() -> None:
    manifest = build_manifest(ServingCapabilities(responses=True, models_list=True))
    check = ApiKeyCheck([SecretStr(KEY)])
    with pytest.raises(ValueError, match=r"responses\.create"):
        Session(Pipe().server, Runner(), NnrpSettings(), manifest, check, models=lambda may_use: MODELS)
    with pytest.raises(ValueError, match=r"models\.list"):
        Session(Pipe().server, Runner(), NnrpSettings(), manifest, check, responses=intake(Translator()))
