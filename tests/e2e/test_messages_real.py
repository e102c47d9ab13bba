"""``/v1/messages`` on real vLLM, side by side with native ``vllm serve`` (same model, greedy).

The coordinator runs the request through the sidecar's Messages → chat conversion, chat render, a
``--tokens-only`` engine and derender, then turns the chat output into Anthropic's; the reference is
the ``--enable-scale-out`` engine answering ``/v1/messages`` itself. Text, usage, stop reason, the
event-type sequence and each event's key shape must be the native ones.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import SERVED, VllmStack, make_settings
from tests.e2e.test_wire_shape import shape
from tests.support import CoordinatorServer, generate_calls

pytestmark = pytest.mark.e2e

QUESTION: dict[str, Any] = {"model": SERVED, "max_tokens": 30, "temperature": 0,
                            "messages": [{"role": "user", "content": "What is the capital of France?"}]}


@pytest.fixture(scope="module")
def coord(vllm_stack: VllmStack) -> Iterator[CoordinatorServer]:
    with CoordinatorServer(make_settings(vllm_stack.render_url, [vllm_stack.engine.url])) as server:
        yield server


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return dict(r.json())


def events(url: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    name = None
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read().decode()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert name == data["type"], (name, data)
                out.append((name, data))
    return out


def text_of(evs: list[tuple[str, dict[str, Any]]]) -> str:
    return "".join(d["delta"].get("text", "") for n, d in evs if n == "content_block_delta")


def collapsed(evs: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, Any]]:
    """Event names with their data shape, runs of equal ones collapsed (token steps may differ)."""
    seq: list[tuple[str, Any]] = []
    for name, data in evs:
        item = (name, shape(data))
        if not seq or seq[-1] != item:
            seq.append(item)
    return seq


def test_message_equals_native(vllm_stack: VllmStack, coord: CoordinatorServer) -> None:
    native = post(f"{vllm_stack.native.url}/v1/messages", QUESTION)
    ours = post(f"{coord.url}/v1/messages", QUESTION)
    assert shape(ours) == shape(native), (ours, native)
    assert ours["content"] == native["content"] and ours["content"][0]["text"]
    assert ours["usage"] == native["usage"] and ours["stop_reason"] == native["stop_reason"]
    assert ours["type"] == "message" and ours["role"] == "assistant" and ours["model"] == SERVED


def test_stream_equals_native(vllm_stack: VllmStack, coord: CoordinatorServer) -> None:
    native = events(f"{vllm_stack.native.url}/v1/messages", QUESTION)
    ours = events(f"{coord.url}/v1/messages", QUESTION)
    assert collapsed(ours) == collapsed(native), (ours, native)
    assert text_of(ours) == text_of(native) != ""
    assert ours[-2][1]["usage"] == native[-2][1]["usage"]      # message_delta: the final usage
    assert [n for n, _ in ours][-2:] == ["message_delta", "message_stop"]


def test_stop_sequence_and_max_tokens_as_native(vllm_stack: VllmStack, coord: CoordinatorServer) -> None:
    for extra in ({"stop_sequences": [" France"]}, {"max_tokens": 3}):
        body = {**QUESTION, **extra}
        native = post(f"{vllm_stack.native.url}/v1/messages", body)
        ours = post(f"{coord.url}/v1/messages", body)
        assert (ours["content"], ours["stop_reason"], ours.get("stop_sequence")) == (
            native["content"], native["stop_reason"], native.get("stop_sequence")), extra
        assert text_of(events(f"{coord.url}/v1/messages", body)) == native["content"][0]["text"]


def test_count_tokens_equals_native(vllm_stack: VllmStack, coord: CoordinatorServer) -> None:
    body = {k: v for k, v in QUESTION.items() if k not in ("max_tokens", "temperature")}
    native = post(f"{vllm_stack.native.url}/v1/messages/count_tokens", body)
    ours = post(f"{coord.url}/v1/messages/count_tokens", body)
    assert ours == native and ours["input_tokens"] > 5


def test_served_through_the_token_only_engine(vllm_stack: VllmStack, coord: CoordinatorServer) -> None:
    """The engine behind the coordinator serves token ids only: it cannot answer /v1/messages itself;
    the coordinator's answers (JSON and stream) each cost it one token-route generate call."""
    direct = httpx.post(f"{vllm_stack.engine.url}/v1/messages", json=QUESTION, timeout=60)
    assert direct.status_code != 200   # vLLM 0.32 --tokens-only: 500, it has no Messages handler
    before = generate_calls(vllm_stack.engine.url)
    r = httpx.post(f"{coord.url}/v1/messages", json=QUESTION, timeout=300)
    assert r.status_code == 200 and "x-coordinator-route" not in r.headers
    assert text_of(events(f"{coord.url}/v1/messages", QUESTION)) != ""
    assert generate_calls(vllm_stack.engine.url) - before == 2


def test_client_errors_in_anthropic_shape(coord: CoordinatorServer) -> None:
    cases = [({k: v for k, v in QUESTION.items() if k != "max_tokens"}, 400, "invalid_request_error", "max_tokens"),
             ({**QUESTION, "model": "no-such-model"}, 404, "not_found_error", "no-such-model"),
             ({**QUESTION, "messages": []}, 400, "invalid_request_error", "messages"),
             ({**QUESTION, "temperature": 7}, 400, "invalid_request_error", "temperature")]
    for body, status, etype, word in cases:
        r = httpx.post(f"{coord.url}/v1/messages", json=body, timeout=60)
        assert r.status_code == status, (body, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == etype, err
        assert word in err["error"]["message"], err
    assert coord.wait_idle() == 0
