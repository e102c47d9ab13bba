"""One Responses answer, for every door: the response object, and the numbered event sequence.

``convert.py`` turns chat output into Responses items and item events; what it leaves to the door is
what needs the served request (its id, model, creation time, output budget) and the stream's order:
``response.created`` and ``response.in_progress`` first, ``response.completed`` last, every event
numbered in the order written (``sequence_number``). The HTTP door (``api/openai/responses.py``)
frames these events as SSE and NNRP (``nnrp/responses.py``) sends each as a result event; keeping
the sequence here is what makes the two doors answer the same request alike.
"""

from __future__ import annotations

from typing import Any

from coordinator.pipeline.context import RequestContext
from coordinator.pipeline.responses.convert import (
    Event,
    ResponsesForm,
    ResponseStream,
    envelope,
    output_items,
    status_of,
    usage,
)


def response_id(ctx: RequestContext) -> str:
    """``resp_<request id>``: the id is the request's, so logs and engine request ids find it."""
    return f"resp_{ctx.request_id}"


def max_output_tokens(ctx: RequestContext) -> int:
    """The output budget the request was admitted with (echoed as ``max_output_tokens``)."""
    return ctx.prompts[0].max_tokens if ctx.prompts else 0


def to_response(form: ResponsesForm, chat: dict[str, Any], ctx: RequestContext) -> dict[str, Any]:
    """The chat completion as a Responses response object."""
    choice = (chat.get("choices") or [{}])[0]
    return envelope(form, response_id=response_id(ctx), model=ctx.public_model, created=ctx.created,
                    max_output_tokens=max_output_tokens(ctx), output=output_items(chat, form),
                    status=status_of(choice.get("finish_reason")), usage=usage(chat.get("usage")))


class ResponseEvents:
    """One streamed response's events in write order, each numbered as vLLM numbers them.

    ``start()`` gives ``response.created`` and ``response.in_progress``; ``feed(chunk)`` the output
    items' events of each chat chunk; ``close()`` the open item's done events; ``completed()`` the
    terminal ``response.completed`` with the whole response. ``number`` numbers any other event the
    door writes into the same stream (the HTTP door's ``error`` event), so numbers never repeat.
    """

    def __init__(self, form: ResponsesForm, ctx: RequestContext) -> None:
        self._form = form
        self._ctx = ctx
        self._convert = ResponseStream(form)
        self._next = 0

    def number(self, event: Event) -> Event:
        """``event`` (a fresh dict, as every producer here makes) with its number, set in place."""
        event["sequence_number"] = self._next
        self._next += 1
        return event

    def _response(self, output: list[dict[str, Any]], status: str,
                  usage_: dict[str, Any] | None) -> dict[str, Any]:
        return envelope(self._form, response_id=response_id(self._ctx), model=self._ctx.public_model,
                        created=self._ctx.created, max_output_tokens=max_output_tokens(self._ctx),
                        output=output, status=status, usage=usage_)

    def start(self) -> list[Event]:
        started = self._response([], "in_progress", None)
        return [self.number({"response": started, "type": "response.created"}),
                self.number({"response": started, "type": "response.in_progress"})]

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        return [self.number(event) for event in self._convert.feed(chunk)]

    def close(self) -> list[Event]:
        return [self.number(event) for event in self._convert.close()]

    def completed(self) -> Event:
        convert = self._convert
        done = self._response(convert.items, status_of(convert.finish_reason), usage(convert.usage))
        return self.number({"response": done, "type": "response.completed"})
