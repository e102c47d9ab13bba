"""``responses.create`` and ``models.list`` results as openai-compatible/1 events.

A Responses stream already is a sequence of typed events, so NNRP does not invent another mapping:
each event the HTTP door writes for ``POST /v1/responses`` (``response.created`` … ``response.completed``,
numbered by ``sequence_number``) is one result event, built by the same ``ResponseEvents`` so the two
doors cannot drift apart. Only the ends are the profile's: a failure is ``response.error`` (with the
HTTP status, in Responses field names) and a cancellation ``response.cancelled``, because every
operation ends with exactly one of the profile's terminal events (``docs/nnrp.md``).

When the sidecar cannot convert the request (render off or down, a stock vLLM render server), it
takes the native chain as over HTTP: the engine's own ``/v1/responses`` answers, and its events
(already Responses events, numbered by the engine) are the result events as they came; its
``response.completed`` ends the operation, its ``error`` event becomes ``response.error``.

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

    __slots__ = ("_events", "_native")

    def __init__(self) -> None:
        super().__init__()
        self._events: ResponseEvents | None = None
        self._native = False

    def native(self) -> None:
        """The engine's own Responses events follow (the native chain): each goes on as it came."""
        self._native = True

    def _pass(self, event: Mapping[str, Any]) -> list[Event]:
        failed = _failure(event) if event.get("type") != "error" else dict(event)
        if failed is not None:
            self.terminated = True
            return [dict(error_event(failed))]
        if event.get("type") == COMPLETED:
            self.terminated = True
        return [dict(event)]

    def start(self, form: ResponsesForm, ctx: RequestContext) -> list[Event]:
        self._events = ResponseEvents(form, ctx)
        return [] if self.terminated else self._events.start()

    def map_chunk(self, chunk: Mapping[str, Any]) -> list[Event]:
        if self.terminated:
            return []
        if self._native:
            return self._pass(chunk)
        if self._events is None:
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
        """``response.completed`` with the whole response; None if the operation already ended. An
        engine's stream that ended without its ``response.completed`` is a failure."""
        if self.terminated:
            return None
        if self._native:
            failed = self.fail({"message": "the engine's Responses stream ended without response.completed",
                                "type": "BadGatewayError"}, 502)
            return None if failed is None else dict(failed)
        if self._events is None:
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


def map_native_response(response: Mapping[str, Any]) -> list[Event]:
    """A non-streaming ``responses.create`` on the native chain: the engine's response object as the
    ``response`` of one ``response.completed``."""
    failed = _failure(response)
    if failed is not None:
        return [dict(error_event(failed))]
    return [{"type": COMPLETED, "response": dict(response)}]


def map_models(models: Mapping[str, Any]) -> list[Event]:
    """``models.list``: one ``response.completed`` whose ``response`` is ``GET /v1/models``' list."""
    return [{"type": COMPLETED, "response": dict(models)}]
