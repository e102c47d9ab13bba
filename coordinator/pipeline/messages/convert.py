"""OpenAI chat output → Anthropic Messages output: the whole message, and the event stream.

These follow vLLM 0.32's ``AnthropicServingMessages.messages_full_converter`` and
``message_stream_converter`` rule for rule, so ``/v1/messages`` answers as native ``vllm serve``
does. They are ported rather than imported because the coordinator does not ship vLLM (importing it
pulls in torch), and the stream conversion has to run where chunks are committed to the client,
after derender, not in the sidecar. ``tests/unit/test_messages_convert.py`` feeds the same chat
outputs to vLLM's functions and to these and requires equal results, so a vLLM upgrade that changes
a rule fails there.

Events are ``(event name, data)`` pairs; the door frames them as ``event: <name>\\ndata: <json>``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

Event = tuple[str, dict[str, Any]]
Signature = Callable[[], str]


def _new_signature() -> str:
    return uuid.uuid4().hex


def usage(chat_usage: dict[str, Any] | None) -> dict[str, int]:
    """Anthropic usage: ``input_tokens`` excludes cached and cache-creating tokens, which get their
    own fields only when the chat usage reports them."""
    if not chat_usage:
        return {"input_tokens": 0, "output_tokens": 0}
    out: dict[str, int] = {"output_tokens": int(chat_usage.get("completion_tokens") or 0)}
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    details = chat_usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        if details.get("cached_tokens") is not None:
            prompt -= int(details["cached_tokens"])
            out["cache_read_input_tokens"] = int(details["cached_tokens"])
        if details.get("created_cache_tokens") is not None:
            prompt -= int(details["created_cache_tokens"])
            out["cache_creation_input_tokens"] = int(details["created_cache_tokens"])
    return {"input_tokens": max(0, prompt), **out}


def stop_reason(finish_reason: str | None, stop: int | str | None, *, tool_used: bool,
                tool_complete: bool) -> tuple[str | None, str | None]:
    """``(stop_reason, stop_sequence)``: ``max_tokens`` always wins; a matched stop string wins unless
    the tool calls are complete (a call it cut short must not run); a tool call is ``tool_use`` even
    when chat says ``stop`` (a named tool choice)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):   # an int is a stop token id, not a stop sequence
        return "stop_sequence", stop
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def to_message(chat: dict[str, Any], signature: Signature = _new_signature) -> dict[str, Any]:
    """A chat completion as an Anthropic message (fields that are null are left out, as vLLM does)."""
    choice = chat["choices"][0]
    msg = choice.get("message") or {}
    calls = msg.get("tool_calls") or []
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"),
                                   tool_used=bool(calls), tool_complete=bool(calls))
    content: list[dict[str, Any]] = []
    if msg.get("reasoning"):
        content.append({"type": "thinking", "thinking": msg["reasoning"], "signature": signature()})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in calls:
        fn = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id"), "name": fn.get("name"),
                        "input": json.loads(fn.get("arguments") or "{}")})
    if not content:  # Anthropic's empty completion is one empty text block: clients read content[0]
        content.append({"type": "text", "text": ""})
    out: dict[str, Any] = {"id": chat["id"], "type": "message", "role": "assistant", "content": content,
                           "model": chat["model"], "stop_reason": reason, "stop_sequence": sequence,
                           "usage": usage(chat.get("usage"))}
    return {k: v for k, v in out.items() if v is not None}


class MessageStream:
    """Chat stream chunks in, Anthropic events out; one instance per response.

    The chat stream must carry usage (the Messages request's chat form asks for
    ``include_usage`` and ``continuous_usage_stats``): its first chunk opens the message
    (``message_start``), the usage chunk closes the content (``message_delta`` with the stop reason),
    and ``finish()`` (the chat stream's ``[DONE]``) sends ``message_stop``. Text that follows a tool
    call inside one stream is held and sent as its own text block when the call's block closes."""

    def __init__(self, signature: Signature = _new_signature) -> None:
        self._signature = signature
        self._first = True
        self._finish_reason: str | None = None
        self._stop: int | str | None = None
        self._tool_used = False
        self._last_tool_args: list[str] = []    # only the last call can be cut by a stop string
        self._tool_ids: dict[int, str] = {}     # tool call index → tool_use id
        self._next = 0                          # index the next content block gets
        self._type: str | None = None           # the open block
        self._index: int | None = None
        self._block_signature: str | None = None
        self._signature_sent = False
        self._tool_use_id: str | None = None
        self._pending: list[str] = []

    # -- blocks ----------------------------------------------------------------------------------
    def _start(self, block: dict[str, Any]) -> Event:
        event = ("content_block_start", {"type": "content_block_start", "content_block": block,
                                         "index": self._next})
        self._type, self._index = block["type"], self._next
        self._tool_use_id = block.get("id") if block["type"] == "tool_use" else None
        if block["type"] == "thinking":
            self._block_signature, self._signature_sent = self._signature(), False
        else:
            self._block_signature, self._signature_sent = None, True
        return event

    def _stop_block(self) -> list[Event]:
        if self._type is None:
            return []
        events: list[Event] = []
        if self._type == "thinking" and self._block_signature is not None and not self._signature_sent:
            events.append(self._delta({"type": "signature_delta", "signature": self._block_signature}))
            self._signature_sent = True
        events.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
        self._type = self._index = self._block_signature = self._tool_use_id = None
        self._signature_sent = False
        self._pending.clear()
        self._next += 1
        return events

    def _stop_and_flush(self) -> list[Event]:
        held, self._pending = self._pending, []
        events = self._stop_block()
        if held:
            events.append(self._start({"type": "text", "text": ""}))
            events.append(self._delta({"type": "text_delta", "text": "".join(held)}))
            events.extend(self._stop_block())
        return events

    def _delta(self, delta: dict[str, Any]) -> Event:
        index = self._index if self._index is not None else self._next
        return ("content_block_delta", {"type": "content_block_delta", "delta": delta, "index": index})

    # -- chunks ----------------------------------------------------------------------------------
    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        """The events one chat chunk makes (often none or one)."""
        if self._first:
            self._first = False
            return [("message_start", {"type": "message_start", "message": {
                "id": chunk["id"], "type": "message", "role": "assistant", "content": [],
                "model": chunk["model"], "stop_reason": None, "stop_sequence": None,
                "usage": usage(chunk.get("usage"))}})]
        choices = chunk.get("choices") or []
        if not choices:  # the usage chunk: the content is complete
            events = self._stop_and_flush()
            reason, sequence = stop_reason(
                self._finish_reason or "stop", self._stop, tool_used=self._tool_used,
                tool_complete=self._tool_used and _is_json("".join(self._last_tool_args)))
            events.append(("message_delta", {"type": "message_delta",
                                             "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                             "usage": usage(chunk.get("usage"))}))
            return events
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self._finish_reason, self._stop = choice["finish_reason"], choice.get("stop_reason")
        delta = choice.get("delta") or {}
        events = []
        reasoning = delta.get("reasoning")
        if reasoning:
            if self._type != "thinking":
                events += self._stop_and_flush()
                events.append(self._start({"type": "thinking", "thinking": ""}))
            events.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        text = delta.get("content")
        if text:
            if self._type == "tool_use":
                self._pending.append(text)
            else:
                if self._type != "text":
                    events += self._stop_and_flush()
                    events.append(self._start({"type": "text", "text": ""}))
                events.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or ():
            events += self._tool_call(call)
        return events

    def _tool_call(self, call: dict[str, Any]) -> list[Event]:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        events: list[Event] = []
        if call.get("id") is not None:
            self._tool_ids[int(call.get("index", 0))] = call["id"]
            if self._tool_use_id != call["id"] and fn.get("name") is not None:
                events += self._stop_and_flush()
                self._tool_used = True
                self._last_tool_args = []
                events.append(self._start({"type": "tool_use", "id": call["id"], "name": fn["name"],
                                           "input": {}}))
            target: str | None = call["id"]
        else:
            target = self._tool_ids.get(int(call.get("index", 0)))
        if args and target is not None and self._tool_use_id == target:
            self._last_tool_args.append(args)
            events.append(self._delta({"type": "input_json_delta", "partial_json": args}))
        return events

    def finish(self) -> list[Event]:
        """The chat stream ended (its ``[DONE]``): close what is open, then ``message_stop``."""
        return [*self._stop_and_flush(), ("message_stop", {"type": "message_stop"})]


def error_event(error_type: str, message: str) -> Event:
    """A failure after the stream started: Anthropic's ``error`` event (the stream ends after it)."""
    return ("error", {"type": "error", "error": {"type": error_type, "message": message}})
