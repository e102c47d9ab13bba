"""Client request checks done before render: the supported field list and value ranges.

Render (vLLM's own pydantic models) validates the rest; its 4xx answers reach the client with their
pydantic detail turned into the user's terms (``errors.UpstreamClientError``). Checks here exist
because render is more permissive than the OpenAI API (e.g. temperature > 2, any message role),
because a token-only engine has no tokenizer to catch what native vLLM would (token ids are checked
in ``token_ids.py``; structured-output shapes in ``structured.py``), or because the token path cannot
honour a field.

Strict mode refuses only what cannot be honoured: a field set to ``null`` is unset, and OpenAI fields
at values that change nothing (``store: false``, ``best_of: 1``, ``suffix: ""``, ...) are accepted
and dropped. The supported field list is documented in docs/openai-api.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, Literal

from coordinator.pipeline.errors import BadRequest
from coordinator.pipeline.structured import check_response_format, check_structured_outputs
from coordinator.pipeline.token_ids import ENGINE_MAX_LOGPROBS, MAX_LOGPROB_TOKEN_IDS, bias_keys, is_id_list

log = logging.getLogger(__name__)

# Fields understood by both endpoints (OpenAI + vLLM sampling extras).
_COMMON = frozenset({
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user",
    # vLLM extras
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "add_special_tokens", "priority", "cache_salt", "request_id", "allowed_token_ids", "return_token_ids",
    # Grammars: render builds them, an engine with a tokenizer runs them (engines/capabilities.py).
    "response_format", "structured_outputs",
    # The engine turns bad words into ids with its tokenizer: only engines that load one take them.
    "bad_words",
    # Render truncates the prompt ids it returns (vLLM's renderer, with its tokenizer).
    "truncate_prompt_tokens", "truncation_side",
    # The engine scores the prompt; derender names its tokens (derender/echo.py).
    "echo", "prompt_logprobs",
    # Logprob tokens named by id: renamed from the engine's ids after derender (token_names.py).
    "return_tokens_as_token_ids",
    # Logprobs of the ids the client names at each position (the engine is asked so that the token
    # route returns every one of them: fixups.py, widen_logprob_token_ids).
    "logprob_token_ids",
    # The engine applies these on ids alone (its scheduler's stop check; its configured watermark).
    "repetition_detection", "watermarking",
    # The engine ends reasoning after this many tokens (its --reasoning-parser; ids from its tokenizer).
    "thinking_token_budget",
})
CHAT_FIELDS = _COMMON | {
    "return_prompt_text",  # render's /detokenize of the prompt ids (prompt_echo.py)
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "documents", "include_reasoning", "reasoning_effort",
}
COMPLETION_FIELDS = _COMMON | {"prompt"}


def _is(value: Any) -> Callable[[Any], bool]:
    return lambda v: v == value and type(v) is type(value)


def _str_map(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())


# OpenAI fields the coordinator does not implement, accepted (and dropped before render) at the values
# that make them no-ops. SDK defaults and framework settings send these; refusing them breaks clients
# for nothing. Any other value is a 400 naming the field, since we could not honour it.
NO_OP_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "store": (_is(False), "false"),
    "metadata": (_str_map, "an object of strings (kept only with store, which is off)"),
    "service_tier": (lambda v: v in ("auto", "default"), "'auto' or 'default'"),
    "best_of": (_is(1), "1"),
    "suffix": (_is(""), "an empty string"),
    "modalities": (lambda v: v == ["text"], "[\"text\"]"),
    "safety_identifier": (lambda v: isinstance(v, str), "a string"),
    "prompt_cache_key": (lambda v: isinstance(v, str), "a string"),
    # vLLM: "ignored on regular generation endpoints" (only render answers offsets).
    "return_token_offsets": (lambda v: isinstance(v, bool), "a boolean (vLLM ignores it here)"),
}
_CHAT_ONLY_NO_OPS = frozenset({"store", "metadata", "service_tier", "modalities", "safety_identifier",
                               "prompt_cache_key"})
_COMPLETION_ONLY_NO_OPS = frozenset({"best_of", "suffix"})

# OpenAI's message roles (plus Llama 3's ``ipython`` tool-result role, which chat templates use).
MESSAGE_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function", "ipython"})

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1

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
        if val is None:
            continue
        if k == "include_obfuscation":
            if val is not False:  # a no-op at false; obfuscation padding is not implemented
                raise BadRequest("'stream_options.include_obfuscation' is not supported by this server",
                                 param="stream_options.include_obfuscation")
            continue
        if k not in ("include_usage", "continuous_usage_stats"):
            raise BadRequest(f"Unsupported field 'stream_options.{k}'", param=f"stream_options.{k}")
        _bool(f"stream_options.{k}")(val)


def _id_list(name: str) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if not is_id_list(v):
            raise BadRequest(f"'{name}' must be a list of token ids (integers)", param=name)
    return check


def _logprob_token_ids(v: Any) -> None:
    _id_list("logprob_token_ids")(v)
    if len(v) > MAX_LOGPROB_TOKEN_IDS:
        raise BadRequest(
            f"'logprob_token_ids' may name at most {MAX_LOGPROB_TOKEN_IDS} ids here: the token route "
            f"returns them as the engine's top logprobs (one more entry than asked, the sampled token), "
            f"and engines and derender hold those to --max-logprobs ({ENGINE_MAX_LOGPROBS})",
            param="logprob_token_ids")


def _logit_bias(v: Any) -> None:
    if not isinstance(v, dict):
        raise BadRequest("'logit_bias' must be an object mapping token ids to numbers", param="logit_bias")
    bias_keys(v)
    for bias in v.values():
        _num("logit_bias", -100, 100)(bias)



_CHECKS: dict[str, Callable[[Any], None]] = {
    "temperature": _num("temperature", 0, 2),
    "top_p": _num("top_p", 0, 1, lo_open=True),
    "n": _num("n", 1, 128, integer=True),
    "max_tokens": _num("max_tokens", 1, INT32_MAX, integer=True),
    "max_completion_tokens": _num("max_completion_tokens", 1, INT32_MAX, integer=True),
    "presence_penalty": _num("presence_penalty", -2, 2),
    "frequency_penalty": _num("frequency_penalty", -2, 2),
    "repetition_penalty": _num("repetition_penalty", 0, 2, lo_open=True),
    "top_k": _num("top_k", -1, INT32_MAX, integer=True),
    "min_p": _num("min_p", 0, 1),
    "min_tokens": _num("min_tokens", 0, INT32_MAX, integer=True),
    "seed": _num("seed", INT64_MIN, INT64_MAX, integer=True),
    "top_logprobs": _num("top_logprobs", 0, 20, integer=True),
    "priority": _num("priority", INT64_MIN, INT64_MAX, integer=True),
    "stream": _bool("stream"),
    "ignore_eos": _bool("ignore_eos"),
    "watermarking": _bool("watermarking"),
    "repetition_detection": lambda v: _object("repetition_detection", v),
    "echo": _bool("echo"),
    "prompt_logprobs": _num("prompt_logprobs", -1, 20, integer=True),
    "include_stop_str_in_output": _bool("include_stop_str_in_output"),
    "skip_special_tokens": _bool("skip_special_tokens"),
    "stop": _stop,
    "stream_options": _stream_options,
    "response_format": check_response_format,
    "structured_outputs": check_structured_outputs,
    "stop_token_ids": _id_list("stop_token_ids"),
    "allowed_token_ids": _id_list("allowed_token_ids"),
    "logprob_token_ids": _logprob_token_ids,
    "logit_bias": _logit_bias,
    "user": lambda v: _string("user", v),
    "bad_words": lambda v: _strings("bad_words", v),
    "truncate_prompt_tokens": _num("truncate_prompt_tokens", -1, INT64_MAX, integer=True),
    "truncation_side": lambda v: _one_of("truncation_side", v, ("left", "right")),
    "cache_salt": lambda v: _string("cache_salt", v),
}


def _strings(name: str, v: Any) -> None:
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise BadRequest(f"'{name}' must be a list of non-empty strings", param=name)


def _one_of(name: str, v: Any, allowed: tuple[str, ...]) -> None:
    if v not in allowed:
        raise BadRequest(f"'{name}' must be one of {', '.join(map(repr, allowed))}", param=name)


def _object(name: str, v: Any) -> None:
    if not isinstance(v, dict):
        raise BadRequest(f"'{name}' must be an object", param=name)


def _string(name: str, v: Any) -> None:
    if not isinstance(v, str):
        raise BadRequest(f"'{name}' must be a string", param=name)


def validate_request(kind: Kind, body: Any, *, strict: bool) -> dict[str, Any]:
    """Return the body to render (no-op and, in compat mode, unsupported fields dropped) or raise
    ``BadRequest``."""
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object")
    if "model" not in body or body["model"] is None:
        raise BadRequest("'model' is required", param="model")
    body = _drop_no_ops(kind, {k: v for k, v in body.items() if v is not None or k in _REQUIRED}, strict)
    allowed = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        if strict:
            raise BadRequest(f"Unsupported field(s) for this endpoint: {', '.join(unknown)}. "
                             "See the supported field list in the coordinator's docs.", param=unknown[0])
        log.info("compat mode: ignoring unsupported field(s) %s", unknown)
        body = {k: v for k, v in body.items() if k in allowed}
    if kind == "chat":
        _check_messages(body.get("messages"))
    else:
        _check_prompt(body.get("prompt"))
    for key, value in body.items():
        check = _CHECKS.get(key)
        if key == "max_tokens" and value == 0 and kind == "completion" and body.get("echo") is True:
            continue  # the prompt alone (vLLM runs one step and returns only the echo)
        if check is not None and value is not None:
            check(value)
    if kind == "chat":
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise BadRequest("'logprobs' must be a boolean for chat completions", param="logprobs")
        if (body.get("top_logprobs") or 0) > 0 and not lp:  # 0 asks for nothing: vLLM accepts it
            raise BadRequest("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    elif body.get("logprobs") is not None:
        _num("logprobs", 0, 20, integer=True)(body["logprobs"])
    if body.get("stream_options") and not body.get("stream"):  # an empty object sets nothing (as vLLM)
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    checked: dict[str, Any] = body
    return checked


# Fields whose ``null`` is an error rather than "unset".
_REQUIRED = frozenset({"messages", "prompt"})


def _drop_no_ops(kind: Kind, body: dict[str, Any], strict: bool) -> dict[str, Any]:
    """Remove OpenAI fields set to values that change nothing; other values fail in strict mode and
    are dropped (and logged) in compat mode."""
    wrong_endpoint = _COMPLETION_ONLY_NO_OPS if kind == "chat" else _CHAT_ONLY_NO_OPS
    out: dict[str, Any] = {}
    for key, value in body.items():
        rule = NO_OP_FIELDS.get(key)
        if rule is None or key in wrong_endpoint:
            out[key] = value
        elif not rule[0](value):
            if strict:
                raise BadRequest(f"'{key}' is not supported by this server except as {rule[1]}", param=key)
            log.info("compat mode: ignoring unsupported value of %s", key)
    return out


def _check_messages(msgs: Any) -> None:
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list of message objects", param="messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRequest(f"'messages[{i}]' must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in MESSAGE_ROLES:
            raise BadRequest(f"Invalid value for 'messages[{i}].role': {role!r}. Supported values are: "
                             f"{', '.join(sorted(MESSAGE_ROLES))}.", param=f"messages[{i}].role")


def _check_prompt(p: Any) -> None:
    ok = (isinstance(p, str)
          or (isinstance(p, list) and p and (
              all(isinstance(x, str) for x in p)
              or all(isinstance(x, int) and not isinstance(x, bool) for x in p)
              or all(isinstance(x, list) and x and all(isinstance(t, int) for t in x) for x in p))))
    if not ok:
        raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                         "token-id lists, and must not be empty", param="prompt")
