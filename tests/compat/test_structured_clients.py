"""Structured outputs through unmodified clients: the OpenAI SDK's ``parse`` helpers (strict response
validation), LangChain ``with_structured_output`` and the OpenAI Agents SDK with an ``output_type``
and a required tool, on Chat Completions and on Responses.

The coordinator fronts the session's ``--tokens-only`` engine and its ``--enable-scale-out`` one,
with a render sidecar running the hermes tool parser (what forced tool calls need, on ``vllm serve``
too). The SDK's answers are compared with the same SDK calls against the scale-out engine's own
OpenAI API (greedy).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from pydantic import BaseModel

from tests.compat.conftest import DRIVERS, compat_bin, offline_env, run_tool, tail
from tests.conftest import SERVED, ToolStack, VllmStack, make_settings
from tests.support import CoordinatorServer

pytestmark = [pytest.mark.e2e, pytest.mark.compat]

ASK = [{"role": "user", "content": "Describe a person named Ann who is 30 years old."}]


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def coord(vllm_stack: VllmStack, tool_stack: ToolStack) -> Iterator[CoordinatorServer]:
    url = str(tool_stack.render.url)
    settings = make_settings(url, [vllm_stack.engine.url, vllm_stack.native.url],
                             render={"url": url, "parsers": True})
    with CoordinatorServer(settings) as server:
        yield server


def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                         _strict_response_validation=True)


def test_openai_sdk_parse_returns_the_pydantic_model_native_returns(
        vllm_stack: VllmStack, coord: CoordinatorServer) -> None:
    with sdk(coord.url) as ours, sdk(vllm_stack.native.url) as native:
        got = ours.chat.completions.parse(model=SERVED, messages=ASK, response_format=Person, temperature=0,
                                          max_tokens=60)  # type: ignore[arg-type]
        ref = native.chat.completions.parse(model=SERVED, messages=ASK, response_format=Person, temperature=0,
                                            max_tokens=60)  # type: ignore[arg-type]
        assert isinstance(got.choices[0].message.parsed, Person)
        assert got.choices[0].message.parsed == ref.choices[0].message.parsed
        with ours.chat.completions.stream(model=SERVED, messages=ASK, response_format=Person, temperature=0,
                                          max_tokens=60) as stream:  # type: ignore[arg-type]
            streamed = stream.get_final_completion()
        assert streamed.choices[0].message.parsed == got.choices[0].message.parsed


def test_openai_sdk_responses_parse(vllm_stack: VllmStack, coord: CoordinatorServer) -> None:
    with sdk(coord.url) as ours, sdk(vllm_stack.native.url) as native:
        got = ours.responses.parse(model=SERVED, input=ASK, text_format=Person, temperature=0,
                                   max_output_tokens=60)  # type: ignore[arg-type]
        ref = native.responses.parse(model=SERVED, input=ASK, text_format=Person, temperature=0,
                                     max_output_tokens=60)  # type: ignore[arg-type]
        assert isinstance(got.output_parsed, Person) and got.output_parsed == ref.output_parsed


def test_langchain_and_the_agents_sdk_get_their_structured_answers(coord: CoordinatorServer) -> None:
    """Before engines learned capabilities every one of these runs failed: a 400 for the schema, or
    for the Agents SDK's required tool the engine's "Structured outputs requires a tokenizer" as an
    error event after a 200. The Agents SDK also runs its tool agent on stored responses
    (``previous_response_id``) and in a Conversation."""
    proc = run_tool([compat_bin("python"), DRIVERS / "structured_clients.py", f"{coord.url}/v1", SERVED],
                    timeout=600, env=offline_env())
    assert proc.returncode == 0, tail(proc)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    person = out["langchain_json_schema"]
    assert isinstance(person, dict) and set(person) == {"name", "age"} and isinstance(person["age"], int), out
    for api in ("chat", "responses"):
        assert set(out[f"agents_{api}_output_type"]) == {"name", "age"}, out
        assert out[f"agents_{api}_tool_calls"], out  # the required tool ran
        assert set(out[f"agents_{api}_tool_output"]) == {"city", "forecast"}, out
    # Server-side state (stored responses, a Conversation): the tool loop still closes, each time.
    for run in ("chained", "continued", "conversation"):
        assert out[f"agents_{run}_tool_calls"], out
        assert set(out[f"agents_{run}_output"]) == {"city", "forecast"}, out
    assert out["agents_chained_responses"] >= 2, out  # the tool's output went back with the id alone
    kinds = out["agents_conversation_item_types"]
    assert kinds[0] == "message" and "function_call" in kinds and "function_call_output" in kinds, out
    assert coord.wait_idle() == 0
