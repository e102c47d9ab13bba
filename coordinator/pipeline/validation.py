"""Client request checks done before render: the supported field list and value ranges.

Render (vLLM's own pydantic models) validates the rest; its 4xx answers reach the client unchanged.
Checks here exist because render is more permissive than the OpenAI API (e.g. temperature > 2) or
because the token-only path cannot honour a field (structured outputs need a tokenizer on the engine).
The supported field list is documented in docs/openai-api.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, Literal

from coordinator.pipeline.errors import BadRequest

log = logging.getLogger(__name__)

# Fields understood by both endpoints (OpenAI + vLLM sampling extras).
_COMMON = frozenset({
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user",
    # vLLM extras
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "add_special_tokens", "priority", "cache_salt", "request_id", "allowed_token_ids", "bad_words",
    "return_token_ids",
})
CHAT_FIELDS = _COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "response_format", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "documents", "include_reasoning",
}
COMPLETION_FIELDS = _COMMON | {"prompt"}

Kind = Literal["chat", "completion"]


def _num(name: str, lo: float | None, hi: float | None, *, lo_open: bool = False,
         integer: bool = False) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok_type or (isinstance(v, float) and not math.isfinite(v)):
            raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}, got {v!r}",
                             param=name)
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise BadRequest(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", param=name)
        if hi is not None and v > hi:
            raise BadRequest(f"'{name}' must be <= {hi}, got {v}", param=name)
    return check


def _bool(name: str) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if not isinstance(v, bool):
            raise BadRequest(f"'{name}' must be a boolean, got {v!r}", param=name)
    return check


def _stop(v: Any) -> None:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise BadRequest("'stop' must be a string or a list of strings", param="stop")
    if any(s == "" for s in items):
        raise BadRequest("'stop' strings must not be empty", param="stop")


def _stream_options(v: Any) -> None:
    if not isinstance(v, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    for k, val in v.items():
        if k not in ("include_usage", "continuous_usage_stats"):
            raise BadRequest(f"Unsupported field 'stream_options.{k}'", param=f"stream_options.{k}")
        _bool(f"stream_options.{k}")(val)


def _response_format(v: Any) -> None:
    if not isinstance(v, dict) or v.get("type") not in ("text",):
        raise BadRequest(
            "'response_format' other than {\"type\": \"text\"} needs structured outputs, which a token-only "
            "engine cannot run (it has no tokenizer)", param="response_format")


_CHECKS: dict[str, Callable[[Any], None]] = {
    "temperature": _num("temperature", 0, 2),
    "top_p": _num("top_p", 0, 1, lo_open=True),
    "n": _num("n", 1, 128, integer=True),
    "max_tokens": _num("max_tokens", 1, None, integer=True),
    "max_completion_tokens": _num("max_completion_tokens", 1, None, integer=True),
    "presence_penalty": _num("presence_penalty", -2, 2),
    "frequency_penalty": _num("frequency_penalty", -2, 2),
    "repetition_penalty": _num("repetition_penalty", 0, 2, lo_open=True),
    "top_k": _num("top_k", -1, None, integer=True),
    "min_p": _num("min_p", 0, 1),
    "min_tokens": _num("min_tokens", 0, None, integer=True),
    "seed": _num("seed", None, None, integer=True),
    "top_logprobs": _num("top_logprobs", 0, 20, integer=True),
    "priority": _num("priority", None, None, integer=True),
    "stream": _bool("stream"),
    "ignore_eos": _bool("ignore_eos"),
    "include_stop_str_in_output": _bool("include_stop_str_in_output"),
    "skip_special_tokens": _bool("skip_special_tokens"),
    "stop": _stop,
    "stream_options": _stream_options,
    "response_format": _response_format,
}


def validate_request(kind: Kind, body: Any, *, strict: bool) -> dict[str, Any]:
    """Return the body to render (unsupported fields dropped in compat mode) or raise ``BadRequest``."""
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object")
    allowed = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        if strict:
            raise BadRequest(f"Unsupported field(s) for this endpoint: {', '.join(unknown)}. "
                             "See the supported field list in the coordinator's docs.", param=unknown[0])
        log.info("compat mode: ignoring unsupported field(s) %s", unknown)
        body = {k: v for k, v in body.items() if k in allowed}
    if "model" not in body:
        raise BadRequest("'model' is required", param="model")
    if kind == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise BadRequest("'messages' must be a non-empty list of message objects", param="messages")
    else:
        _check_prompt(body.get("prompt"))
    for key, value in body.items():
        check = _CHECKS.get(key)
        if check is not None and value is not None:
            check(value)
    if kind == "chat":
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise BadRequest("'logprobs' must be a boolean for chat completions", param="logprobs")
        if body.get("top_logprobs") is not None and not lp:
            raise BadRequest("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    elif body.get("logprobs") is not None:
        _num("logprobs", 0, 20, integer=True)(body["logprobs"])
    if body.get("stream_options") is not None and not body.get("stream"):
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    checked: dict[str, Any] = body
    return checked


def _check_prompt(p: Any) -> None:
    ok = (isinstance(p, str)
          or (isinstance(p, list) and p and (
              all(isinstance(x, str) for x in p)
              or all(isinstance(x, int) and not isinstance(x, bool) for x in p)
              or all(isinstance(x, list) and x and all(isinstance(t, int) for t in x) for x in p))))
    if not ok:
        raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                         "token-id lists, and must not be empty", param="prompt")
