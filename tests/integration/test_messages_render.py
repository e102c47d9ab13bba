"""The render sidecar's Messages → chat conversion on a real sidecar.

The coordinator serves ``/v1/messages`` on its chat path, so the chat form the sidecar answers must
render to the very token ids vLLM's own ``/v1/messages/render`` gives (what native ``vllm serve``
would feed its engine): KV-affinity placement and admission then count the tokens the engine runs.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import SERVED

TOOLS = [{"name": "get_weather", "description": "Current weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]

CONVERSATIONS: dict[str, dict[str, Any]] = {
    "plain": {"model": SERVED, "max_tokens": 20, "messages": [{"role": "user", "content": "Hello!"}]},
    "system-and-blocks": {
        "model": SERVED, "max_tokens": 20, "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["\n\n"], "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a colour."},
                                                  {"type": "text", "text": "Just one."}]},
                     {"role": "assistant", "content": "Blue."},
                     {"role": "user", "content": "Another?"}]},
    "tool-round-trip": {
        "model": SERVED, "max_tokens": 40, "tools": TOOLS, "tool_choice": {"type": "none"},  # auto needs a parser sidecar
        "messages": [{"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": [
                         {"type": "text", "text": "Checking."},
                         {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"}]}]},
}


@pytest.mark.parametrize("case", list(CONVERSATIONS))
def test_chat_form_renders_to_the_messages_render_tokens(render_sidecar: Any, case: str) -> None:
    body = CONVERSATIONS[case]
    url = str(render_sidecar.url)
    with httpx.Client(base_url=url, timeout=60) as client:
        chat = client.post("/v1/messages/chat", json=body)
        assert chat.status_code == 200, chat.text
        chat_body = chat.json()
        assert chat_body["model"] == SERVED and "system" not in chat_body
        ours = client.post("/v1/chat/completions/render", json=chat_body)
        native = client.post("/v1/messages/render", json=body)
    assert ours.status_code == native.status_code == 200, (ours.text, native.text)
    assert ours.json()["token_ids"] == native.json()["token_ids"]
    if case == "tool-round-trip":
        assert chat_body["tools"][0]["function"]["name"] == "get_weather"
        assert [m["role"] for m in chat_body["messages"]] == ["user", "assistant", "tool"]
    if case == "system-and-blocks":
        assert chat_body["stop"] == ["\n\n"] and chat_body["max_tokens"] == 20


def test_count_tokens_form_has_no_sampling_fields(render_sidecar: Any) -> None:
    body = {k: v for k, v in CONVERSATIONS["plain"].items() if k != "max_tokens"}
    r = httpx.post(f"{render_sidecar.url}/v1/messages/count_tokens/chat", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert "max_tokens" not in r.json() and r.json()["messages"] == [{"role": "user", "content": "Hello!"}]


def test_a_bad_messages_body_is_a_400_naming_the_field(render_sidecar: Any) -> None:
    body = {k: v for k, v in CONVERSATIONS["plain"].items() if k != "max_tokens"}
    r = httpx.post(f"{render_sidecar.url}/v1/messages/chat", json=body, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "max_tokens" in err["message"] and err["code"] == 400
