"""``responses.create`` and ``models.list`` results as openai-compatible/1 events.

A Responses stream already is a sequence of typed events, so NNRP does not invent another mapping:
each event the HTTP door writes for ``POST /v1/responses`` (``response.created`` … ``response.completed``,
numbered by ``sequence_number``) is one result event, built by the same ``ResponseEvents`` so the two
doors cannot drift apart. Only the ends are the profile's: a failure is ``response.error`` (with the
HTTP status, in Responses field names) and a cancellation ``response.cancelled``, because every
operation ends with exactly one of the profile's terminal events (``docs/nnrp.md``).

Kept apart from ``profile.py``, which stays free of the serving path's modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coordinator.nnrp.profile import COMPLETED, EventMapper, error_event
from coordinator.pipeline.context import RequestContext
from coordinator.pipeline.responses.answer import ResponseEvents, to_response
from coordinator.pipeline.responses.convert import Event, ResponsesForm


def _failure(response: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The error detail of an OpenAI error body (``{"error": …}`` without ``choices``), else None."""
    if "error" in response and "choices" not in response:
        err = response["error"]
        return err if isinstance(err, Mapping) else {"message": str(err)}
    return None


class ResponsesStreamMapper(EventMapper):
    """One streamed ``responses.create``: chat chunks in, the HTTP door's Responses events out.

    The form and the served request are known only once the operation was converted and admitted, so
    ``start`` comes after the mapper exists (a cancel may end it before): it gives
    ``response.created`` and ``response.in_progress``; ``map_chunk`` the output items' events;
    ``flush`` the open item's done events; ``complete`` the terminal ``response.completed``.
    """

    __slots__ = ("_events",)

    def __init__(self) -> None:
        super().__init__()
        self._events: ResponseEvents | None = None

    def start(self, form: ResponsesForm, ctx: RequestContext) -> list[Event]:
        self._events = ResponseEvents(form, ctx)
        return [] if self.terminated else self._events.start()

    def map_chunk(self, chunk: Mapping[str, Any]) -> list[Event]:
        if self.terminated or self._events is None:
            return []
        failed = _failure(chunk)
        if failed is not None:
            self.terminated = True
            return [dict(error_event(failed))]
        return self._events.feed(dict(chunk))

    def flush(self) -> list[Event]:
        if self.terminated or self._events is None:
            return []
        return self._events.close()

    def complete(self) -> Event | None:
        """``response.completed`` with the whole response; None if the operation already ended."""
        if self.terminated or self._events is None:
            return None
        self.terminated = True
        return self._events.completed()


def map_response(form: ResponsesForm, chat: Mapping[str, Any], ctx: RequestContext) -> list[Event]:
    """A non-streaming ``responses.create``: one ``response.completed`` whose ``response`` is the
    object ``POST /v1/responses`` answers; an OpenAI error body gives ``response.error``."""
    failed = _failure(chat)
    if failed is not None:
        return [dict(error_event(failed))]
    return [{"type": COMPLETED, "response": to_response(form, dict(chat), ctx)}]


def map_models(models: Mapping[str, Any]) -> list[Event]:
    """``models.list``: one ``response.completed`` whose ``response`` is ``GET /v1/models``' list."""
    return [{"type": COMPLETED, "response": dict(models)}]
