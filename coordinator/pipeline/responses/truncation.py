"""``truncation: "auto"``: a Responses input that does not fit the context loses its oldest turns.

OpenAI's rule: when the input (a stored conversation included) exceeds the model's context window,
items are dropped from the beginning of the conversation until it fits. We drop whole turns: the
cut always lands on a message from the user (or the system / developer), so a tool call never loses
the call its output answers. The newest item is never dropped; if it alone does not fit, the
request is refused as with ``truncation: "disabled"``.

How much to drop is found by rendering: the render sidecar counts the prompt's tokens (the chat
template's own tokens included, which no estimate knows), and a binary search over the number of
dropped turns needs at most log2(turns) + 1 renders. A request with ``truncation: "auto"`` pays one
render more than one without (the count), a truncated one a few more. Nothing stored changes: the
stored conversation stays whole and the next turn is cut again if it must be.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from coordinator.pipeline.errors import BadRequest, UpstreamClientError
from coordinator.pipeline.responses.convert import ResponsesForm

Item = dict[str, Any]
Measure = Callable[[dict[str, Any]], Awaitable[tuple[int, int]]]   # chat form → (prompt tokens, context)
Convert = Callable[[dict[str, Any]], Awaitable[ResponsesForm]]      # a Responses body → its chat form


def _starts_turn(item: Item) -> bool:
    return item.get("type", "message") == "message" and item.get("role") in ("user", "system", "developer")


def cuts(items: list[Item]) -> list[int]:
    """Where the input may start: 0 (nothing dropped), then every later turn's first item; never past
    the newest item."""
    return [0] + [i for i in range(1, len(items)) if _starts_turn(items[i])]


async def fit(body: dict[str, Any], items: list[Item], convert: Convert, measure: Measure) -> ResponsesForm:
    """The chat form of ``body`` with ``items`` as its input, its oldest turns dropped as needed."""
    out = body.get("max_output_tokens")
    room_needed = out if isinstance(out, int) and out > 0 else 1

    async def attempt(start: int) -> tuple[ResponsesForm | None, ResponsesForm | None]:
        """(the form when it fits, else None; the form either way, None when render refused it)."""
        form = await convert({**body, "input": items[start:]})
        try:
            tokens, context = await measure(form.chat)
        except UpstreamClientError as exc:
            if exc.param == "input_tokens" or "context length" in exc.message:
                return None, None     # render refused it as too long (vLLM's own check)
            raise                     # anything else is the request's own fault: as it is
        return (form if tokens + room_needed <= context else None), form

    starts = cuts(items)
    fitting, _ = await attempt(0)
    if fitting is not None:
        return fitting
    lo, hi = 1, len(starts) - 1          # the smallest cut that fits, if any does
    best: ResponsesForm | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        form, _ = await attempt(starts[mid])
        if form is not None:
            best, hi = form, mid - 1
        else:
            lo = mid + 1
    if best is None:
        raise BadRequest("The input does not fit the model's context even with only its newest turn "
                         "(truncation: auto drops whole earlier turns)", param="input")
    return best
