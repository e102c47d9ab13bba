"""Responses and stream chunks have exactly the keys native ``vllm serve`` sends for the same request.

The reference is a ``--enable-scale-out`` engine serving ``/v1/chat/completions`` and
``/v1/completions`` itself (same vLLM, same model); the coordinator runs the same request through
render, a ``--tokens-only`` engine and derender. Values (ids, timestamps, sampled text, logprobs,
fingerprints) may differ; the *shape* may not.

What is compared, and why it is fair but strict:

* **Shape of one object.** A dict's shape is its keys, each mapped to the shape of its value; a
  scalar's shape is its JSON type (``null``, ``str``, ``num``, ``bool``), so ``null`` where native
  sends a string or object (or the reverse) is a difference, while different text is not. A list's
  shape is the set of its items' shapes (token lists, logprob lists and ``bytes`` vary in length
  with the text, not with the wire format). Completion ``top_logprobs`` entries are maps keyed by
  token text, so only their value types count.
* **Non-streaming.** The whole response's shape must be equal.
* **Streaming.** Chunks are grouped by choice index, in arrival order, and within a choice runs of
  consecutive chunks with the same shape are collapsed into one: the engine may hand tokens to the
  two servers in differently sized steps, and a sampled choice may be longer on one side, but the
  sequence "role chunk → content chunks → finishing chunk" (and any extra step in between, such as
  a tool call's first delta) must be identical per choice. Choice-less chunks (the usage chunk)
  are compared as their own sequence and must come after every choice chunk. Both streams end
  with one ``[DONE]``.

Tool calls: SmolLM2-135M answers with ``<tool_call>{...}</tool_call>`` greedily when the
conversation shows it doing so twice, so the reference is a native engine started with
``--enable-auto-tool-choice --tool-call-parser hermes`` and the coordinator uses a render sidecar
with the same parser flags. The test first checks that native really produced a tool call.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import SERVED, ToolStack, VllmStack, make_settings
from tests.support import CoordinatorServer
from token_engine.vllm_env import render_python, vllm_line

pytestmark = pytest.mark.e2e

Shape = Any

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


# -- shapes --------------------------------------------------------------------------------------

def shape(value: Any, key: str | None = None) -> Shape:
    """Nested key structure of a JSON value (see the module docstring)."""
    if isinstance(value, dict):
        if key == "top_logprobs":  # completions: {token text: logprob}
            return {"<token>": _union([shape(v) for v in value.values()])}
        return {k: shape(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return _union([shape(v, key) for v in value])
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "num"
    return "str"


def _union(shapes: list[Shape]) -> list[Shape]:
    distinct = {json.dumps(s, sort_keys=True): s for s in shapes}
    return [distinct[k] for k in sorted(distinct)]


def stream_shape(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per choice index: the collapsed sequence of chunk shapes; then the choice-less chunks."""
    per_choice: dict[int, list[Shape]] = {}
    trailer: list[Shape] = []
    for chunk in chunks:
        s = shape(chunk)
        if chunk.get("choices"):
            assert not trailer, "a choice chunk came after the usage chunk"
            assert len(chunk["choices"]) == 1, chunk
            seq = per_choice.setdefault(int(chunk["choices"][0]["index"]), [])
            if not seq or seq[-1] != s:
                seq.append(s)
        else:
            trailer.append(s)
    return {"choices": per_choice, "trailer": trailer}


def read_stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read().decode()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]" and lines.count("[DONE]") == 1, lines[-3:]
    chunks = [json.loads(line) for line in lines[:-1]]
    assert not any("error" in c for c in chunks), chunks
    return chunks


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return dict(r.json())


# Fields a newer render sidecar's response models have and the reference's (0.32) lack: a non-streamed
# body carries them, ``null``, as the newer line's native server would (stream chunks drop them, as
# native's ``exclude_unset`` does: ``coordinator/pipeline/derender/shape.py``; docs/versions.md).
NEWER_FIELDS: dict[tuple[int, int], dict[str, dict[str, None]]] = {
    (0, 33): {"choice": {"weight_versions": None},
              "response": {"prompt_cache_key": None, "prompt_cache_options": None,
                           "prompt_cache_retention": None, "safety_identifier": None}},
}


def as_sidecar_line(native: Any) -> Any:
    """The native reference as the render sidecar's line writes it: its added fields in place."""
    added = NEWER_FIELDS.get(vllm_line(render_python()) or (0, 0))
    if added is None:
        return native

    def walk(value: Any, in_choices: bool = False) -> Any:
        if isinstance(value, list | tuple):
            return type(value)(walk(v, in_choices) for v in value)
        if not isinstance(value, dict):
            return value
        out = {k: walk(v, k == "choices") for k, v in value.items()}
        extra = added["choice"] if in_choices else added["response"] if out.get("object") == "response" else {}
        return {**out, **{k: v for k, v in extra.items() if k not in out}}

    return walk(native)


def assert_same_shape(native_base: str, coord_base: str, route: str, body: dict[str, Any]) -> None:
    if body.get("stream"):
        native = read_stream(native_base + route, body)
        ours = read_stream(coord_base + route, body)
        assert stream_shape(ours) == stream_shape(native), (
            f"native:\n{_dump(native)}\nours:\n{_dump(ours)}")
    else:
        native_body = as_sidecar_line(post(native_base + route, body))
        ours_body = post(coord_base + route, body)
        assert shape(ours_body) == shape(native_body), f"native: {native_body}\nours: {ours_body}"


def _dump(chunks: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(c) for c in chunks[:12])


# -- plain model -----------------------------------------------------------------------------------

def chat(**extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": QUESTION, "temperature": 0, "max_tokens": 40, **extra}


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "prompt": PROMPT, "temperature": 0, "max_tokens": 12, **extra}


SAMPLED = {"temperature": 0.8, "seed": 7, "n": 2}  # vLLM refuses n > 1 with greedy sampling
USAGE = {"stream_options": {"include_usage": True}}
LOGPROBS_CHAT = {"logprobs": True, "top_logprobs": 2}

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", chat()),
    "chat-stream": ("/v1/chat/completions", chat(stream=True)),
    "chat-stream-usage": ("/v1/chat/completions", chat(stream=True, **USAGE)),
    "chat-stream-continuous-usage": ("/v1/chat/completions", chat(
        stream=True, max_tokens=6, stream_options={"include_usage": True, "continuous_usage_stats": True})),
    "chat-n2": ("/v1/chat/completions", chat(max_tokens=8, **SAMPLED)),
    "chat-stream-n2": ("/v1/chat/completions", chat(stream=True, max_tokens=8, **SAMPLED)),
    "chat-stream-n2-usage": ("/v1/chat/completions", chat(stream=True, max_tokens=8, **SAMPLED, **USAGE)),
    "chat-logprobs": ("/v1/chat/completions", chat(max_tokens=8, **LOGPROBS_CHAT)),
    "chat-stream-logprobs": ("/v1/chat/completions", chat(stream=True, **LOGPROBS_CHAT)),
    "completion": ("/v1/completions", completion()),
    "completion-stream": ("/v1/completions", completion(stream=True)),
    "completion-stream-usage": ("/v1/completions", completion(stream=True, **USAGE)),
    "completion-n2": ("/v1/completions", completion(**SAMPLED)),
    "completion-stream-n2-usage": ("/v1/completions", completion(stream=True, **SAMPLED, **USAGE)),
    "completion-logprobs": ("/v1/completions", completion(logprobs=2)),
    "completion-stream-logprobs": ("/v1/completions", completion(stream=True, logprobs=2)),
    "completion-two-prompts": ("/v1/completions", completion(prompt=[PROMPT, "Hello, my name is"])),
    "completion-stream-two-prompts-usage": ("/v1/completions", completion(
        prompt=[PROMPT, "Hello, my name is"], stream=True, logprobs=2, **USAGE)),
}


@pytest.fixture(scope="module")
def coord(vllm_stack: VllmStack) -> Iterator[CoordinatorServer]:
    with CoordinatorServer(make_settings(vllm_stack.render_url, [vllm_stack.engine.url])) as server:
        yield server


@pytest.mark.parametrize("case", list(CASES))
def test_same_keys_as_native(vllm_stack: VllmStack, coord: CoordinatorServer, case: str) -> None:
    route, body = CASES[case]
    assert_same_shape(str(vllm_stack.native.url), coord.url, route, body)


def test_stream_opens_with_a_role_chunk_and_has_no_nulls_native_omits(
        vllm_stack: VllmStack, coord: CoordinatorServer) -> None:
    """The concrete differences this guards, spelled out (the shape test above is the general rule)."""
    chunks = read_stream(coord.url + "/v1/chat/completions", chat(stream=True, **USAGE))
    first, content, last, usage = chunks[0], chunks[1], chunks[-2], chunks[-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    for c in chunks[1:-1]:
        assert set(c) == {"id", "object", "created", "model", "choices"}
        assert "role" not in c["choices"][0]["delta"] and "reasoning" not in c["choices"][0]["delta"]
    assert "stop_reason" not in content["choices"][0]
    assert last["choices"][0]["finish_reason"] == "stop" and last["choices"][0]["stop_reason"] is None
    assert usage["choices"] == [] and isinstance(usage["system_fingerprint"], str)
    assert set(usage["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}


# -- tool calls ------------------------------------------------------------------------------------

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather in a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"]}},
}


def _call(city: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': {'city': city}})}\n</tool_call>"


TOOL_CHAT: dict[str, Any] = {
    "model": SERVED, "tools": [WEATHER_TOOL], "temperature": 0, "max_tokens": 60,
    "messages": [
        {"role": "system", "content": "You call tools. Answer every question with exactly one tool call."},
        {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": _call("Paris")},
        {"role": "user", "content": "Weather in Rome?"}, {"role": "assistant", "content": _call("Rome")},
        {"role": "user", "content": "Weather in Berlin?"},
    ],
}


class ToolCoord:
    def __init__(self, native_url: str, coord_url: str) -> None:
        self.native_url = native_url
        self.coord_url = coord_url


@pytest.fixture(scope="module")
def tools(vllm_stack: VllmStack, tool_stack: ToolStack) -> Iterator[ToolCoord]:
    """The hermes render sidecar for the coordinator and the hermes native reference."""
    url = str(tool_stack.render.url)
    settings = make_settings(url, [vllm_stack.engine.url], render={"url": url, "parsers": True})
    with CoordinatorServer(settings) as server:
        yield ToolCoord(str(tool_stack.native.url), server.url)


def test_tool_call_same_keys_as_native(tools: ToolCoord) -> None:
    native = post(tools.native_url + "/v1/chat/completions", TOOL_CHAT)
    assert native["choices"][0]["message"].get("tool_calls"), native  # the prompt still makes a call
    assert_same_shape(tools.native_url, tools.coord_url, "/v1/chat/completions", TOOL_CHAT)


def test_tool_call_stream_same_keys_as_native(tools: ToolCoord) -> None:
    body = {**TOOL_CHAT, "stream": True}
    native = read_stream(tools.native_url + "/v1/chat/completions", body)
    assert any(c["choices"][0]["delta"].get("tool_calls") for c in native if c["choices"]), native
    assert_same_shape(tools.native_url, tools.coord_url, "/v1/chat/completions", body)
    assert_same_shape(tools.native_url, tools.coord_url, "/v1/chat/completions", {**body, **USAGE})


# -- Anthropic Messages with tools ---------------------------------------------------------------------

def _messages_call(city: str) -> dict[str, Any]:
    return {"role": "assistant", "content": _call(city)}


TOOL_MESSAGES: dict[str, Any] = {
    "model": SERVED, "temperature": 0, "max_tokens": 60,
    "system": "You call tools. Answer every question with exactly one tool call.",
    "tools": [{"name": "get_weather", "description": "Current weather in a city",
               "input_schema": WEATHER_TOOL["function"]["parameters"]}],
    "messages": [{"role": "user", "content": "Weather in Paris?"}, _messages_call("Paris"),
                 {"role": "user", "content": "Weather in Rome?"}, _messages_call("Rome"),
                 {"role": "user", "content": "Weather in Berlin?"}],
}


def _anthropic_events(url: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    name = ""
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read().decode()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[len("data: "):])))
    return out


def _collapsed(events: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, Shape]]:
    seq: list[tuple[str, Shape]] = []
    for name, data in events:
        if not seq or seq[-1] != (name, shape(data)):
            seq.append((name, shape(data)))
    return seq


def test_messages_tool_use_same_as_native(tools: ToolCoord) -> None:
    native = post(tools.native_url + "/v1/messages", TOOL_MESSAGES)
    assert [b["type"] for b in native["content"]][-1] == "tool_use", native  # the prompt still calls
    ours = post(tools.coord_url + "/v1/messages", TOOL_MESSAGES)
    assert shape(ours) == shape(native), f"native: {native}\nours: {ours}"
    strip = [{k: v for k, v in b.items() if k != "id"} for b in ours["content"]]
    assert strip == [{k: v for k, v in b.items() if k != "id"} for b in native["content"]]
    assert ours["stop_reason"] == native["stop_reason"] == "tool_use" and ours["usage"] == native["usage"]


def test_messages_tool_use_stream_same_as_native(tools: ToolCoord) -> None:
    native = _anthropic_events(tools.native_url + "/v1/messages", TOOL_MESSAGES)
    ours = _anthropic_events(tools.coord_url + "/v1/messages", TOOL_MESSAGES)
    assert _collapsed(ours) == _collapsed(native), f"native:\n{native}\nours:\n{ours}"

    def args(events: list[tuple[str, dict[str, Any]]]) -> str:
        return "".join(d["delta"].get("partial_json", "") for n, d in events if n == "content_block_delta")

    assert args(ours) == args(native) != ""
    assert "city" in json.loads(args(ours))


# -- OpenAI Responses with tools --------------------------------------------------------------------

TOOL_RESPONSES: dict[str, Any] = {
    "model": SERVED, "temperature": 0, "max_output_tokens": 60,
    "instructions": "You call tools. Answer every question with exactly one tool call.",
    "tools": [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
               "parameters": WEATHER_TOOL["function"]["parameters"]}],
    "input": [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": _call("Paris")},
              {"role": "user", "content": "Weather in Rome?"}, {"role": "assistant", "content": _call("Rome")},
              {"role": "user", "content": "Weather in Berlin?"}],
}


def _without_ids(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k not in ("id", "created_at", "item_id")}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def test_responses_function_call_same_as_native(tools: ToolCoord) -> None:
    native = as_sidecar_line(post(tools.native_url + "/v1/responses", TOOL_RESPONSES))
    assert [i["type"] for i in native["output"]][-1] == "function_call", native  # the prompt still calls
    ours = post(tools.coord_url + "/v1/responses", TOOL_RESPONSES)
    assert shape(ours) == shape(native), f"native: {native}\nours: {ours}"
    # call_id too: both take the parser's id of the call
    assert [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in ours["output"]] == [
        {k: v for k, v in i.items() if k not in ("id", "call_id")} for i in native["output"]]
    assert _without_ids(ours)["usage"] == _without_ids(native)["usage"]
    assert json.loads(ours["output"][-1]["arguments"]) == {"city": "Berlin"}


def test_responses_function_call_stream_same_as_native(tools: ToolCoord) -> None:
    native = as_sidecar_line(_anthropic_events(tools.native_url + "/v1/responses", TOOL_RESPONSES))
    ours = _anthropic_events(tools.coord_url + "/v1/responses", TOOL_RESPONSES)
    assert _collapsed(ours) == _collapsed(native), f"native:\n{native}\nours:\n{ours}"

    def args(events: list[tuple[str, dict[str, Any]]]) -> str:
        return "".join(d["delta"] for n, d in events if n == "response.function_call_arguments.delta")

    assert args(ours) == args(native) != ""
    done = ours[-1][1]["response"]
    assert done["output"][-1]["arguments"] == args(ours) and done["status"] == "completed"
