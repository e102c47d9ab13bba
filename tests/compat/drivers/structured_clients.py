"""Structured outputs as framework users ask for them: LangChain ``with_structured_output`` and the
OpenAI Agents SDK (an ``output_type`` and a required tool), on Chat Completions and on Responses.

Run with the tool venv's python (``.venv-compat``); prints one JSON object with what each framework
handed back, for the pytest side to judge. Usage: ``structured_clients.py BASE_URL MODEL``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

ASK = "Describe a person named Ann who is 30 years old."


class Person(BaseModel):
    name: str
    age: int


class Weather(BaseModel):
    # Bounded strings: SmolLM2-135M greedy repeats itself inside an open string until max_tokens (on
    # native vLLM too); a maxLength lets the grammar close the document.
    city: str = Field(max_length=20)
    forecast: str = Field(max_length=40)


calls: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    calls.append(city)
    return f"It is sunny in {city}."


def langchain(base_url: str, model: str) -> dict[str, Any]:
    llm = ChatOpenAI(base_url=base_url, api_key="unused", model=model, temperature=0, max_tokens=60,
                     max_retries=0, timeout=120)
    person = llm.with_structured_output(Person, method="json_schema").invoke(ASK)
    return {"langchain_json_schema": person.model_dump() if isinstance(person, Person) else repr(person)}


async def agents(base_url: str, model: str) -> dict[str, Any]:
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    out: dict[str, Any] = {}
    for api, llm in (("chat", OpenAIChatCompletionsModel(model=model, openai_client=client)),
                     ("responses", OpenAIResponsesModel(model=model, openai_client=client))):
        settings = ModelSettings(temperature=0, max_tokens=80)
        person = await Runner.run(Agent(name="writer", instructions="Answer as JSON.", model=llm,
                                        output_type=Person, model_settings=settings), ASK)
        out[f"agents_{api}_output_type"] = person.final_output.model_dump()
        calls.clear()
        tool_agent = Agent(name="weather", instructions="Use the tool, then report the forecast.", model=llm,
                           tools=[get_weather], output_type=Weather,
                           model_settings=ModelSettings(temperature=0, max_tokens=120, tool_choice="required",
                                                        parallel_tool_calls=False))
        weather = await Runner.run(tool_agent, "What is the weather in Paris?", max_turns=4)
        out[f"agents_{api}_tool_calls"] = list(calls)
        out[f"agents_{api}_tool_output"] = weather.final_output.model_dump()
    out.update(await stored_agents(client, tool_agent))
    return out


async def stored_agents(client: AsyncOpenAI, tool_agent: Agent[Any]) -> dict[str, Any]:
    """The same tool agent on server-side state: each model call after the first sends only its new
    items (the tool's output) with ``previous_response_id`` (``auto_previous_response_id``), a second
    run continues the first's last response, and a third keeps its turns in a Conversation."""
    out: dict[str, Any] = {}
    calls.clear()
    first = await Runner.run(tool_agent, "What is the weather in Paris?", max_turns=4,
                             auto_previous_response_id=True)
    out["agents_chained_tool_calls"] = list(calls)
    out["agents_chained_output"] = first.final_output.model_dump()
    out["agents_chained_responses"] = len(first.raw_responses)
    calls.clear()
    second = await Runner.run(tool_agent, "And in Rome?", max_turns=4, previous_response_id=first.last_response_id,
                              auto_previous_response_id=True)
    out["agents_continued_tool_calls"] = list(calls)
    out["agents_continued_output"] = second.final_output.model_dump()
    conversation = await client.conversations.create()
    calls.clear()
    third = await Runner.run(tool_agent, "What is the weather in Oslo?", max_turns=4,
                             conversation_id=conversation.id)
    out["agents_conversation_tool_calls"] = list(calls)
    out["agents_conversation_output"] = third.final_output.model_dump()
    items = await client.conversations.items.list(conversation.id, order="asc")
    out["agents_conversation_item_types"] = [item.type for item in items.data]
    return out


def main(base_url: str, model: str) -> None:
    result = langchain(base_url, model)
    result.update(asyncio.run(agents(base_url, model)))
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
