"""``/v1/responses`` on real vLLM, side by side with native ``vllm serve`` (same model, greedy).

The coordinator runs the request through the sidecar's Responses → chat conversion, chat render, a
``--tokens-only`` engine and derender, then writes vLLM's Responses output; the reference is the
``--enable-scale-out`` engine answering ``/v1/responses`` itself. Output text, status, usage, the
response object's keys, the event-type sequence and each event's key shape must be the native ones.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import SERVED, VllmStack, make_settings
from tests.e2e.test_messages_real import collapsed, events, post  # same SSE (event: + data:) reading
from tests.e2e.test_wire_shape import as_sidecar_line, shape
from tests.support import CoordinatorServer, generate_calls

pytestmark = pytest.mark.e2e

QUESTION: dict[str, Any] = {"model": SERVED, "max_output_tokens": 30, "temperature": 0,
                            "instructions": "Answer in one sentence.",
                            "input": [{"role": "user", "content": [{"type": "input_text",
                                                                     "text": "What is the capital of France?"}]}]}
# Fields that differ between any two responses (ids, clock).
VOLATILE = ("id", "created_at", "item_id")


@pytest.fixture(scope="module")
def coord(vllm_stack: VllmStack) -> Iterator[CoordinatorServer]:
    with CoordinatorServer(make_settings(vllm_stack.render_url, [vllm_stack.engine.url])) as server:
        yield server


def text_of(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def stable(value: Any) -> Any:
    """``value`` without ids and clocks (random on both sides)."""
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [stable(v) for v in value]
    return value


def test_response_equals_native(vllm_stack: VllmStack, coord: CoordinatorServer) -> None:
    native = as_sidecar_line(post(f"{vllm_stack.native.url}/v1/responses", QUESTION))
    ours = post(f"{coord.url}/v1/responses", QUESTION)
    assert shape(ours) == shape(native), (ours, native)
    assert stable(ours) == stable(native)  # output items, usage, status and every echoed field
    assert "Paris" in text_of(ours) and ours["status"] == "completed"
    assert ours["id"].startswith("resp_") and ours["output"][0]["id"].startswith("msg_")


def test_stream_equals_native(vllm_stack: VllmStack, coord: CoordinatorServer) -> None:
    native = as_sidecar_line(events(f"{vllm_stack.native.url}/v1/responses", QUESTION))
    ours = events(f"{coord.url}/v1/responses", QUESTION)
    assert collapsed(ours) == collapsed(native), (ours, native)
    assert [d["sequence_number"] for _, d in ours] == list(range(len(ours)))
    deltas = "".join(d["delta"] for n, d in ours if n == "response.output_text.delta")
    completed = ours[-1][1]["response"]
    assert ours[-1][0] == "response.completed" and deltas == text_of(completed) != ""
    assert stable(completed) == stable(native[-1][1]["response"])
    assert completed["id"] == ours[0][1]["response"]["id"]  # one response from created to completed


def test_max_output_tokens_is_incomplete_as_native(vllm_stack: VllmStack, coord: CoordinatorServer) -> None:
    body = {**QUESTION, "max_output_tokens": 3}
    native = as_sidecar_line(post(f"{vllm_stack.native.url}/v1/responses", body))
    ours = post(f"{coord.url}/v1/responses", body)
    assert stable(ours) == stable(native)
    assert ours["status"] == "incomplete" and ours["incomplete_details"] == {"reason": "max_output_tokens"}
    assert ours["usage"]["output_tokens"] == 3
    assert events(f"{coord.url}/v1/responses", body)[-1][1]["response"]["status"] == "incomplete"


def test_served_through_the_token_only_engine(vllm_stack: VllmStack, coord: CoordinatorServer) -> None:
    """The engine behind the coordinator serves token ids only: it cannot answer /v1/responses itself;
    the coordinator's answers (JSON and stream) each cost it one token-route generate call."""
    direct = httpx.post(f"{vllm_stack.engine.url}/v1/responses", json=QUESTION, timeout=60)
    assert direct.status_code != 200
    before = generate_calls(vllm_stack.engine.url)
    r = httpx.post(f"{coord.url}/v1/responses", json=QUESTION, timeout=300)
    assert r.status_code == 200 and "x-coordinator-route" not in r.headers
    events(f"{coord.url}/v1/responses", QUESTION)
    assert generate_calls(vllm_stack.engine.url) - before == 2


def test_client_errors_name_the_responses_field(coord: CoordinatorServer) -> None:
    cases = [({**QUESTION, "previous_response_id": "resp_1"}, 404, "previous_response_id"),
             ({**QUESTION, "background": True, "store": False}, 400, "background"),
             ({**QUESTION, "tools": [{"type": "web_search_preview"}]}, 400, "tools[0].type"),
             ({**QUESTION, "model": "no-such-model"}, 404, "model"),
             ({**QUESTION, "temperature": 7}, 400, "temperature"),
             ({**QUESTION, "text": {"format": {"type": "json_object"}}}, 400, "text"),
             ({k: v for k, v in QUESTION.items() if k != "input"}, 400, "input")]
    for body, status, param in cases:
        r = httpx.post(f"{coord.url}/v1/responses", json=body, timeout=60)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, r.text


def test_a_stored_conversation_answers_as_native_with_its_store(vllm_stack: VllmStack,
                                                                coord: CoordinatorServer) -> None:
    """Three turns chained by ``previous_response_id``, instructions changing on the way, against
    native ``vllm serve`` with ``VLLM_ENABLE_RESPONSES_API_STORE``: the same texts turn by turn, and
    what retrieve answers is what create answered."""
    turns = [{"instructions": "Answer in one sentence.", "input": "My name is Ada. What is the capital of France?"},
             {"input": "What is my name?"},
             {"instructions": "Answer with one word.", "input": "And the capital of Italy?"}]
    previous: dict[str, str | None] = {"ours": None, "native": None}
    for turn in turns:
        answers = {}
        for side, url in (("ours", coord.url), ("native", vllm_stack.native.url)):
            body = {"model": SERVED, "max_output_tokens": 24, "temperature": 0, **turn}
            if previous[side] is not None:
                body["previous_response_id"] = previous[side]
            answers[side] = post(f"{url}/v1/responses", body)
            previous[side] = answers[side]["id"]
        ours, native = answers["ours"], as_sidecar_line(answers["native"])
        assert text_of(ours) == text_of(native) != "", (turn, ours, native)
        assert ours["usage"]["input_tokens"] == native["usage"]["input_tokens"]
        assert (ours["previous_response_id"] is None) is (turn is turns[0])
        got = httpx.get(f"{coord.url}/v1/responses/{ours['id']}", timeout=30)
        assert got.status_code == 200 and got.json() == ours


def test_a_background_run_ends_with_the_answer_native_gives(vllm_stack: VllmStack, coord: CoordinatorServer) -> None:
    """``background: true`` answers ``queued`` at once; polled, the run ends with native's text."""
    native = as_sidecar_line(post(f"{vllm_stack.native.url}/v1/responses", QUESTION))
    queued = post(f"{coord.url}/v1/responses", {**QUESTION, "background": True})
    assert queued["status"] == "queued" and queued["background"] is True
    deadline = time.monotonic() + 120
    while (done := httpx.get(f"{coord.url}/v1/responses/{queued['id']}", timeout=30).json())["status"] in (
            "queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert done["status"] == "completed" and text_of(done) == text_of(native) != ""
    assert done["usage"] == native["usage"]
