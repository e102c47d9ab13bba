"""The official OpenAI Python SDK's ``responses`` resource in strict mode against the real stack.

``_strict_response_validation=True`` validates every response object and every stream event with
the SDK's pydantic models; ``max_retries=0`` surfaces server errors instead of retrying them away.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.conftest import SERVED, VllmStack
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
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=SERVED, input=QUESTION, previous_response_id="resp_0")
    assert "resp_0" in str(missing.value) and missing.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=SERVED, input=QUESTION, background=True, store=False)
    assert "background" in str(bad.value)


def test_stored_responses_through_the_strict_sdk(client: openai.OpenAI, vllm_stack: VllmStack) -> None:
    """Every stored-response call the SDK makes, each answer validated by its models: a chain whose
    texts equal native vLLM's with its store on, retrieve, input items, delete; a background run
    resumed by sequence number; a conversation's items."""
    with openai.OpenAI(base_url=f"{vllm_stack.native.url}/v1", api_key="unused", max_retries=0) as native:
        ours_first = client.responses.create(model=SERVED, input="My name is Ada.", temperature=0,
                                             max_output_tokens=16)
        native_first = native.responses.create(model=SERVED, input="My name is Ada.", temperature=0,
                                               max_output_tokens=16)
        ours = client.responses.create(model=SERVED, input="What is my name?", temperature=0,
                                       max_output_tokens=16, previous_response_id=ours_first.id)
        theirs = native.responses.create(model=SERVED, input="What is my name?", temperature=0,
                                         max_output_tokens=16, previous_response_id=native_first.id)
    assert ours.output_text == theirs.output_text != "" and ours.previous_response_id == ours_first.id
    assert client.responses.retrieve(ours.id).output_text == ours.output_text
    assert [i.type for i in client.responses.input_items.list(ours.id).data] == ["message"]
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(ours.id)  # a finished, synchronous response
    client.responses.delete(ours_first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ours_first.id)

    queued = client.responses.create(model=SERVED, input=QUESTION, temperature=0, max_output_tokens=30,
                                     background=True)
    assert queued.status == "queued" and queued.background
    with client.responses.retrieve(queued.id, stream=True, starting_after=1) as events:
        seen = list(events)
    assert seen[0].sequence_number == 2 and seen[-1].type == "response.completed"
    assert seen[-1].response.output_text == client.responses.retrieve(queued.id).output_text  # type: ignore[union-attr]

    conversation = client.conversations.create(items=[{"type": "message", "role": "user", "content": "Hi!"}])
    answer = client.responses.create(model=SERVED, input=QUESTION, temperature=0, max_output_tokens=8,
                                     conversation=conversation.id)
    assert answer.conversation is not None and answer.conversation.id == conversation.id
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [i.type for i in items] == ["message", "message", "message"]
    client.conversations.delete(conversation.id)
