"""The native-shape rules on derender's chunks (the e2e test compares against real native vLLM)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from coordinator.pipeline.context import PromptPlan, RequestContext, StopSpec
from coordinator.pipeline.derender.client import StreamMode
from coordinator.pipeline.derender.fixups import eos_stop_reason
from coordinator.pipeline.derender.shape import (
    role_chunk,
    shape_stream_chunk,
    shape_usage_chunk,
    system_fingerprint,
)
from coordinator.pipeline.derender.stream import Coalescing, PromptStream


def ctx(kind: str = "chat", include_usage: bool = False, **body: Any) -> RequestContext:
    c = RequestContext(kind=kind, request_id="r1", body={"messages": [{"role": "user", "content": "hi"}], **body},  # type: ignore[arg-type]
                       model="m", stream=True, include_usage=include_usage)
    c.prompts = [plan()]
    return c


def plan(n: int = 1) -> PromptPlan:
    return PromptPlan(index=0, generate={"sampling_params": {"max_tokens": 8}}, prompt_token_ids=[5, 6, 7], n=n,
                      stop=StopSpec())


def derendered(content: Any, finish: str | None = None, **delta: Any) -> dict[str, Any]:
    """A chat chunk as derender writes it: every field, ``null`` when unset."""
    return {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"role": None, "content": content, "reasoning": None, **delta},
                         "logprobs": None, "finish_reason": finish, "stop_reason": None, "token_ids": None}],
            "usage": None, "system_fingerprint": None, "prompt_token_ids": None, "prompt_text": None,
            "metrics": None}


def test_content_chunk_has_only_the_keys_native_sets() -> None:
    chunk = derendered(" Paris")
    chunk["choices"][0]["delta"]["role"] = "assistant"  # derender's first chunk: the role chunk said it
    assert shape_stream_chunk(ctx(), chunk, parsers=False)
    assert set(chunk) == {"id", "object", "created", "model", "choices"}
    assert chunk["choices"][0] == {"index": 0, "delta": {"content": " Paris"}, "logprobs": None,
                                   "finish_reason": None, "token_ids": None}


def test_a_newer_sidecars_null_fields_leave_its_chunks() -> None:
    """vLLM 0.33's chunk and choice models gained ``kv_transfer_params`` and ``weight_versions``;
    native 0.33 sends them only when set, native 0.32 never."""
    chunk = derendered(" Paris")
    chunk["kv_transfer_params"] = None
    chunk["choices"][0]["weight_versions"] = None
    assert shape_stream_chunk(ctx(), chunk, parsers=False)
    assert set(chunk) == {"id", "object", "created", "model", "choices"}
    assert "weight_versions" not in chunk["choices"][0]
    kept = derendered(" Paris")
    kept["kv_transfer_params"] = {"remote_block_ids": [1]}
    kept["choices"][0]["weight_versions"] = ["v2"]
    assert shape_stream_chunk(ctx(), kept, parsers=False)
    assert kept["kv_transfer_params"] == {"remote_block_ids": [1]} and kept["choices"][0]["weight_versions"] == ["v2"]
    usage = shape_usage_chunk(ctx(include_usage=True), {"choices": [], "usage": {}, "kv_transfer_params": None})
    assert "kv_transfer_params" not in usage


def test_text_less_token_is_empty_content_not_null() -> None:
    chunk = derendered(None, finish="stop")
    assert shape_stream_chunk(ctx(), chunk, parsers=False)
    choice = chunk["choices"][0]
    assert choice["delta"] == {"content": ""} and choice["stop_reason"] is None


def test_finishing_chunk_has_the_fingerprint_unless_a_usage_chunk_follows() -> None:
    chunk = derendered("", finish="length")
    shape_stream_chunk(ctx(), chunk, parsers=False)
    assert chunk["system_fingerprint"] == system_fingerprint("m")
    chunk = derendered("", finish="length")
    shape_stream_chunk(ctx(include_usage=True), chunk, parsers=False)
    assert "system_fingerprint" not in chunk
    usage = shape_usage_chunk(ctx(include_usage=True), {"choices": [], "usage": {"prompt_tokens": 1}})
    assert usage["system_fingerprint"] == system_fingerprint("m")


def test_continuous_usage_keys_per_kind() -> None:
    full = {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1, "prompt_tokens_details": None,
            "completion_tokens_details": None}
    chat_chunk = {**derendered("a"), "usage": dict(full)}
    shape_stream_chunk(ctx(include_usage=True), chat_chunk, parsers=False)
    assert set(chat_chunk["usage"]) == {"prompt_tokens", "total_tokens", "completion_tokens",
                                        "completion_tokens_details"}
    completion_chunk = {"id": "x", "choices": [{"index": 0, "text": "a", "finish_reason": None}],
                        "usage": dict(full), "system_fingerprint": None, "metrics": None}
    shape_stream_chunk(ctx("completion", include_usage=True), completion_chunk, parsers=False)
    assert set(completion_chunk) == {"id", "choices", "usage"}
    assert set(completion_chunk["usage"]) == {"prompt_tokens", "total_tokens", "completion_tokens"}


def test_parser_deltas_keep_what_the_parser_set_and_silent_steps_are_held_back() -> None:
    reasoning = derendered(None, reasoning="thinking")
    assert shape_stream_chunk(ctx(), reasoning, parsers=True)
    assert reasoning["choices"][0]["delta"] == {"reasoning": "thinking"}

    call = [{"index": 0, "function": {"arguments": "{"}}]
    tool = derendered(None, tool_calls=call)
    assert shape_stream_chunk(ctx(), tool, parsers=True)
    assert tool["choices"][0]["delta"] == {"content": None, "tool_calls": call}  # as hermes sets it

    assert not shape_stream_chunk(ctx(), derendered(None), parsers=True)  # buffered markup: no chunk
    finish = derendered(None, finish="tool_calls")
    assert shape_stream_chunk(ctx(), finish, parsers=True)
    assert finish["choices"][0]["delta"] == {}


def test_role_chunk_is_natives_first_chunk() -> None:
    c = ctx(include_usage=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunk = role_chunk(c, plan(), 1)
    assert chunk["choices"] == [{"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
    assert chunk["usage"] == {"prompt_tokens": 3, "total_tokens": 3, "completion_tokens": 0,
                              "completion_tokens_details": None}
    assert chunk["prompt_token_ids"] is None and chunk["prompt_text"] is None
    assert role_chunk(ctx(return_token_ids=True), plan(), 0)["prompt_token_ids"] == [5, 6, 7]
    # Without a generation prompt native names the last message's role.
    continued = ctx(add_generation_prompt=False, messages=[{"role": "user", "content": "Once"}])
    assert role_chunk(continued, plan(), 0)["choices"][0]["delta"]["role"] == "user"
    assert "usage" not in role_chunk(ctx(), plan(), 0)


def test_eos_stop_reason_is_null_unless_the_client_asked_for_that_token() -> None:
    choice: dict[str, Any] = {"finish_reason": "stop", "stop_reason": 2}
    eos_stop_reason(choice, None)
    assert choice["stop_reason"] is None
    choice = {"finish_reason": "stop", "stop_reason": 7}
    eos_stop_reason(choice, [7])
    assert choice["stop_reason"] == 7
    choice = {"finish_reason": "stop", "stop_reason": "END"}
    eos_stop_reason(choice, None)
    assert choice["stop_reason"] == "END"


class _Derender:
    """Derender stand-in with a parser: tokens 0 are buffered markup (empty delta), others are text."""

    def __init__(self) -> None:
        self.states: list[Any] = []

    async def mode(self) -> StreamMode:
        return StreamMode(parsers=True, coalesce=False)

    async def stream_chunk(self, c: RequestContext, p: PromptPlan, chunk: dict[str, Any],
                           state: dict[str, Any] | None, **_: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        self.states.append(state)
        ch = chunk["choices"][0]
        text = "".join(chr(t) for t in ch["token_ids"] if t) or None
        out = derendered(text, finish=ch["finish_reason"])
        out["choices"][0]["index"] = ch["index"]
        return out, {"seen": len(self.states)}


async def test_role_chunks_come_first_and_held_back_steps_still_commit() -> None:
    async def engine() -> AsyncIterator[dict[str, Any]]:
        for index, tok, finish in [(0, 0, None), (1, 104, None), (0, 105, "length"), (1, 106, "length")]:
            yield {"choices": [{"index": index, "token_ids": [tok], "finish_reason": finish}]}

    c = ctx()
    derender = _Derender()
    # One derender call per engine chunk, so the exact interleaving of the two choices is visible.
    ps = PromptStream(c, plan(n=2), derender, coalescing=Coalescing(enabled=False))  # type: ignore[arg-type]
    sent: list[dict[str, Any]] = []

    async def emit(chunk: dict[str, Any]) -> None:
        sent.append(chunk)

    await ps.run(engine(), emit)
    deltas = [(ch["choices"][0]["index"], ch["choices"][0]["delta"]) for ch in sent]
    assert deltas == [(0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""}),
                      (1, {"content": "h"}), (0, {"content": "i"}), (1, {"content": "j"})]
    assert derender.states[2] == {"seen": 1}, "the held-back step's state was committed"
    assert ps.completion_tokens == 4
