"""The official OpenAI Python SDK's ``responses`` resource in strict mode against the real stack.

``_strict_response_validation=True`` validates every response object and every stream event with
the SDK's pydantic models; ``max_retries=0`` surfaces server errors instead of retrying them away.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.conftest import SERVED
from tests.support import CoordinatorServer

pytestmark = [pytest.mark.e2e, pytest.mark.compat]

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(compat_coord: CoordinatorServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{compat_coord.url}/v1", api_key="unused", max_retries=0,
                       _strict_response_validation=True) as c:
        yield c


@pytest.fixture(scope="module")
def greedy(client: openai.OpenAI) -> openai.types.responses.Response:
    return client.responses.create(model=SERVED, input=QUESTION, temperature=0, max_output_tokens=30)


def test_create(greedy: openai.types.responses.Response) -> None:
    assert greedy.status == "completed" and greedy.object == "response" and greedy.model == SERVED
    assert "Paris" in greedy.output_text
    assert greedy.usage is not None and greedy.usage.output_tokens > 0
    assert greedy.usage.total_tokens == greedy.usage.input_tokens + greedy.usage.output_tokens


def test_stream_equals_create(client: openai.OpenAI, greedy: openai.types.responses.Response) -> None:
    with client.responses.create(model=SERVED, input=QUESTION, temperature=0, max_output_tokens=30,
                                 stream=True) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == greedy.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.usage is not None
    assert final.usage.output_tokens == greedy.usage.output_tokens  # type: ignore[union-attr]


def test_stream_helper_final_response(client: openai.OpenAI, greedy: openai.types.responses.Response) -> None:
    """The ``responses.stream()`` helper accumulates the events into the final response itself."""
    with client.responses.stream(model=SERVED, input=QUESTION, temperature=0, max_output_tokens=30) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == greedy.output_text


def test_conversation_in_input_items(client: openai.OpenAI, greedy: openai.types.responses.Response) -> None:
    """A second turn carries the first answer's output items back as input (stateless history)."""
    second = client.responses.create(
        model=SERVED, temperature=0, max_output_tokens=30, instructions="Answer in one short sentence.",
        input=[{"role": "user", "content": QUESTION}, *[i.model_dump() for i in greedy.output],
               {"role": "user", "content": "And of Italy?"}])
    assert "Rome" in second.output_text and second.id != greedy.id


def test_errors_are_typed(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input=QUESTION)
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=SERVED, input=QUESTION, previous_response_id="resp_0")
    assert "previous_response_id" in str(bad.value)
