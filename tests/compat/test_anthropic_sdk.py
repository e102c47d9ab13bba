"""The official ``anthropic`` Python SDK, unmodified, against the real stack's ``/v1/messages``.

``_strict_response_validation=True`` makes the SDK validate every message and stream event with its
own models; ``max_retries=0`` lets a server error surface instead of being retried away.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import pytest

from tests.conftest import SERVED
from tests.support import CoordinatorServer

pytestmark = [pytest.mark.e2e, pytest.mark.compat]

# This SDK's create() no longer takes temperature; greedy goes as an extra body field.
GREEDY = {"temperature": 0}
QUESTION: list[anthropic.types.MessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(compat_coord: CoordinatorServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=compat_coord.url, api_key="unused", max_retries=0,
                             _strict_response_validation=True) as c:
        yield c


@pytest.fixture(scope="module")
def greedy(client: anthropic.Anthropic) -> anthropic.types.Message:
    return client.messages.create(model=SERVED, max_tokens=30, messages=QUESTION, extra_body=GREEDY,
                                  system="Answer in one short sentence.")


def test_create(greedy: anthropic.types.Message) -> None:
    assert greedy.role == "assistant" and greedy.type == "message"
    assert greedy.content[0].type == "text" and "Paris" in greedy.content[0].text
    assert greedy.stop_reason in ("end_turn", "max_tokens")
    assert greedy.usage.input_tokens > 5 and 0 < greedy.usage.output_tokens <= 30


def test_create_stream_events(client: anthropic.Anthropic, greedy: anthropic.types.Message) -> None:
    with client.messages.create(model=SERVED, max_tokens=30, messages=QUESTION, extra_body=GREEDY,
                                system="Answer in one short sentence.", stream=True) as stream:
        evs = list(stream)
    kinds = [e.type for e in evs]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    text = "".join(e.delta.text for e in evs if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert greedy.content[0].type == "text" and text == greedy.content[0].text


def test_stream_helper(client: anthropic.Anthropic, greedy: anthropic.types.Message) -> None:
    with client.messages.stream(model=SERVED, max_tokens=30, messages=QUESTION, extra_body=GREEDY,
                                system="Answer in one short sentence.") as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert greedy.content[0].type == "text" and text == greedy.content[0].text
    assert final.usage.output_tokens == greedy.usage.output_tokens
    assert final.stop_reason == greedy.stop_reason


def test_count_tokens(client: anthropic.Anthropic, greedy: anthropic.types.Message) -> None:
    counted = client.messages.count_tokens(model=SERVED, messages=QUESTION,
                                           system="Answer in one short sentence.")
    assert counted.input_tokens == greedy.usage.input_tokens


def test_tool_result_round_trip(client: anthropic.Anthropic) -> None:
    """A conversation carrying a tool_use and its tool_result is accepted and answered (the sidecar of
    this stack has no tool-call parser, so the model's answer is text)."""
    tools: list[anthropic.types.ToolParam] = [{
        "name": "get_weather", "description": "Current weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    msg = client.messages.create(model=SERVED, max_tokens=20, extra_body=GREEDY, tools=tools,
                                 tool_choice={"type": "none"}, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": json.dumps({"sky": "sunny"})}]}])
    assert msg.content and msg.usage.output_tokens > 0


def test_errors_are_the_sdks_exceptions(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=5, messages=QUESTION)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=SERVED, max_tokens=5, messages=[])
    assert "messages" in str(bad.value)
