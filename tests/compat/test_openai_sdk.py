"""The official OpenAI Python SDK in strict mode against the real stack.

With ``_strict_response_validation=True`` the SDK validates every response and every chat stream
chunk with its pydantic models and raises ``APIResponseValidationError`` on a shape it does not
accept; ``max_retries=0`` makes a server error surface instead of being retried away. (Completion
*streams* are left out: the SDK's non-optional ``finish_reason`` rejects every legitimate
intermediate chunk, an SDK limitation; tests/compat/test_spec_conformance.py validates them.)
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.conftest import SERVED
from tests.support import CoordinatorServer

pytestmark = [pytest.mark.e2e, pytest.mark.compat]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(compat_coord: CoordinatorServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{compat_coord.url}/v1", api_key="unused", max_retries=0,
                       _strict_response_validation=True) as c:
        yield c


@pytest.fixture(scope="module")
def greedy_answer(client: openai.OpenAI) -> str:
    r = client.chat.completions.create(model=SERVED, messages=QUESTION, temperature=0, max_tokens=30)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    return r.choices[0].message.content or ""


def test_chat_non_stream(greedy_answer: str) -> None:
    assert "Paris" in greedy_answer


def test_chat_stream_equals_non_stream(client: openai.OpenAI, greedy_answer: str) -> None:
    with client.chat.completions.create(model=SERVED, messages=QUESTION, temperature=0, max_tokens=30,
                                        stream=True, stream_options={"include_usage": True}) as stream:
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy_answer
    roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == ["assistant"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_chat_stream_helper_snapshot(client: openai.OpenAI, greedy_answer: str) -> None:
    """The ``.stream()`` helper concatenates repeated string fields: a role sent in every delta would
    show up as 'assistantassistant…' in the accumulated message."""
    with client.chat.completions.stream(model=SERVED, messages=QUESTION, temperature=0, max_tokens=30) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        snapshot = stream.current_completion_snapshot
    message = snapshot.choices[0].message
    assert message.role == "assistant"
    assert message.content and message.content == "".join(deltas) == greedy_answer


def test_completions_non_stream(client: openai.OpenAI) -> None:
    r = client.completions.create(model=SERVED, prompt="The capital of France is", temperature=0, max_tokens=8)
    assert "Paris" in r.choices[0].text
    assert r.choices[0].finish_reason in ("stop", "length")


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    ids = {m.id for m in client.models.list()}
    assert {SERVED, "gpt-4o-mini"} <= ids
    for model in (SERVED, "gpt-4o-mini"):
        assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
