"""responses.create and models.list over NNRP answer what the HTTP door answers, event for event."""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from coordinator.api.openai.responses import response_events, wire_for
from coordinator.config import ModelSettings
from coordinator.nnrp import profile as p
from coordinator.nnrp.responses import ResponsesStreamMapper, map_models, map_response
from coordinator.observability.record import Record
from coordinator.pipeline.catalog import ModelCatalog, model_cards
from coordinator.pipeline.context import RequestContext
from coordinator.pipeline.errors import BadRequest
from coordinator.pipeline.responses.convert import ResponsesForm

FORM = ResponsesForm(chat={"model": "m", "stream": True},
                     response={"object": "response", "id": "", "model": "", "tools": [], "temperature": 0.0})
CTX = RequestContext(kind="chat", request_id="r1", body={}, model="m", stream=True, include_usage=True,
                     created=1767225600)


def text_chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-r1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}]}


CHUNKS = [
    {"id": "chatcmpl-r1", "object": "chat.completion.chunk", "created": 1, "model": "m",
     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
    text_chunk("Paris is"), text_chunk(" the capital."), text_chunk("", "stop"),
    {"id": "chatcmpl-r1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
     "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}},
]


@pytest.fixture
def fixed_ids(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Item ids from a counter; calling the fixture restarts it, so two runs give the same ids."""
    def restart() -> None:
        counter = itertools.count(1)
        monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=next(counter)))

    restart()
    return restart


class Chunks:
    def __init__(self, chunks: list[dict[str, Any]], fail: Exception | None = None) -> None:
        self.chunks, self.fail = chunks, fail

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        for chunk in self.chunks:
            yield chunk
        if self.fail is not None:
            raise self.fail

    async def aclose(self) -> None:
        return None

    @property
    def buffered_tokens(self) -> int:
        return 0


def http_events(chunks: list[dict[str, Any]], fail: Exception | None = None) -> list[dict[str, Any]]:
    """What ``POST /v1/responses`` streams for these chunks: each SSE frame's data, checked against
    its ``event:`` line."""
    async def collect() -> list[bytes]:
        return [frame async for frame in response_events(FORM, Chunks(chunks, fail), lambda _: None,
                                                          Record("http"), CTX)]

    out = []
    for frame in asyncio.run(collect()):
        head, data = frame.decode().removesuffix("\n\n").split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        out.append(event)
    return out


def nnrp_events(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the session sends for the same stream: start, every chunk, flush, complete."""
    mapper = ResponsesStreamMapper()
    events = [*mapper.start(FORM, CTX), *(e for c in chunks for e in mapper.map_chunk(c)), *mapper.flush()]
    done = mapper.complete()
    assert done is not None
    return [*events, done]


def test_stream_events_equal_the_http_doors(fixed_ids: Callable[[], None]) -> None:
    http = http_events(CHUNKS)
    fixed_ids()
    nnrp = nnrp_events(CHUNKS)
    assert nnrp == http
    assert [e["sequence_number"] for e in nnrp] == list(range(len(nnrp)))
    assert nnrp[0]["type"] == "response.created" and nnrp[-1]["type"] == "response.completed"
    assert nnrp[-1]["type"] in p.TERMINAL_EVENT_TYPES and all(e["type"] not in p.TERMINAL_EVENT_TYPES
                                                              for e in nnrp[:-1])
    text = "".join(e["delta"] for e in nnrp if e["type"] == "response.output_text.delta")
    assert text == "Paris is the capital." == nnrp[-1]["response"]["output"][0]["content"][0]["text"]
    assert nnrp[-1]["response"]["usage"]["input_tokens"] == 9
    assert nnrp[-1]["response"]["id"] == "resp_r1" and nnrp[-1]["response"]["status"] == "completed"


def test_non_streaming_response_equals_the_http_body(fixed_ids: Callable[[], None]) -> None:
    chat = {"id": "chatcmpl-r1", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."},
                         "finish_reason": "length"}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}
    http = wire_for(FORM).body(chat, CTX)
    fixed_ids()
    events = map_response(FORM, chat, CTX)
    assert events == [{"type": "response.completed", "response": http}]
    assert http["status"] == "incomplete" and http["output"][0]["content"][0]["text"] == "Paris."


def test_an_error_body_is_a_response_error() -> None:
    body = {"error": {"message": "no engine", "type": "ServiceUnavailableError", "param": None, "code": 503}}
    assert map_response(FORM, body, CTX) == [{"type": "response.error", "status": 503, "error": body["error"]}]
    mapper = ResponsesStreamMapper()
    mapper.start(FORM, CTX)
    assert [e["type"] for e in mapper.map_chunk(body)] == ["response.error"]
    assert mapper.terminated and mapper.flush() == [] and mapper.complete() is None


def test_nothing_follows_a_cancel_not_even_the_opening_events() -> None:
    mapper = ResponsesStreamMapper()
    cancelled = mapper.cancel("client", "stop", operation_id="op-1")
    assert cancelled is not None and cancelled["type"] == "response.cancelled"
    assert mapper.start(FORM, CTX) == []  # cancelled while the request was converted
    assert mapper.map_chunk(text_chunk("late")) == [] and mapper.flush() == []
    assert mapper.complete() is None and mapper.fail({"message": "x"}) is None

    midway = ResponsesStreamMapper()
    assert len(midway.start(FORM, CTX)) == 2 and midway.map_chunk(text_chunk("Hi"))
    assert midway.cancel("timeout", "timeout_ms 5 passed") is not None
    assert midway.flush() == [] and midway.complete() is None  # the open item is never closed


def test_models_list_is_the_catalogs_cards() -> None:
    catalog = ModelCatalog([ModelSettings(name="smollm2", aliases=["gpt-4o-mini"], max_model_len=2048)],
                           sidecar=None)  # type: ignore[arg-type]  # not synced: no sidecar call
    listing = catalog.model_list()
    assert [c["id"] for c in listing["data"]] == ["smollm2", "gpt-4o-mini"]
    assert listing["data"][1]["parent"] == "smollm2" and listing["data"][0]["parent"] is None
    assert listing == {"object": "list", "data": model_cards(catalog.entries()[0])}
    assert map_models(listing) == [{"type": "response.completed", "response": listing}]


def test_http_stream_failure_keeps_numbering_and_names_the_responses_field() -> None:
    """The HTTP door's own ``error`` event is numbered by the same sequence as the events before it."""
    events = http_events(CHUNKS[:2], fail=BadRequest("'max_tokens' is too large", param="max_tokens"))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1] == {"type": "error", "code": "BadRequestError", "message": "'max_output_tokens' is too large",
                          "param": "max_output_tokens", "sequence_number": len(events) - 1}


def test_the_native_chain_passes_the_engines_events_and_ends_on_its_completed() -> None:
    """Render off or down: the engine's own Responses events are the result events as they came;
    its ``response.completed`` is the terminal one, its ``error`` event the profile's
    ``response.error``, and a stream that ends without either is a failure, never a silent end."""
    from coordinator.nnrp.responses import ResponsesStreamMapper, map_native_response

    m = ResponsesStreamMapper()
    m.native()
    created = {"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1"}}
    delta = {"type": "response.output_text.delta", "sequence_number": 1, "delta": "Paris"}
    done = {"type": "response.completed", "sequence_number": 2, "response": {"id": "resp_1"}}
    assert m.map_chunk(created) + m.map_chunk(delta) + m.map_chunk(done) == [created, delta, done]
    assert m.terminated and m.map_chunk(delta) == [] and m.complete() is None
    failing = ResponsesStreamMapper()
    failing.native()
    (err,) = failing.map_chunk({"type": "error", "code": "BadRequestError", "message": "no", "param": None})
    assert err["type"] == "response.error" and failing.terminated
    cut = ResponsesStreamMapper()
    cut.native()
    cut.map_chunk(created)
    ended = cut.complete()
    assert ended is not None and ended["type"] == "response.error"
    assert map_native_response({"id": "resp_1", "output": []}) == [
        {"type": "response.completed", "response": {"id": "resp_1", "output": []}}]
    assert map_native_response({"error": {"message": "x"}})[0]["type"] == "response.error"
