"""The per-chunk derender call must not grow with the conversation."""

import json

from coordinator.pipeline.context import RequestContext
from coordinator.pipeline.derender.client import request_view


def ctx(kind: str, body: dict) -> RequestContext:
    return RequestContext(kind=kind, request_id="r", body=body, model="m", stream=True,  # type: ignore[arg-type]
                          include_usage=False)


def test_chat_view_keeps_options_but_not_the_conversation() -> None:
    history = [{"role": "user", "content": "x" * 10_000}] * 50
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    body = {"model": "m", "messages": history, "tools": tools, "tool_choice": "auto", "skip_special_tokens": False}
    view = request_view(ctx("chat", body))
    assert len(json.dumps(view)) < 500
    assert (view["tools"], view["tool_choice"], view["skip_special_tokens"]) == (tools, "auto", False)
    assert body["messages"] is history, "the client request itself is untouched"


def test_completion_view_drops_the_prompts() -> None:
    view = request_view(ctx("completion", {"model": "m", "prompt": ["a" * 5000] * 10, "logprobs": 2}))
    assert len(json.dumps(view)) < 200 and view["logprobs"] == 2
