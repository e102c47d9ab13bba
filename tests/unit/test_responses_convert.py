"""The coordinator's chat → Responses converters give exactly what vLLM's own give.

``coordinator/pipeline/responses/convert.py`` ports vLLM 0.32's non-Harmony Responses output: the
stream's ``split_delta`` + ``SimpleStreamingEventProcessor`` and the body's
``build_response_output_items`` (with the fallback vLLM takes without a parser). Here the same
outputs go through both, vLLM's imported from the installed package, and the events and items must
be equal: same types, same fields, same order. Item ids are random on both sides, so both draw
them from the same counter.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from coordinator.pipeline.responses.convert import ResponsesForm, ResponseStream, output_items

events_mod = pytest.importorskip("vllm.entrypoints.openai.responses.streaming_events")
utils_mod = pytest.importorskip("vllm.entrypoints.openai.responses.utils")
from openai.types.responses.tool import Tool  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402
from vllm.entrypoints.generate.base.protocol import DeltaMessage, FunctionCall  # noqa: E402
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionLogProbs  # noqa: E402
from vllm.tool_parsers.utils import build_responses_tool_call_name_map  # noqa: E402

WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
NAMESPACE = {"type": "namespace", "name": "files", "description": "file tools",
             "tools": [{"type": "function", "name": "read", "parameters": {"type": "object", "properties": {}}}]}
CUSTOM = {"type": "custom", "name": "run_sql", "description": "run SQL"}
TOOLS = [WEATHER, NAMESPACE, CUSTOM]


def _tools(raw: list[dict[str, Any]]) -> list[Any]:
    return [TypeAdapter(Tool).validate_python(t) for t in raw]


def _form(parser: bool = True, include_reasoning: bool = True, logprobs: bool = False,
          tools: list[dict[str, Any]] = TOOLS) -> ResponsesForm:
    names = {flat: {"name": n.name, "namespace": n.namespace}
             for flat, n in build_responses_tool_call_name_map(_tools(tools)).items()}
    return ResponsesForm(chat={}, response={}, tool_names=names,
                         custom_tools=frozenset(t["name"] for t in tools if t["type"] == "custom"),
                         parser=parser, include_reasoning=include_reasoning, logprobs=logprobs)


def _counter() -> Callable[[], str]:
    numbers = itertools.count()
    return lambda: f"{next(numbers):016x}"


def call(index: int, cid: str | None, name: str | None, args: str | None) -> dict[str, Any]:
    fn: dict[str, Any] = {}
    if name is not None:
        fn["name"] = name
    if args is not None:
        fn["arguments"] = args
    out: dict[str, Any] = {"index": index, "function": fn}
    if cid is not None:
        out.update(id=cid, type="function")
    return out


LP = {"content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                   "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                                    {"token": "Yo", "logprob": -1.25, "bytes": [89, 111]}]}]}

# Chat deltas (after derender), one list per stream.
STREAMS: dict[str, list[dict[str, Any]]] = {
    "text": [{"content": "Hello"}, {"content": ", "}, {"content": "world"}],
    "empty-content-skipped": [{"content": ""}, {"content": "x"}, {"content": ""}],
    "reasoning-then-text": [{"reasoning": "Let me "}, {"reasoning": "think."}, {"content": "Paris."}],
    "compound-delta": [{"reasoning": "r", "content": "c"}, {"content": "d"}],
    "text-then-tool": [{"content": "Checking."},
                       {"tool_calls": [call(0, "call_a", "get_weather", None)]},
                       {"tool_calls": [call(0, None, None, '{"city": ')]},
                       {"tool_calls": [call(0, None, None, '"Paris"}')]}],
    "two-tools-one-delta": [{"tool_calls": [call(0, "call_a", "get_weather", "{}"),
                                            call(1, "call_b", "get_weather", '{"x": 1}')]}],
    "two-tools-in-turn": [{"tool_calls": [call(0, "call_a", "get_weather", "{")]},
                          {"tool_calls": [call(0, None, None, "}")]},
                          {"tool_calls": [call(1, "call_b", "files__read", '{"p": "a"}')]}],
    "namespace-tool": [{"tool_calls": [call(0, "call_n", "files__read", '{"path": "x"}')]}],
    "custom-tool": [{"tool_calls": [call(0, "call_c", "run_sql", '{"input": "SELE')]},
                    {"tool_calls": [call(0, None, None, 'CT 1"}')]}],
    "custom-tool-bare-text": [{"tool_calls": [call(0, "call_c", "run_sql", "not json")]}],
    "tool-then-text": [{"tool_calls": [call(0, "call_a", "get_weather", "{}")]}, {"content": "Done."}],
}


def _chunks(deltas: list[dict[str, Any]], logprobs: Any = None) -> Iterator[dict[str, Any]]:
    yield {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    for d in deltas:
        yield {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": d, "logprobs": logprobs}]}
    yield {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    yield {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}


def _ours(deltas: list[dict[str, Any]], form: ResponsesForm, logprobs: Any = None
          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    stream = ResponseStream(form, make_id=_counter())
    events = [e for c in _chunks(deltas, logprobs) for e in stream.feed(c)]
    events += stream.close()
    return events, stream.items


def _vllm(deltas: list[dict[str, Any]], form: ResponsesForm, tools: list[dict[str, Any]],
          monkeypatch: pytest.MonkeyPatch, logprobs: Any = None
          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """vLLM's ``_process_simple_streaming_events`` loop body, fed the same deltas."""
    monkeypatch.setattr(events_mod, "random_uuid", _counter())
    processor = events_mod.SimpleStreamingEventProcessor(tools=_tools(tools))
    lps = []
    if logprobs is not None:
        lps = [{"token": lp.token, "logprob": lp.logprob, "bytes": lp.bytes,
                "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes}
                                 for t in lp.top_logprobs]}
               for lp in ChatCompletionLogProbs.model_validate(logprobs).content or []]

    def get_logprobs(_: Any) -> list[Any]:
        from openai.types.responses.response_output_text import Logprob
        return [Logprob.model_validate(lp) for lp in lps]

    out: list[Any] = []
    for raw in deltas:
        delta = DeltaMessage(**raw) if form.parser else DeltaMessage(content=raw.get("content") or "")
        for dm in events_mod.split_delta(delta):
            target, tool_call = processor.resolve_target_state(dm)
            if target == events_mod._StateType.NONE:
                continue
            if processor.needs_transition(target, tool_call):
                out += processor.close_current()
                out += processor.open(target, tool_call)
            out += processor.emit_delta(dm, None, get_logprobs if form.logprobs else None)
    out += processor.close_current()
    dumped = [json.loads(e.model_dump_json(by_alias=True)) for e in out]
    for e in dumped:
        e.pop("sequence_number")
    return dumped, [i.model_dump(mode="json", by_alias=True) for i in processor.output_items]


@pytest.mark.parametrize("case", list(STREAMS))
def test_stream_events_equal_vllms(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    form = _form()
    ours, our_items = _ours(STREAMS[case], form)
    theirs, their_items = _vllm(STREAMS[case], form, TOOLS, monkeypatch)
    assert ours == theirs
    assert our_items == their_items
    assert ours, "every case streams something"


def test_stream_without_a_parser_is_one_message_of_all_content(monkeypatch: pytest.MonkeyPatch) -> None:
    form = _form(parser=False)
    deltas = STREAMS["text"]
    ours, items = _ours(deltas, form)
    assert ours == _vllm(deltas, form, TOOLS, monkeypatch)[0]
    assert [i["type"] for i in items] == ["message"]
    assert items[0]["content"][0]["text"] == "Hello, world"


def test_stream_logprobs_equal_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    form = _form(logprobs=True)
    deltas = [{"content": "Hi"}]
    ours, items = _ours(deltas, form, LP)
    theirs, their_items = _vllm(deltas, form, TOOLS, monkeypatch, LP)
    assert ours == theirs and items == their_items
    assert ours[2]["logprobs"][0]["top_logprobs"][1] == {"token": "Yo", "logprob": -1.25}


def _chat(content: str | None, reasoning: str | None = None, calls: list[dict[str, Any]] | None = None,
          logprobs: Any = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content, "reasoning": reasoning}
    if calls:
        msg["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    return {"choices": [{"index": 0, "message": msg, "logprobs": logprobs, "finish_reason": "stop"}]}


BODIES: dict[str, dict[str, Any]] = {
    "text": _chat("Paris."),
    "reasoning-and-text": _chat("Paris.", reasoning="Capital of France."),
    "tools": _chat(None, calls=[{"id": "call_a", "name": "get_weather", "arguments": '{"city": "P"}'},
                                {"id": "call_n", "name": "files__read", "arguments": "{}"},
                                {"id": "call_c", "name": "run_sql", "arguments": '{"input": "SELECT 1"}'}]),
    "empty": _chat(""),
}


def _vllm_items(chat: dict[str, Any], form: ResponsesForm, monkeypatch: pytest.MonkeyPatch
                ) -> list[dict[str, Any]]:
    monkeypatch.setattr(utils_mod, "random_uuid", _counter())
    msg = chat["choices"][0]["message"]
    lp = chat["choices"][0]["logprobs"]
    logprobs = None
    if form.logprobs and lp:
        from openai.types.responses.response_output_text import Logprob
        logprobs = [Logprob.model_validate({**x, "top_logprobs": x["top_logprobs"]}) for x in lp["content"]]
    if not form.parser:  # serving.py's fallback without a parser
        from openai.types.responses import ResponseOutputMessage, ResponseOutputText
        text = msg.get("content") or ""
        item = ResponseOutputMessage(id=f"msg_{utils_mod.random_uuid()}", role="assistant", status="completed",
                                     type="message",
                                     content=[ResponseOutputText(text=text, annotations=[], type="output_text",
                                                                 logprobs=logprobs)] if text else [])
        return [item.model_dump(mode="json", by_alias=True)]
    calls = [FunctionCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
             for c in msg.get("tool_calls") or []]
    reasoning = msg.get("reasoning") if form.include_reasoning else None
    items = utils_mod.build_response_output_items(reasoning=reasoning, content=msg.get("content"),
                                                  tool_calls=calls, logprobs=logprobs, tools=_tools(TOOLS))
    return [i.model_dump(mode="json", by_alias=True) for i in items]


@pytest.mark.parametrize("parser", [True, False])
@pytest.mark.parametrize("case", list(BODIES))
def test_output_items_equal_vllms(case: str, parser: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    form = _form(parser=parser)
    chat = BODIES[case]
    assert output_items(chat, form, make_id=_counter()) == _vllm_items(chat, form, monkeypatch)


def test_output_items_hide_reasoning_and_carry_logprobs(monkeypatch: pytest.MonkeyPatch) -> None:
    hidden = _form(include_reasoning=False)
    chat = BODIES["reasoning-and-text"]
    items = output_items(chat, hidden, make_id=_counter())
    assert items == _vllm_items(chat, hidden, monkeypatch)
    assert [i["type"] for i in items] == ["message"]
    with_lp = _form(logprobs=True)
    chat = _chat("Hi", logprobs=LP)
    items = output_items(chat, with_lp, make_id=_counter())
    assert items == _vllm_items(chat, with_lp, monkeypatch)
    assert items[0]["content"][0]["logprobs"][0]["top_logprobs"][1]["token"] == "Yo"
