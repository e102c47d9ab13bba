"""LiteLLM's ``completion`` against an OpenAI-compatible server, non-stream and stream.

Run with the tool venv's python (``.venv-compat``) and ``LITELLM_LOCAL_MODEL_COST_MAP=True`` (otherwise
each start spends seconds retrying a download of its cost map). Prints one JSON object with what a
LiteLLM user would see. Usage: ``litellm_client.py BASE_URL MODEL``.
"""

from __future__ import annotations

import json
import sys

import litellm


def main(base_url: str, model: str) -> None:
    common = {"model": f"openai/{model}", "api_base": base_url, "api_key": "unused", "temperature": 0,
              "max_tokens": 30, "num_retries": 0, "timeout": 120,
              "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    full = litellm.completion(**common)
    chunks = list(litellm.completion(**common, stream=True, stream_options={"include_usage": True}))
    rebuilt = litellm.stream_chunk_builder(chunks, messages=common["messages"])
    print(json.dumps({
        "content": full.choices[0].message.content,
        "role": full.choices[0].message.role,
        "finish_reason": full.choices[0].finish_reason,
        "usage": full.usage.model_dump() if full.usage else None,
        "stream_chunks": len(chunks),
        "stream_text": "".join((c.choices[0].delta.content or "") for c in chunks if c.choices),
        "rebuilt_content": rebuilt.choices[0].message.content if rebuilt else None,
        "rebuilt_role": rebuilt.choices[0].message.role if rebuilt else None,
        "stream_usage": rebuilt.usage.model_dump() if rebuilt and rebuilt.usage else None,
    }))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
