"""Tool-call and reasoning output through a parser-configured render sidecar, relayed by the coordinator.

SmolLM2 has no reasoning or tool-call tokens of its own, so the sidecar runs parsers that match on
plain text: ``olmo3`` (reasoning between ``<think>`` and ``</think>``, which SmolLM2 spells with
ordinary vocabulary tokens) and ``hermes`` (``<tool_call>{json}</tool_call>``). Parsers that look
their markers up as single vocabulary entries (``deepseek_r1``, ``llama3_json``, ...) refuse this
tokenizer. A scripted simulated engine emits the tokenizer's encoding of a known model output, then
EOS, exactly like a ``--tokens-only`` engine; the sidecar's own derender of those token ids is the
reference for what the coordinator must relay.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import MAX_MODEL_LEN, SERVED, make_settings
from tests.support import CoordinatorServer, free_port, sse_events

EOS = 2  # SmolLM2's <|im_end|>; a --tokens-only engine stops on it with stop_reason 2

THOUGHT = "Let me check the weather."
ANSWER = "It is sunny."
REASONING_OUTPUT = f"<think>{THOUGHT}</think>{ANSWER}"

TOOL_THOUGHT = "The user wants the weather."
TOOL_ARGS = {"city": "Paris", "unit": "celsius"}
# The newline after </think> keeps "</think>" as the tokens "</", "think", ">" (">" and "<" would
# merge into one "><" token, which olmo3's end-of-reasoning check does not recognise).
TOOL_OUTPUT = (f"<think>{TOOL_THOUGHT}</think>\n<tool_call>\n"
               f"{json.dumps({'name': 'get_weather', 'arguments': TOOL_ARGS})}\n</tool_call>")

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string"},
                                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"]},
    },
}

MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")


class ParserStack:
    """One parser-configured sidecar; one scripted engine + coordinator per distinct model output."""

    def __init__(self, render: Any, stack: contextlib.ExitStack) -> None:
        self.render = render
        self._stack = stack
        self._coords: dict[str, tuple[CoordinatorServer, list[int]]] = {}
        self.sims: dict[str, Any] = {}  # the scripted engine behind each coordinator, by the same key

    @property
    def render_url(self) -> str:
        return str(self.render.url)

    def tokenize(self, text: str) -> list[int]:
        r = httpx.post(f"{self.render_url}/tokenize", json={"prompt": text, "add_special_tokens": False},
                       timeout=30)
        assert r.status_code == 200, r.text
        return list(r.json()["tokens"])

    def scripted(self, output: str, stream_interval: int = 1) -> tuple[CoordinatorServer, list[int]]:
        """A coordinator whose only engine answers every request with ``output`` then EOS, in engine
        chunks of ``stream_interval`` tokens."""
        key = f"{stream_interval}:{output}"
        if key not in self._coords:
            from token_engine.simulator import SimConfig, SimulatedEngine

            ids = self.tokenize(output)
            sim = SimulatedEngine(SimConfig(mode="script", script_tokens=ids, max_model_len=MAX_MODEL_LEN,
                                            stream_interval=stream_interval))
            self._stack.enter_context(sim)
            self.sims[key] = sim
            # Nothing about parsers in the config: the coordinator learns them from the sidecar.
            settings = make_settings(self.render_url, [sim.url], render={"url": self.render_url})
            coord = self._stack.enter_context(CoordinatorServer(settings))
            self._coords[key] = (coord, [*ids, EOS])
        return self._coords[key]

    def reference(self, body: dict[str, Any], engine_ids: list[int]) -> dict[str, Any]:
        """The sidecar's own batch derender of the engine's output as native vLLM would detokenize it.

        Native vLLM never turns the token that stopped generation (here EOS) into text, so the
        reference is derendered without it.
        """
        assert engine_ids[-1] == EOS
        engine_ids = engine_ids[:-1]
        chat_request = {**body, "model": SERVED, "stream": False}
        chat_request.pop("stream_options", None)
        r = httpx.post(f"{self.render_url}/v1/chat/completions/render", json=chat_request, timeout=30)
        assert r.status_code == 200, r.text
        prompt_ids = r.json()["token_ids"]
        gen = {"request_id": "reference", "choices": [
            {"index": 0, "token_ids": engine_ids, "finish_reason": "stop", "stop_reason": EOS}]}
        r = httpx.post(f"{self.render_url}/v1/chat/completions/derender", timeout=30,
                       json={"model": SERVED, "generate_response": gen, "prompt_tokens": len(prompt_ids),
                             "prompt_token_ids": prompt_ids, "chat_request": chat_request})
        assert r.status_code == 200, r.text
        return dict(r.json()["choices"][0])


@pytest.fixture(scope="module")
def parsers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ParserStack]:
    from render_sidecar.launch import RenderSidecar

    logs = tmp_path_factory.mktemp("parser-logs")
    render = RenderSidecar(model_dir, port=free_port(), served_model_name=SERVED, max_model_len=MAX_MODEL_LEN,
                           tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="olmo3",
                           log_path=logs / "render.log", echo=False)
    with contextlib.ExitStack() as stack:
        render.start()
        stack.callback(render.stop)
        render.wait_ready(timeout=300)
        yield ParserStack(render, stack)


def chat_body(question: str, **extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": question}], "temperature": 0, **extra}


def post(coord: CoordinatorServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=60)


def stream_parts(events: list[Any]) -> dict[str, Any]:
    """What a streaming client assembles: role count, reasoning, content, finish reason, [DONE]s."""
    roles, reasoning, content, finish = [], "", "", None
    for ev in events:
        if not isinstance(ev, dict):
            continue
        assert "error" not in ev, ev
        for ch in ev["choices"]:
            delta = ch.get("delta") or {}
            if delta.get("role") is not None:
                roles.append(delta["role"])
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
            if ch.get("finish_reason") is not None:
                assert finish is None, "finish_reason sent twice"
                finish = ch["finish_reason"]
    return {"roles": roles, "reasoning": reasoning, "content": content, "finish_reason": finish,
            "done": [ev for ev in events if ev == "[DONE]"], "last": events[-1] if events else None}


def test_reasoning_non_streaming(parsers: ParserStack) -> None:
    coord, engine_ids = parsers.scripted(REASONING_OUTPUT)
    body = chat_body("Is it sunny in Paris?")
    r = post(coord, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ref = parsers.reference(body, engine_ids)
    msg, want = choice["message"], ref["message"]

    assert want["reasoning"] == THOUGHT  # the parser works on this tokenizer at all
    assert (msg["reasoning"], msg["content"]) == (want["reasoning"], want["content"])
    assert msg["content"].startswith(ANSWER)
    assert not any(m in msg["content"] for m in MARKERS), msg["content"]
    assert choice["finish_reason"] == "stop"
    assert not msg.get("tool_calls")
    assert coord.wait_idle() == 0


def test_reasoning_streaming(parsers: ParserStack) -> None:
    coord, engine_ids = parsers.scripted(REASONING_OUTPUT)
    body = chat_body("Is it sunny in Paris?")
    ref = parsers.reference(body, engine_ids)["message"]
    r = post(coord, {**body, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    got = stream_parts(sse_events(r))

    assert got["roles"] == ["assistant"], "role is sent exactly once"
    assert got["reasoning"] == ref["reasoning"] == THOUGHT
    assert got["content"] == ref["content"]
    assert not any(m in got["content"] for m in MARKERS), got["content"]
    assert got["finish_reason"] == "stop"
    assert got["done"] == ["[DONE]"] and got["last"] == "[DONE]"
    assert coord.wait_idle() == 0


def test_end_of_turn_token_is_not_shown_as_content(parsers: ParserStack) -> None:
    # Native vLLM never detokenizes the token that stopped generation (EOS or a stop_token_ids id;
    # vllm/v1/engine/detokenizer.py drops it unless include_stop_str_in_output), so a user sees exactly
    # the answer. With a parser configured, derender keeps special tokens and does not drop the stop
    # token, so whatever sends it the engine's token ids has to leave that token out.
    coord, _ = parsers.scripted(REASONING_OUTPUT)
    body = chat_body("Is it sunny in Paris?")
    non_stream = post(coord, body).json()["choices"][0]["message"]["content"]
    streamed = stream_parts(sse_events(post(coord, {**body, "stream": True})))["content"]
    assert (non_stream, streamed) == (ANSWER, ANSWER)


def test_tool_call_non_streaming(parsers: ParserStack) -> None:
    coord, engine_ids = parsers.scripted(TOOL_OUTPUT)
    body = chat_body("What is the weather in Paris?", tools=[WEATHER_TOOL], tool_choice="auto")
    r = post(coord, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    msg = choice["message"]
    want = parsers.reference(body, engine_ids)["message"]

    calls = msg.get("tool_calls") or []
    assert len(calls) == 1, msg
    assert calls[0]["type"] == "function" and calls[0]["id"]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == TOOL_ARGS
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in want["tool_calls"]]
    assert (msg["reasoning"], msg["content"]) == (want["reasoning"], want["content"])
    assert msg["reasoning"] == TOOL_THOUGHT
    assert not any(m in (msg["content"] or "") for m in MARKERS), msg["content"]
    # OpenAI (and native vLLM: serving.py, "tool_calls" for "auto" or "required" tool calls) report
    # a call the client must run with finish_reason "tool_calls".
    assert choice["finish_reason"] == "tool_calls"
    assert coord.wait_idle() == 0


def test_tool_call_streaming_openai_sdk(parsers: ParserStack) -> None:
    coord, _ = parsers.scripted(TOOL_OUTPUT)
    client = openai.OpenAI(base_url=f"{coord.url}/v1", api_key="x", max_retries=0,
                           _strict_response_validation=True)
    # The helper concatenates every id/name/arguments fragment per tool-call index, so a relay that
    # repeats the id or the name (or loses an arguments piece) shows up in the final completion.
    question = "What is the weather in Paris?"
    try:
        with client.chat.completions.stream(model=SERVED, temperature=0, tools=[WEATHER_TOOL],  # type: ignore[list-item]
                                            tool_choice="auto", messages=[{"role": "user", "content": question}]
                                            ) as stream:
            final = stream.get_final_completion()
    except AssertionError as exc:  # the SDK's own asserts carry no message: show what it was fed
        raw = post(coord, chat_body(question, tools=[WEATHER_TOOL], tool_choice="auto", stream=True))
        deltas = [ch["delta"]["tool_calls"] for ev in sse_events(raw) if isinstance(ev, dict)
                  for ch in ev["choices"] if (ch.get("delta") or {}).get("tool_calls")]
        raise AssertionError(f"the OpenAI SDK could not assemble the streamed tool call; its tool_calls deltas "
                             f"were: {json.dumps(deltas[:3])} ...") from exc
    choice = final.choices[0]
    calls = choice.message.tool_calls or []
    assert len(calls) == 1, choice.message
    call = calls[0]
    assert call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == TOOL_ARGS
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]+", call.id or ""), call.id  # one id, not repeated pieces
    assert getattr(choice.message, "reasoning", None) == TOOL_THOUGHT
    assert not any(m in (choice.message.content or "") for m in MARKERS), choice.message.content
    assert choice.finish_reason == "tool_calls"
    assert coord.wait_idle() == 0


@pytest.mark.parametrize("size", [3, 7, 64])
@pytest.mark.parametrize("output", ["reasoning", "tool"])
def test_parser_streams_do_not_depend_on_engine_chunk_size(parsers: ParserStack, output: str, size: int) -> None:
    """vLLM 0.32's olmo3 parser drops content that shares a delta with ``</think>``, so the coordinator
    derenders parser streams one token per call: engine chunks of any size give the one-token result."""
    text = REASONING_OUTPUT if output == "reasoning" else TOOL_OUTPUT
    extra: dict[str, Any] = {"tools": [WEATHER_TOOL], "tool_choice": "auto"} if output == "tool" else {}
    body = chat_body("What is the weather in Paris?", stream=True, **extra)
    results = []
    for interval in (1, size):
        coord, _ = parsers.scripted(text, stream_interval=interval)
        events = sse_events(post(coord, body))
        parts = stream_parts(events)
        calls = [tc for ev in events if isinstance(ev, dict) for ch in ev["choices"]
                 for tc in (ch.get("delta") or {}).get("tool_calls") or []]
        args = "".join((tc.get("function") or {}).get("arguments") or "" for tc in calls)
        results.append((parts["reasoning"], parts["content"], parts["finish_reason"], args))
    assert results[0] == results[1]
    assert results[0][0] in (THOUGHT, TOOL_THOUGHT) and (results[0][1] or results[0][3])


async def test_a_pool_of_sidecars_that_disagree_refuses_to_start(parsers: ParserStack, render_sidecar: Any) -> None:
    """One sidecar runs hermes and olmo3, the other no parser: they cannot derender the same streams."""
    from coordinator.app import build_components
    from coordinator.pipeline.derender.features import SidecarsDisagree

    settings = make_settings(parsers.render_url, [], render={"urls": [parsers.render_url, str(render_sidecar.url)]})
    components = build_components(settings)
    try:
        with pytest.raises(SidecarsDisagree) as exc:
            await components.start()
    finally:
        await components.aclose()
    message = str(exc.value)
    assert parsers.render_url in message and str(render_sidecar.url) in message
    assert "hermes" in message and "no parsers" in message


def test_a_stored_tool_call_carries_into_the_next_responses_turn(parsers: ParserStack) -> None:
    """Turn one's output is a reasoning item and a function call; turn two sends only the
    ``function_call_output``. The engine runs the conversation as a client sending it whole would:
    the call (from the store) with its output, the reasoning dropped (as vLLM drops it)."""
    coord, _ = parsers.scripted(TOOL_OUTPUT)
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    base = {"model": SERVED, "tools": [tool], "temperature": 0}
    first = httpx.post(f"{coord.url}/v1/responses", json={**base, "input": "Weather in Paris?"}, timeout=60).json()
    kinds = [item["type"] for item in first["output"]]
    assert kinds == ["reasoning", "function_call"], first["output"]
    call = first["output"][1]
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny, 24 C"}
    second = httpx.post(f"{coord.url}/v1/responses", timeout=60,
                        json={**base, "previous_response_id": first["id"], "input": [output]})
    assert second.status_code == 200, second.text
    whole = [{"role": "user", "content": "Weather in Paris?"},
             {k: call[k] for k in ("type", "call_id", "name", "arguments")}, output]
    r = httpx.post(f"{parsers.render_url}/v1/responses/render", json={**base, "input": whole}, timeout=30)
    assert r.status_code == 200, r.text
    assert parsers.sims[f"1:{TOOL_OUTPUT}"].state()["last_ids"]["token_ids"] == r.json()["token_ids"]
    assert "Sunny, 24 C" in httpx.post(f"{parsers.render_url}/detokenize", timeout=30,
                                       json={"tokens": r.json()["token_ids"]}).json()["prompt"]
