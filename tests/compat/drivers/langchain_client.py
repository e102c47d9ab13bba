"""LangChain's ``ChatOpenAI`` against an OpenAI-compatible server: invoke, stream and batch.

Run with the tool venv's python (``.venv-compat``); prints one JSON object with what a LangChain user
would see, for the pytest side to judge. Usage: ``langchain_client.py BASE_URL MODEL``.
"""

from __future__ import annotations

import json
import sys

from langchain_openai import ChatOpenAI


def main(base_url: str, model: str) -> None:
    llm = ChatOpenAI(base_url=base_url, api_key="unused", model=model, temperature=0, max_tokens=30,
                     max_retries=0, timeout=120)
    question = "What is the capital of France?"
    invoked = llm.invoke(question)
    chunks = list(llm.stream(question))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk  # LangChain's own accumulation (concatenates strings, merges metadata)
    batch = llm.batch(["What is the capital of Italy?", "What is the capital of Spain?"])
    print(json.dumps({
        "invoke": invoked.content,
        "invoke_finish_reason": invoked.response_metadata.get("finish_reason"),
        "invoke_usage": invoked.usage_metadata,
        "stream_chunks": len(chunks),
        "stream_text": merged.content,
        "stream_finish_reason": merged.response_metadata.get("finish_reason"),
        "batch": [m.content for m in batch],
    }))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
