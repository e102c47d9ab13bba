"""LangChain's ``ChatOpenAI`` sending an image (an OpenAI ``image_url`` content part), invoked and streamed.

Run with the tool venv's python (``.venv-compat``); prints one JSON object with the two answers for the
pytest side to judge. Usage: ``langchain_images_client.py BASE_URL MODEL DATA_URL``.
"""

from __future__ import annotations

import json
import sys

from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI


def main(base_url: str, model: str, image: str) -> None:
    llm = ChatOpenAI(base_url=base_url, api_key="unused", model=model, temperature=0, max_tokens=16,
                     max_retries=0, timeout=120)
    message = HumanMessage(content=[{"type": "text", "text": "What is in this picture?"},
                                    {"type": "image_url", "image_url": {"url": image}}])
    invoked = llm.invoke([message])
    chunks = list(llm.stream([message]))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    print(json.dumps({"invoke": invoked.content, "invoke_usage": invoked.usage_metadata,
                      "stream_text": merged.content, "stream_chunks": len(chunks)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
