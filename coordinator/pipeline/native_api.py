"""The native chain for Messages and Responses: the client's body, as it is, to an engine's own route.

Why it exists: ``/v1/messages`` and ``/v1/responses`` are converted to chat by the render sidecar,
which runs vLLM's own conversion code (``chat_form.py``). When render is off (``render.enable:
false``), down, or a stock vLLM render server without the conversion routes, the chat path cannot
take them; the RFC sends these APIs down the native chain instead. An engine started with
``--enable-scale-out`` (marked ``native_api``) serves ``/v1/messages`` and ``/v1/responses`` itself,
so the request goes there, unconverted.

What the coordinator still does, as for any request on the native route (``native_route.py``):
model resolution, the tenant's limits, admission, placement with the scheduler's filters and scorers,
the attempt rules (retry before the first byte, breaker feeding), release however it ends.

**The prompt's size is estimated** here, not rendered: the conversion and the chat template live in
the sidecar. The local tokenizer (``local_tokenizer.py``) encodes the request's text (system or
instructions, tools, then each turn, in order) as one transcript. The count is within a few special
tokens per turn of the real prompt, and a conversation's transcript grows at its end only, so KV
affinity still sends its turns to the engine holding its prefix. Nothing is refused on this estimate:
the context check is the engine's (it answers a 400 of its own).

**The output budget**: the client's ``max_tokens`` (Messages) or ``max_output_tokens`` (Responses);
without one, what fits in the context by the estimate, capped by ``limits.default_max_tokens``, is
written into the body (what admission reserved is what the engine may produce).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from coordinator.pipeline.catalog import ModelEntry
from coordinator.pipeline.context import NativeApi, NativeCall, PromptPlan, RequestContext, StopSpec
from coordinator.pipeline.errors import BadRequest, PipelineError, UpstreamUnavailable
from coordinator.pipeline.local_tokenizer import LocalTokenizers
from coordinator.pipeline.native_route import NativeRoute, require

# The fields that make up the prompt, in the order the chat template lays them out.
_PROMPT_FIELDS: dict[NativeApi, tuple[str, ...]] = {"messages": ("system", "tools", "messages"),
                                                    "responses": ("instructions", "tools", "input")}
_BUDGET_FIELD: dict[NativeApi, str] = {"messages": "max_tokens", "responses": "max_output_tokens"}
# Keys whose values are no prompt text: identifiers, labels, and media payloads (an image's base64
# would count as thousands of text tokens).
_NOT_TEXT = frozenset({"type", "role", "id", "call_id", "tool_use_id", "cache_control", "status",
                       "source", "data", "image_url", "file_data", "file_id", "url", "media_type"})


async def plan(ctx: RequestContext, entry: ModelEntry, call: NativeCall, *, local: LocalTokenizers | None,
               route: NativeRoute | None, default_max_tokens: int | None) -> None:
    """Plan ``ctx`` (whose body is the client's ``call.api`` body) for the native route, or raise the
    reason's error saying why it cannot take it either (502, or 504 after a sidecar timeout)."""
    error = type(call.reason)
    why = call.reason.message
    if route is None or local is None:
        raise error(f"{why}, and no engine's own API is configured")
    require(route, ctx.model, why, error)
    transcript = "\n".join(transcript_parts(call.api, ctx.body)) or " "
    try:
        ids = (await local.tokenize("completion", {"prompt": transcript}, entry.name, entry.root))[0]
    except UpstreamUnavailable as exc:
        raise error(f"{why}, and {exc.message}") from exc
    budget = await _budget(ctx, entry, call, route, len(ids), default_max_tokens)
    ctx.prompts = [PromptPlan(index=0, prompt_token_ids=ids, n=1, stop=StopSpec((), False, 0),
                              generate={"request_id": ctx.request_id, "token_ids": ids,
                                        "sampling_params": {"max_tokens": budget}})]
    ctx.native_api = call.api
    ctx.tokenizer_source = "local"
    ctx.route = "native"


def transcript_parts(api: NativeApi, body: dict[str, Any]) -> Iterator[str]:
    """The request's prompt text in template order (module doc): every string that is text."""
    for name in _PROMPT_FIELDS[api]:
        yield from _texts(body.get(name))


def _texts(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        if value:
            yield value
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            if key not in _NOT_TEXT:
                yield from _texts(item)


async def _budget(ctx: RequestContext, entry: ModelEntry, call: NativeCall, route: NativeRoute,
                  prompt_tokens: int, default_max_tokens: int | None) -> int:
    """The output tokens to reserve (module doc). A budget that is not a positive integer, or a
    Messages request without its required ``max_tokens``, is the client's 400; no budget and no known
    context to size one is the operator's (the reason's error)."""
    field = _BUDGET_FIELD[call.api]
    requested = ctx.body.get(field)
    if requested is not None or call.api == "messages":
        if isinstance(requested, int) and not isinstance(requested, bool) and requested > 0:
            return requested
        raise BadRequest(f"'{field}' is required and must be a positive integer" if call.api == "messages"
                         else f"'{field}' must be a positive integer", param=field)
    context = await route.context_length(entry)
    caps = [c for c in (default_max_tokens, context - prompt_tokens if context else None) if c is not None]
    if not caps:
        error: type[PipelineError] = type(call.reason)
        raise error(f"{call.reason.message}, and the context length of model {entry.name!r} is unknown "
                    "(set models[].max_model_len)")
    return max(1, min(caps))
