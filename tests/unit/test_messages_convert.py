"""The coordinator's chat → Anthropic converters give exactly what vLLM's own give.

``coordinator/pipeline/messages/convert.py`` ports vLLM 0.32's ``messages_full_converter`` and
``message_stream_converter`` (the coordinator does not ship vLLM). Here the same chat outputs go
through both, vLLM's imported from the installed package, and the events must be equal: same
names, same data, in the same order. Thinking-block signatures are random on both sides, so both
get the same fixed one.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from coordinator.pipeline.messages.convert import MessageStream, to_message

vllm_anthropic = pytest.importorskip("vllm.entrypoints.anthropic.serving")

SIG = "0" * 32


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None, stop: Any = None,
           usage: dict[str, Any] | None = None, choices: bool = True) -> dict[str, Any]:
    c: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                         "choices": []}
    if choices:
        choice: dict[str, Any] = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop
        c["choices"] = [choice]
    if usage is not None:
        c["usage"] = usage
    return c


def _usage(completion: int, cached: int | None = None) -> dict[str, Any]:
    u: dict[str, Any] = {"prompt_tokens": 9, "completion_tokens": completion, "total_tokens": 9 + completion}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


def _call(index: int, cid: str | None, name: str | None, args: str | None) -> dict[str, Any]:
    fn: dict[str, Any] = {}
    if name is not None:
        fn["name"] = name
    if args is not None:
        fn["arguments"] = args
    call: dict[str, Any] = {"index": index, "function": fn}
    if cid is not None:
        call.update(id=cid, type="function")
    return call


def stream(*middle: dict[str, Any], finish: str = "stop", stop: Any = None, cached: int | None = None
           ) -> list[dict[str, Any]]:
    role = _chunk({"role": "assistant", "content": ""}, usage=_usage(0, cached))
    n = len(middle)
    last = _chunk({}, finish=finish, stop=stop, usage=_usage(n, cached))
    return [role, *middle, last, _chunk(choices=False, usage=_usage(n, cached))]


def text(s: str) -> dict[str, Any]:
    return _chunk({"content": s}, usage=_usage(1))


def think(s: str) -> dict[str, Any]:
    return _chunk({"reasoning": s}, usage=_usage(1))


def tool(*calls: dict[str, Any]) -> dict[str, Any]:
    return _chunk({"tool_calls": list(calls)}, usage=_usage(1))


STREAMS: dict[str, list[dict[str, Any]]] = {
    "text": stream(text("Hello"), text(" world")),
    "length": stream(text("Hello"), finish="length"),
    "stop-sequence": stream(text("Hello"), stop="\n\n"),
    "stop-token-id": stream(text("Hello"), stop=2),
    "cached-usage": stream(text("Hi"), cached=4),
    "empty": stream(),
    "thinking-then-text": stream(think("Let me"), think(" think."), text("Paris.")),
    "text-then-thinking": stream(text("a"), think("b"), text("c")),
    "one-tool-call": stream(tool(_call(0, "call_1", "get_weather", None)),
                            tool(_call(0, None, None, '{"city": ')), tool(_call(0, None, None, '"Paris"}')),
                            finish="tool_calls"),
    "tool-call-args-with-start": stream(tool(_call(0, "call_1", "w", '{"a": 1}')), finish="tool_calls"),
    "text-then-tool-then-text": stream(text("Sure."), tool(_call(0, "c1", "w", '{"x": 1}')), text(" held"),
                                       finish="tool_calls"),
    "two-tool-calls": stream(tool(_call(0, "c1", "a", '{"x": 1}')), tool(_call(1, "c2", "b", None)),
                             tool(_call(1, None, None, '{"y": 2}')), finish="tool_calls"),
    "tool-cut-by-stop": stream(tool(_call(0, "c1", "a", '{"x": ')), stop="END"),
    "named-tool-finish-stop": stream(tool(_call(0, "c1", "a", '{"x": 1}')), finish="stop"),
    "blank-deltas": stream(text(""), think(""), text("x")),
}


def _sse(chunks: list[dict[str, Any]]) -> list[str]:
    return [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]


def vllm_events(chunks: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    monkeypatch.setattr(vllm_anthropic.uuid, "uuid4", lambda: uuid.UUID(SIG))

    async def gen() -> AsyncIterator[str]:
        for item in _sse(chunks):
            yield item

    async def run() -> list[str]:
        convert = vllm_anthropic.AnthropicServingMessages.message_stream_converter
        return [e async for e in convert(None, gen())]

    out = []
    for frame in asyncio.run(run()):
        head, data = frame.strip("\n").split("\n", 1)
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def our_events(chunks: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    conv = MessageStream(signature=lambda: SIG)
    events = [e for c in chunks for e in conv.feed(c)] + conv.finish()
    return [(name, json.loads(json.dumps(data))) for name, data in events]


@pytest.mark.parametrize("case", list(STREAMS))
def test_stream_events_equal_vllms(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = STREAMS[case]
    theirs = vllm_events(chunks, monkeypatch)
    assert theirs[0][0] == "message_start" and theirs[-1][0] == "message_stop"
    assert our_events(chunks) == theirs


def test_the_cases_cover_every_event_and_stop_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """So the equality above is not equality of trivial streams."""
    names, deltas, reasons = set(), set(), set()
    for chunks in STREAMS.values():
        for name, data in our_events(chunks):
            names.add(name)
            if name == "content_block_delta":
                deltas.add(data["delta"]["type"])
            if name == "message_delta":
                reasons.add(data["delta"]["stop_reason"])
    assert names == {"message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"}
    assert deltas == {"text_delta", "thinking_delta", "signature_delta", "input_json_delta"}
    assert reasons == {"end_turn", "max_tokens", "stop_sequence", "tool_use"}


def _completion(message: dict[str, Any], finish: str = "stop", stop: Any = None,
                cached: int | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", **message}, "logprobs": None,
                         "finish_reason": finish, "stop_reason": stop}],
            "usage": _usage(5, cached)}


def _tc(cid: str, name: str, args: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


COMPLETIONS: dict[str, dict[str, Any]] = {
    "text": _completion({"content": "Paris."}),
    "length": _completion({"content": "Par"}, finish="length"),
    "stop-sequence": _completion({"content": "Paris"}, stop="."),
    "empty": _completion({"content": ""}),
    "thinking": _completion({"content": "Paris.", "reasoning": "Capital of France."}),
    "tool-calls": _completion({"content": None, "tool_calls": [_tc("c1", "w", '{"city": "Paris"}'),
                                                                _tc("c2", "w", '{"city": "Rome"}')]},
                              finish="tool_calls"),
    "cached": _completion({"content": "x"}, cached=3),
}


@pytest.mark.parametrize("case", list(COMPLETIONS))
def test_message_equals_vllms(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    monkeypatch.setattr(vllm_anthropic.uuid, "uuid4", lambda: uuid.UUID(SIG))
    chat = COMPLETIONS[case]
    theirs = vllm_anthropic.AnthropicServingMessages.messages_full_converter(
        None, ChatCompletionResponse.model_validate(chat)).model_dump(exclude_none=True)
    assert to_message(chat, signature=lambda: SIG) == json.loads(json.dumps(theirs))
