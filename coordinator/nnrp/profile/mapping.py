"""OpenAI chat output as the profile's events (a stream chunk by chunk, or one answer)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from coordinator.nnrp.profile.constants import COMPLETED, OUTPUT_TEXT_DELTA, TOOL_CALL_DELTA, USAGE
from coordinator.nnrp.profile.events import (
    CancelledEvent,
    ChoiceFinish,
    ChunkEvent,
    CompletedEvent,
    ErrorEvent,
    Event,
    cancelled_event,
    error_event,
)


class EventMapper:
    """What every operation's mapper keeps: exactly one terminal event, and nothing after it.

    ``fail`` and ``cancel`` give the terminal event of an end outside the operation's output (a
    pipeline error, a cancellation), or None once another terminal event was produced. ``flush`` gives
    the events an operation's output still owes once its stream ended, before ``complete()``'s
    terminal event (none for chat; a Responses stream closes its open output item). A non-streaming
    operation uses only the terminal state: its whole result is mapped at once.
    """

    __slots__ = ("terminated",)

    def __init__(self) -> None:
        self.terminated = False

    def flush(self) -> Sequence[Mapping[str, Any]]:
        return ()

    def fail(self, detail: Mapping[str, Any], status: int | None = None) -> ErrorEvent | None:
        """The terminal event for a failure outside the chunk stream (e.g. a pipeline error)."""
        if self.terminated:
            return None
        self.terminated = True
        return error_event(detail, status)

    def cancel(self, source: str, reason: str, *, operation_id: str | None = None,
               engine_abort_accepted: bool | None = None) -> CancelledEvent | None:
        """The terminal event for a cancellation; None if the operation already ended otherwise."""
        if self.terminated:
            return None
        event = cancelled_event(source, reason, operation_id=operation_id,
                                engine_abort_accepted=engine_abort_accepted)
        self.terminated = True
        return event


class ChatStreamMapper(EventMapper):
    """Turns one operation's chat.completion.chunk dicts, as the SSE path emits them, into events.

    Per chunk and choice: non-empty ``delta.content`` → ``response.output_text.delta``, each
    ``delta.tool_calls[]`` entry → ``response.tool_call.delta``; the usage chunk (``choices: []``) →
    ``response.usage``; a ``{"error": …}`` chunk → ``response.error``. A finish reason is remembered
    and reported by ``complete()``, the terminal ``response.completed`` after the stream ended (so it
    follows the usage event, which comes after every choice finished). The role-opening chunk and empty
    deltas carry no profile data and give no event. After a terminal event the mapper is closed: later
    chunks give nothing and another terminal gives None, so nothing can follow ``response.cancelled``.
    """

    __slots__ = ("_finish", "_id", "_model", "include_openai_chunk")

    def __init__(self, *, include_openai_chunk: bool = False) -> None:
        super().__init__()
        self.include_openai_chunk = include_openai_chunk
        self._finish: dict[int, str | None] = {}
        self._id: str | None = None
        self._model: str | None = None

    def map_chunk(self, chunk: Mapping[str, Any]) -> list[ChunkEvent]:
        if self.terminated:
            return []
        events: list[ChunkEvent] = []
        if "error" in chunk and "choices" not in chunk:
            self.terminated = True
            err = chunk["error"]
            events.append(error_event(err if isinstance(err, Mapping) else {"message": str(err)}))
            if self.include_openai_chunk:
                events[0]["openai_chunk"] = chunk
            return events
        if self._id is None:
            self._id = chunk.get("id")
            self._model = chunk.get("model")
        choices = chunk.get("choices") or ()
        for choice in choices:
            index = choice.get("index", 0)
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                events.append({"type": OUTPUT_TEXT_DELTA, "choice_index": index, "delta": content})
            for call in delta.get("tool_calls") or ():
                events.append({"type": TOOL_CALL_DELTA, "choice_index": index, "tool_call": call})
            finish = choice.get("finish_reason")
            if finish is not None or index not in self._finish:
                self._finish[index] = finish
        usage = chunk.get("usage")
        if not choices and isinstance(usage, Mapping):
            events.append({"type": USAGE, "usage": usage})
        if events and self.include_openai_chunk:
            events[0]["openai_chunk"] = chunk
        return events

    def complete(self) -> CompletedEvent | None:
        """The terminal event once the chunk stream ended normally; None if already terminated."""
        if self.terminated:
            return None
        self.terminated = True
        return _completed(self._id, self._model, self._finish)


def _completed(response_id: Any, model: Any, finish: Mapping[int, str | None]) -> CompletedEvent:
    choices: list[ChoiceFinish] = [{"index": i, "finish_reason": finish[i]} for i in sorted(finish)]
    return {"type": COMPLETED, "id": response_id if isinstance(response_id, str) else None,
            "model": model if isinstance(model, str) else None,
            "finish_reason": choices[0]["finish_reason"] if choices else None, "choices": choices}


def map_chat_completion(response: Mapping[str, Any]) -> list[Event]:
    """A non-streaming result: ``response.usage`` (when the body has usage) then ``response.completed``
    carrying the whole chat.completion as ``response``; an OpenAI error body gives ``response.error``."""
    if "error" in response and "choices" not in response:
        err = response["error"]
        return [error_event(err if isinstance(err, Mapping) else {"message": str(err)})]
    events: list[Event] = []
    usage = response.get("usage")
    if isinstance(usage, Mapping):
        events.append({"type": USAGE, "usage": usage})
    finish = {c.get("index", i): c.get("finish_reason") for i, c in enumerate(response.get("choices") or ())}
    completed = _completed(response.get("id"), response.get("model"), finish)
    completed["response"] = response
    events.append(completed)
    return events
