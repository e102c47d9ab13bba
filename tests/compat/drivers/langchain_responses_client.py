"""LangChain's ``ChatOpenAI`` on the OpenAI Responses API (``use_responses_api=True``): invoke, stream
and a conversation that carries the previous answer back as input (LangChain sends no
``previous_response_id`` unless asked, so the history travels in full).

Run with the tool venv's python (``.venv-compat``); prints one JSON object with what a LangChain user
would see, for the pytest side to judge. Usage: ``langchain_responses_client.py BASE_URL MODEL``.
"""

from __future__ import annotations

import json
import sys

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI


def main(base_url: str, model: str) -> None:
    llm = ChatOpenAI(base_url=base_url, api_key="unused", model=model, temperature=0, max_tokens=30,
                     max_retries=0, timeout=120, use_responses_api=True)
    question = "What is the capital of France?"
    invoked = llm.invoke(question)
    chunks = list(llm.stream(question))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk  # LangChain's own accumulation
    history = [SystemMessage("Answer in one short sentence."), HumanMessage(question), invoked,
               HumanMessage("And of Italy?")]
    follow_up = llm.invoke(history)
    print(json.dumps({
        "invoke": invoked.text,
        "invoke_id": invoked.response_metadata.get("id"),
        "invoke_status": invoked.response_metadata.get("status"),
        "invoke_usage": invoked.usage_metadata,
        "stream_chunks": len(chunks),
        "stream_text": merged.text,
        "follow_up": follow_up.text,
    }))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
