"""OpenAI chat output → OpenAI Responses output: the response object, and the event stream.

These follow vLLM 0.32's non-Harmony Responses path rule for rule (``build_response_output_items``
and the fallback without a parser for the body; ``split_delta`` and ``SimpleStreamingEventProcessor``
with its ``emit_simple_*`` helpers for the stream; ``ResponsesResponse.from_request`` for the
envelope, which the render sidecar builds and ``ResponsesForm.response`` carries), so
``/v1/responses`` answers as native ``vllm serve`` does. They are ported rather than imported for the
reason ``pipeline/messages/convert.py`` gives: the coordinator does not ship vLLM, and the stream
conversion runs where chunks are committed to the client. ``tests/unit/test_responses_convert.py``
feeds the same outputs to vLLM's functions and to these and requires equal results.

One difference of input, not of rule: vLLM feeds its processor one parser delta per engine step,
we feed it derender's chat deltas, which may carry several tokens (coalesced derender calls). The
state machine is the same, so item boundaries, ids, indexes and final texts are the same; a run of
``*.delta`` events may be cut into fewer, longer pieces.

Events are dicts with their ``type``; the door frames them as ``event: <type>\\ndata: <json>`` and
numbers them (``sequence_number``) in the order written.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import partial_json_parser
from partial_json_parser.core.options import Allow

Event = dict[str, Any]
NewId = Callable[[], str]
CUSTOM_TOOL_INPUT_KEY = "input"  # vLLM's shim: a custom tool is shown as a function of one string


def new_id() -> str:
    """16 hex digits, as vLLM's ``random_uuid``."""
    return f"{uuid.uuid4().int & (2**64 - 1):016x}"


@dataclass(frozen=True)
class ResponsesForm:
    """The render sidecar's conversion of one Responses request (``render_sidecar/responses.py``)."""

    chat: dict[str, Any]                      # the chat request the pipeline serves
    response: dict[str, Any]                  # vLLM's response object for it: no output, in progress
    tool_names: dict[str, dict[str, Any]] = field(default_factory=dict)  # flat name → name, namespace
    custom_tools: frozenset[str] = frozenset()
    parser: bool = False                      # the sidecar runs a tool-call or reasoning parser
    include_reasoning: bool = True
    logprobs: bool = False                    # include has message.output_text.logprobs

    def call_name(self, flat: str) -> tuple[str, str | None]:
        """A tool call's name and namespace as the client declared them (vLLM flattens namespaces)."""
        entry = self.tool_names.get(flat)
        if entry is None:
            return flat, None
        return str(entry.get("name")), entry.get("namespace")


# -- custom tools (vLLM's tool_parsers/utils + responses/utils) ----------------------------------
def _custom_payload(parsed: Any) -> str | None:
    if not isinstance(parsed, dict):
        return None
    value = parsed.get(CUSTOM_TOOL_INPUT_KEY)
    return value if isinstance(value, str) else None


def decode_custom_input(arguments: str) -> str:
    """The payload of a completed custom-tool call; bare text passes through."""
    try:
        payload = _custom_payload(json.loads(arguments))
    except ValueError:
        return arguments
    return arguments if payload is None else payload


def decode_custom_input_prefix(arguments: str) -> str:
    """The longest decodable payload prefix of partial arguments (streamed deltas stay a prefix)."""
    try:
        parsed = partial_json_parser.loads(arguments, Allow.STR | Allow.OBJ)
    except (ValueError, IndexError, AssertionError):
        return ""
    payload = _custom_payload(parsed) or ""
    if payload and "\ud800" <= payload[-1] <= "\udbff":
        payload = payload[:-1]
    return payload


# -- items --------------------------------------------------------------------------------------
def _text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def _message(item_id: str, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"id": item_id, "content": content, "role": "assistant", "status": status, "type": "message",
            "phase": None}


def _reasoning(item_id: str, text: str | None, status: str | None) -> dict[str, Any]:
    return {"id": item_id, "summary": [], "type": "reasoning",
            "content": None if text is None else [{"text": text, "type": "reasoning_text"}],
            "encrypted_content": None, "status": status}


def _function_call(item_id: str, call_id: str, name: str, namespace: str | None, arguments: str,
                   status: str) -> dict[str, Any]:
    return {"arguments": arguments, "call_id": call_id, "name": name, "type": "function_call", "id": item_id,
            "async": None, "caller": None, "namespace": namespace, "status": status}


def _custom_call(item_id: str, call_id: str, name: str, payload: str) -> dict[str, Any]:
    return {"call_id": call_id, "input": payload, "name": name, "type": "custom_tool_call", "id": item_id,
            "async": None, "caller": None, "namespace": None}


def logprobs_of(chat_logprobs: Any) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` as Responses' output-text logprobs (same fields, vLLM's floor)."""
    def one(lp: dict[str, Any]) -> dict[str, Any]:
        return {"token": lp["token"], "bytes": lp.get("bytes") or list(lp["token"].encode()),
                "logprob": max(float(lp["logprob"]), -9999.0)}

    return [{**one(lp), "top_logprobs": [one(t) for t in lp.get("top_logprobs") or []]}
            for lp in (chat_logprobs or {}).get("content") or []]


def output_items(chat: dict[str, Any], form: ResponsesForm, make_id: NewId = new_id) -> list[dict[str, Any]]:
    """The ``output`` of a non-streaming response from the chat completion's first choice."""
    choice = chat["choices"][0]
    msg = choice.get("message") or {}
    logprobs = logprobs_of(choice.get("logprobs")) if form.logprobs else None
    if not form.parser:  # vLLM's fallback: one message, even when it is empty
        text = msg.get("content") or ""
        return [_message(f"msg_{make_id()}", [_text_part(text, logprobs)] if text else [], "completed")]
    reasoning = msg.get("reasoning")
    if not form.include_reasoning:
        reasoning, logprobs = None, None
    items: list[dict[str, Any]] = []
    if reasoning:
        items.append(_reasoning(f"rs_{make_id()}", reasoning, None))
    if msg.get("content"):
        items.append(_message(f"msg_{make_id()}", [_text_part(msg["content"], logprobs)], "completed"))
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        name, arguments = str(fn.get("name")), fn.get("arguments") or ""
        call_id = call.get("id") or f"call_{make_id()}"
        if name in form.custom_tools:
            items.append(_custom_call(f"ctc_{make_id()}", call_id, name, decode_custom_input(arguments)))
            continue
        plain, namespace = form.call_name(name)
        items.append(_function_call(f"fc_{make_id()}", call_id, plain, namespace, arguments, "completed"))
    return items


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    """Responses usage from chat's (one turn: the per-turn lists stay empty, as vLLM's)."""
    u = chat_usage or {}
    prompt, completion = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    cached = int(((u.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    reasoning_tokens = int(((u.get("completion_tokens_details") or {}).get("reasoning_tokens")) or 0)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0,
                                     "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens, "tool_output_tokens": 0,
                                      "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
            "total_tokens": prompt + completion}


def envelope(form: ResponsesForm, *, response_id: str, model: str, created: int, max_output_tokens: int,
             output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's response object with this request's outcome (``ResponsesResponse.from_request``)."""
    return {**form.response, "id": response_id, "created_at": created, "model": model,
            "max_output_tokens": max_output_tokens, "output": output, "status": status, "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None}


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


# -- the stream (vLLM's SimpleStreamingEventProcessor) --------------------------------------------
_NONE, _CONTENT, _REASONING, _TOOL = "none", "content", "reasoning", "tool_call"


def split_delta(delta: dict[str, Any]) -> list[dict[str, Any]]:
    """One typed delta per event kind: reasoning, then content, then tool calls grouped by index."""
    reasoning, content, calls = delta.get("reasoning"), delta.get("content"), delta.get("tool_calls") or []
    parts = int(reasoning is not None) + int(content is not None) + int(bool(calls))
    if parts <= 1 and (not calls or len({c.get("index") for c in calls if c.get("index") is not None}) <= 1):
        return [delta]
    out: list[dict[str, Any]] = []
    if reasoning is not None:
        out.append({"reasoning": reasoning})
    if content is not None:
        out.append({"content": content})
    if calls:
        groups: dict[Any, list[dict[str, Any]]] = {}
        for c in calls:
            groups.setdefault(c.get("index"), []).append(c)
        out.extend({"tool_calls": g} for g in groups.values())
    return out or [delta]


class ResponseStream:
    """Chat stream chunks in, Responses output events out; one instance per response.

    ``feed`` takes each chat chunk after derender; ``finish`` closes the open item. The envelope
    events (``response.created`` / ``in_progress`` / ``completed``) are the door's, which knows the
    request's id and budget; ``items`` is the output the completed response carries."""

    def __init__(self, form: ResponsesForm, make_id: NewId = new_id) -> None:
        self._form = form
        self._new_id = make_id
        self._state = _NONE
        self._output_index = 0
        self._item_id = ""
        self._text = ""
        self._logprobs: list[dict[str, Any]] = []
        self._call_id = ""
        self._call_name = ""
        self._call_namespace: str | None = None
        self._call_index: int | None = None
        self._call_custom = False
        self._call_payload = ""
        self.items: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.hide_metadata = not form.include_reasoning and form.parser

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        if chunk.get("usage") and not chunk.get("choices"):
            self.usage = chunk["usage"]
            return []
        choices = chunk.get("choices") or []
        if not choices:
            return []
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        delta = dict(choice.get("delta") or {})
        delta.pop("role", None)
        if not self._form.parser:  # vLLM without a parser: every output is content
            delta = {"content": delta.get("content") or ""}
        elif not self._form.include_reasoning:
            delta.pop("reasoning", None)
        if delta.get("content") is None and delta.get("reasoning") is None and not delta.get("tool_calls"):
            return []
        logprobs = (logprobs_of(choice.get("logprobs"))
                    if self._form.logprobs and not self.hide_metadata else [])
        events: list[Event] = []
        for d in split_delta(delta):
            target, call = self._target(d)
            if target == _NONE:
                continue
            if self._needs_transition(target, call):
                events += self.close()
                events += self._open(target, call)
            events += self._delta(d, logprobs)
        return events

    # -- the state machine -----------------------------------------------------------------------
    @staticmethod
    def _target(d: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
        calls = d.get("tool_calls") or []
        if calls and calls[0].get("function") is not None:
            return _TOOL, calls[0]
        if d.get("reasoning") is not None:
            return _REASONING, None
        if d.get("content"):
            return _CONTENT, None
        return _NONE, None

    def _needs_transition(self, target: str, call: dict[str, Any] | None) -> bool:
        if self._state != target:
            return True
        return (target == _TOOL and call is not None and self._call_index is not None
                and call.get("index") is not None and self._call_index != call.get("index"))

    def _open(self, target: str, call: dict[str, Any] | None) -> list[Event]:
        self._state, self._text = target, ""
        index = self._output_index
        if target == _CONTENT:
            self._item_id, self._logprobs = f"msg_{self._new_id()}", []
            return [{"item": _message(self._item_id, [], "in_progress"), "output_index": index,
                     "type": "response.output_item.added"},
                    {"content_index": 0, "item_id": self._item_id, "output_index": index,
                     "part": _text_part("", []), "type": "response.content_part.added"}]
        if target == _REASONING:
            self._item_id = f"rs_{self._new_id()}"
            return [{"item": _reasoning(self._item_id, None, "in_progress"), "output_index": index,
                     "type": "response.output_item.added"},
                    {"content_index": 0, "item_id": self._item_id, "output_index": index,
                     "part": {"text": "", "type": "reasoning_text"}, "type": "response.content_part.added"}]
        assert call is not None
        fn = call.get("function") or {}
        flat = str(fn.get("name"))
        self._call_custom = flat in self._form.custom_tools
        self._call_name, self._call_namespace = ((flat, None) if self._call_custom
                                                 else self._form.call_name(flat))
        self._call_index = call.get("index")
        self._call_id = call.get("id") or f"call_{self._new_id()}"
        self._call_payload = ""
        if self._call_custom:
            self._item_id = f"ctc_{self._new_id()}"
            item = _custom_call(self._item_id, self._call_id, self._call_name, "")
        else:
            self._item_id = f"fc_{self._new_id()}"
            item = _function_call(self._item_id, self._call_id, self._call_name, self._call_namespace, "",
                                  "in_progress")
        return [{"item": item, "output_index": index, "type": "response.output_item.added"}]

    def _delta(self, d: dict[str, Any], logprobs: list[dict[str, Any]]) -> list[Event]:
        index = self._output_index
        if self._state == _TOOL:
            args = "".join((c.get("function") or {}).get("arguments") or ""
                           for c in d.get("tool_calls") or [])
            if not args:
                return []
            self._text += args
            if self._call_custom:
                return self._custom_delta(decode_custom_input_prefix(self._text))
            return [{"delta": args, "item_id": self._item_id, "output_index": index,
                     "type": "response.function_call_arguments.delta"}]
        if self._state == _REASONING:
            self._text += d["reasoning"]
            return [{"content_index": 0, "delta": d["reasoning"], "item_id": self._item_id,
                     "output_index": index, "type": "response.reasoning_text.delta"}]
        self._text += d["content"]
        self._logprobs += logprobs
        return [{"content_index": 0, "delta": d["content"], "item_id": self._item_id,
                 "logprobs": [{"token": lp["token"], "logprob": lp["logprob"],
                               "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                                                for t in lp["top_logprobs"]]} for lp in logprobs],
                 "output_index": index, "type": "response.output_text.delta"}]

    def _custom_delta(self, payload: str) -> list[Event]:
        streamed = self._call_payload
        if payload == streamed:
            return []
        self._call_payload = payload
        # A payload that does not extend what was streamed cannot be retracted: resent whole (vLLM).
        delta = payload[len(streamed):] if payload.startswith(streamed) else payload
        return [{"delta": delta, "item_id": self._item_id, "output_index": self._output_index,
                 "type": "response.custom_tool_call_input.delta"}]

    def close(self) -> list[Event]:
        """The open item's done events (none when nothing is open)."""
        index, item_id, text = self._output_index, self._item_id, self._text
        if self._state == _NONE:
            return []
        events: list[Event]
        if self._state == _CONTENT:
            part = _text_part(text, self._logprobs or None)
            item = _message(item_id, [part] if text else [], "completed")
            events = [{"content_index": 0, "item_id": item_id, "logprobs": [], "output_index": index,
                       "text": text, "type": "response.output_text.done"},
                      {"content_index": 0, "item_id": item_id, "output_index": index, "part": part,
                       "type": "response.content_part.done"}]
        elif self._state == _REASONING:
            part = {"text": text, "type": "reasoning_text"}
            item = _reasoning(item_id, text, "completed")
            events = [{"content_index": 0, "item_id": item_id, "output_index": index, "text": text,
                       "type": "response.reasoning_text.done"},
                      {"content_index": 0, "item_id": item_id, "output_index": index, "part": part,
                       "type": "response.content_part.done"}]
        elif self._call_custom:
            payload = decode_custom_input(text)
            events = self._custom_delta(payload)
            events.append({"input": payload, "item_id": item_id, "output_index": index,
                           "type": "response.custom_tool_call_input.done"})
            item = _custom_call(item_id, self._call_id, self._call_name, payload)
        else:
            events = [{"arguments": text, "item_id": item_id, "output_index": index,
                       "type": "response.function_call_arguments.done", "name": self._call_name}]
            item = _function_call(item_id, self._call_id, self._call_name, self._call_namespace, text,
                                  "completed")
        events.append({"item": item, "output_index": index, "type": "response.output_item.done"})
        self.items.append(item)
        self._output_index += 1
        self._state = _NONE
        self._call_namespace, self._call_custom = None, False
        return events
