"""Anthropic Messages → OpenAI chat, converted by vLLM's own code, for the coordinator.

The coordinator serves ``/v1/messages`` on its chat path (render, admission, scheduling, token-only
engines, derender with the request's tools and parsers), so it needs the *chat form* of a Messages
request, not only its tokens: derender reads ``tools``, ``tool_choice``, the stop strings and the
sampling fields. vLLM's ``/v1/messages/render`` converts and renders but answers only the tokens.
These two routes answer the conversion itself, made by vLLM's
``AnthropicServingMessages.to_chat_completion_request`` with the render server's own
``merge_inline_system`` setting, i.e. exactly what ``/v1/messages/render`` renders; rendering the
answer on ``/v1/chat/completions/render`` gives ``/v1/messages/render``'s token ids (a test holds
the two equal on a real sidecar).

* ``POST /v1/messages/chat``: an ``AnthropicMessagesRequest`` → the ``ChatCompletionRequest`` JSON;
* ``POST /v1/messages/count_tokens/chat``: an ``AnthropicCountTokensRequest`` → the same, without
  sampling fields.

Unset and ``null`` fields are left out of the answer (the coordinator treats ``null`` as unset). A
body vLLM's models refuse is a 400 in vLLM's error shape, naming the first bad field.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse


def bad_request(message: str, param: str | None = None) -> JSONResponse:
    """A 400 in vLLM's error shape."""
    return JSONResponse({"error": {"message": message, "type": "BadRequestError", "param": param,
                                   "code": 400}}, status_code=400)


def parse(model: Any, raw: bytes) -> Any:
    """``raw`` validated by one of vLLM's request models, or a 400 naming the first bad field."""
    from pydantic import ValidationError

    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors()
        loc = errors[0]["loc"] if errors else ()
        what = errors[0]["msg"] if errors else "invalid request"
        field = _param(loc)
        return bad_request(f"Invalid value for '{field}': {what}" if field else f"Invalid request: {what}",
                           field or None)
    except ValueError as exc:  # a model validator's own refusal (vLLM raises VLLMValidationError)
        return bad_request(str(exc), getattr(exc, "parameter", None))


def _param(loc: tuple[int | str, ...]) -> str:
    """The client's field in OpenAI's spelling (``tools[0]``): the top-level name and the list indexes
    right after it; pydantic's further steps name union members (``str``, ``FunctionTool``), which
    are no field of the request."""
    if not loc:
        return ""
    out = str(loc[0])
    for step in loc[1:]:
        if not isinstance(step, int):
            break
        out += f"[{step}]"
    return out


async def _convert(request: Request, *, count: bool) -> JSONResponse:
    from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    model: Any = AnthropicCountTokensRequest if count else AnthropicMessagesRequest
    parsed = parse(model, await request.body())
    if isinstance(parsed, JSONResponse):
        return parsed
    serving = getattr(request.app.state, "serving_render", None)
    merge = bool(getattr(serving, "_merge_inline_system", False))
    try:
        chat = AnthropicServingMessages.to_chat_completion_request(parsed, merge_inline_system=merge)
    except (ValueError, TypeError) as exc:  # e.g. a tool_removal naming an undeclared tool
        return bad_request(str(exc), "messages")
    out = chat.model_dump(mode="json", exclude_unset=True, exclude_none=True)
    if chat.response_format is not None:
        # Set after construction (``output_config.format``): by field name its schema would dump as
        # ``json_schema``, which the chat model reads back as no schema at all; the wire name is the alias.
        fmt = chat.response_format
        out["response_format"] = fmt.model_dump(mode="json", by_alias=True, exclude_none=True)
    return JSONResponse(out)


async def messages_chat(request: Request) -> JSONResponse:
    return await _convert(request, count=False)


async def count_tokens_chat(request: Request) -> JSONResponse:
    return await _convert(request, count=True)
