"""OpenAI Responses → OpenAI chat, built from vLLM's own pieces, for the coordinator.

The coordinator serves ``/v1/responses`` on its chat path (render, admission, KV-affinity
scheduling, token-only engines, derender with the request's tools and parsers), as it does
``/v1/messages``. vLLM's ``/v1/responses/render`` answers only token ids, and derender needs the
chat form (tools, tool choice, stop strings, sampling fields). vLLM has no Responses → chat
converter as such, but its non-Harmony Responses render *is* a chat render of
``construct_input_messages`` with ``construct_tool_dicts`` and the chat-template kwargs of
``ResponsesRequest.build_chat_params``; this route assembles exactly those into a chat request, so
rendering it on ``/v1/chat/completions/render`` gives ``/v1/responses/render``'s token ids (a test
holds the two equal on a real sidecar).

``POST /v1/responses/chat`` answers::

    {"chat": <ChatCompletionRequest JSON>,
     "response": <vLLM's ResponsesResponse for the request, status "in_progress", no output>,
     "tool_names": {<flat name>: {"name", "namespace"}},   # namespace tools, as vLLM flattens them
     "custom_tools": [<custom tool name>, ...],
     "parser": <whether a tool-call or reasoning parser runs: vLLM builds output items differently>}

``response`` is ``ResponsesResponse.from_request`` (the 20-odd request fields vLLM echoes, with the
server's default sampling values filled in); the coordinator adds ``output``, ``status``, ``usage``
and ``max_output_tokens`` (which needs the prompt's length) when the answer is in.

Refused with a 400 naming the field, because this path is stateless and runs no tools itself:
``previous_response_id`` (as vLLM's render does), ``background``, built-in tools (anything but
``function``, ``custom`` and ``namespace`` tools), a ``tool_choice`` that is not ``auto``, ``none``,
``required`` or one function, and ``truncation: "auto"`` (the coordinator cuts the input to fit
before it asks for the chat form: ``coordinator/pipeline/responses/truncation.py``).
Harmony models (gpt-oss) render their own format and are refused by the coordinator's path.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from render_sidecar.messages import bad_request, parse

# Tool types the model is shown as functions (vLLM's ``get_function_tools``); the rest are built-in
# tools vLLM runs on a tool server, with a stored conversation.
FUNCTION_TOOL_TYPES = frozenset({"function", "custom", "namespace"})
# Request fields whose values go to chat under the same name.
_SAME_NAME = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logit_bias",
              "skip_special_tokens", "include_stop_str_in_output", "include_reasoning", "user",
              "cache_salt", "priority", "parallel_tool_calls", "stream", "vllm_xargs")


def _tool_choice(choice: Any) -> Any:
    """Responses' tool choice in chat's form; ``None`` for one chat has no form for."""
    if isinstance(choice, str):
        return choice if choice in ("auto", "none", "required") else None
    data = choice.model_dump() if hasattr(choice, "model_dump") else choice
    if isinstance(data, dict) and data.get("type") == "function" and isinstance(data.get("name"), str):
        return {"type": "function", "function": {"name": data["name"]}}
    return None


def _chat_part(part: Any) -> Any:
    """A Responses content part in chat's spelling. vLLM's chat parser reads both spellings alike
    (``MM_PARSER_MAP``: ``input_text``/``output_text`` as ``text``, ``input_image``'s URL as
    ``image_url``'s), but ``ChatCompletionRequest`` only admits chat's."""
    if not isinstance(part, dict):
        return part
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text")}
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    return part


def _chat_message(message: Any) -> Any:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):
        return {**message, "content": [_chat_part(p) for p in content]}
    return message


def chat_form(parsed: Any, *, exclude_tools_when_none: bool) -> dict[str, Any] | JSONResponse:
    """The chat request vLLM's Responses render would render, or a 400."""
    from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts

    if parsed.previous_response_id is not None:
        return bad_request("previous_response_id is not supported: this server keeps no responses "
                           "(store is off); send the whole conversation in 'input'", "previous_response_id")
    if parsed.background:
        return bad_request("background mode is not supported: this server keeps no responses (store is "
                           "off)", "background")
    for i, tool in enumerate(parsed.tools):
        if tool.type not in FUNCTION_TOOL_TYPES:
            return bad_request(f"Built-in tool type {tool.type!r} is not supported; only function, custom "
                               f"and namespace tools are", f"tools[{i}].type")
    if parsed.truncation == "auto":
        return bad_request("truncation 'auto' is not supported; send a prompt that fits (truncation "
                           "'disabled')", "truncation")
    tool_choice = _tool_choice(parsed.tool_choice)
    if tool_choice is None:
        return bad_request("tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                           "\"name\": ...}", "tool_choice")
    try:
        messages = [_chat_message(m) for m in construct_input_messages(
            request_instructions=parsed.instructions, request_input=parsed.input)]
    except ValueError as exc:  # vLLM's VLLMValidationError for an input item it cannot convert
        return bad_request(str(exc), getattr(exc, "parameter", None) or "input")
    params = parsed.build_chat_params(None, "auto")  # kwargs only; render applies its own template
    kwargs = dict(params.chat_template_kwargs or {})
    chat: dict[str, Any] = {
        "model": parsed.model, "messages": messages,
        "add_generation_prompt": kwargs.pop("add_generation_prompt", True),
        "continue_final_message": kwargs.pop("continue_final_message", False),
    }
    effort = kwargs.pop("reasoning_effort", None)
    if effort is not None:
        chat["reasoning_effort"] = effort
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    tools = construct_tool_dicts(parsed.tools, parsed.tool_choice,
                                 exclude_tools_when_tool_choice_none=exclude_tools_when_none)
    if tools:
        chat["tools"] = tools
    if parsed.tools:
        chat["tool_choice"] = tool_choice
    if parsed.max_output_tokens is not None:
        chat["max_tokens"] = parsed.max_output_tokens
    for name in _SAME_NAME:
        value = getattr(parsed, name)
        if value is not None and value != [] and name in parsed.model_fields_set:
            chat[name] = value
    if parsed.stream:
        chat["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    if parsed.is_include_output_logprobs():
        chat["logprobs"] = True
        chat["top_logprobs"] = parsed.top_logprobs or 0
    fmt = parsed.text.format if parsed.text is not None else None
    if fmt is not None:
        chat["response_format"] = _chat_response_format(
            fmt.model_dump(mode="json", by_alias=True, exclude_none=True))
    if parsed.structured_outputs is not None:
        chat["structured_outputs"] = parsed.model_dump(mode="json", include={"structured_outputs"})[
            "structured_outputs"]
    return chat


def _chat_response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """Responses' flat ``text.format`` (``{"type": "json_schema", "name", "schema", "strict"}``) in
    Chat Completions' shape (``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``);
    ``text`` and ``json_object`` are the same in both."""
    if fmt.get("type") != "json_schema":
        return fmt
    inner = {k: v for k, v in fmt.items() if k != "type"}
    return {"type": "json_schema", "json_schema": inner}


def _tool_names(tools: list[Any]) -> tuple[dict[str, dict[str, str | None]], list[str]]:
    from vllm.tool_parsers.utils import build_responses_tool_call_name_map

    names = {flat: {"name": n.name, "namespace": n.namespace}
             for flat, n in build_responses_tool_call_name_map(tools).items()}
    return names, [t.name for t in tools if t.type == "custom"]


async def responses_chat(request: Request) -> JSONResponse:
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest, ResponsesResponse

    parsed = parse(ResponsesRequest, await request.body())
    if isinstance(parsed, JSONResponse):
        return parsed
    state = request.app.state
    renderer = getattr(state, "online_renderer", None)
    if getattr(renderer, "use_harmony", False):
        return bad_request("Harmony models (gpt-oss) are not served on this path", "model")
    chat = chat_form(parsed, exclude_tools_when_none=bool(
        getattr(renderer, "exclude_tools_when_tool_choice_none", False)))
    if isinstance(chat, JSONResponse):
        return chat
    defaults = getattr(getattr(state, "serving_render", None), "default_sampling_params", None) or {}
    try:
        # max_tokens depends on the prompt's length, known only after render: the coordinator sets
        # max_output_tokens from its plan; 1 here only satisfies the model.
        params = parsed.to_sampling_params(1, defaults)
    except ValueError as exc:  # e.g. both text.format and structured_outputs
        return bad_request(str(exc), getattr(exc, "parameter", None))
    parsed.store = False  # as vLLM without a response store (VLLM_ENABLE_RESPONSES_API_STORE unset)
    skeleton = ResponsesResponse.from_request(parsed, params, model_name=parsed.model or "", created_time=0,
                                              output=[], status="in_progress", usage=None)
    names, custom = _tool_names(parsed.tools)
    return JSONResponse({"chat": chat, "response": skeleton.model_dump(mode="json", by_alias=True),
                         "tool_names": names, "custom_tools": custom,
                         "parser": getattr(renderer, "parser", None) is not None})
