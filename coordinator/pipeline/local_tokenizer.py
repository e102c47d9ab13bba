"""The local tokenizer: prompt token ids without the render sidecar (the render fallback).

When render cannot answer (no connection, timeout, 5xx, a route it lacks, a body without token ids)
the coordinator still needs the exact prompt ids: admission reserves by them and the prefix index
hashes them. This module computes them the way vLLM 0.32's render does, from the same tokenizer files
and chat template:

* chat: ``apply_chat_template(conversation, tools=..., tokenize=True, return_dict=False,
  add_generation_prompt=..., continue_final_message=..., documents=..., reasoning_effort=...,
  **chat_template_kwargs)``; text content parts are joined with newlines (vLLM's "string" content
  format) and assistant tool-call arguments are parsed from JSON (``_postprocess_messages``);
* completions: each prompt string is encoded with ``add_special_tokens`` (default true, as vLLM),
  token-id prompts are taken as they are.

``transformers`` is an optional dependency (extra ``local-tokenizer``), imported only when the first
fallback happens, so the coordinator imports and serves without it. Tokenizers are loaded once per
model, in a worker thread, and reused.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Mapping
from typing import Any

from coordinator.pipeline.context import Kind
from coordinator.pipeline.errors import BadRequest, UpstreamUnavailable

log = logging.getLogger(__name__)

# Chat template inputs vLLM passes besides the messages (``ChatCompletionRequest.build_chat_params``).
_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "documents", "reasoning_effort")
_TEMPLATE_DEFAULTS: dict[str, Any] = {"add_generation_prompt": True, "continue_final_message": False}
_RESERVED_KWARGS = frozenset({"chat_template", "tokenize", "return_dict", "conversation", "tools"})


class LocalTokenizerUnavailable(UpstreamUnavailable):
    """No local tokenizer can be used (extra not installed, no tokenizer path, files unreadable)."""


class LocalTokenizers:
    """One lazily loaded Hugging Face tokenizer per model, found at ``paths[model]``."""

    def __init__(self, paths: Mapping[str, str | None]) -> None:
        self._paths = dict(paths)
        self._loaded: dict[str, Any] = {}
        self._lock = threading.Lock()  # loads happen in worker threads; load each model once

    def path(self, model: str, root: str | None = None) -> str | None:
        """Where the tokenizer of ``model`` lives: configured path, else the sidecar's ``root``."""
        return self._paths.get(model) or root

    async def tokenize(self, kind: Kind, body: dict[str, Any], model: str,
                       root: str | None = None) -> list[list[int]]:
        """Prompt ids per prompt (chat: exactly one) for a validated client body."""
        path = self.path(model, root)
        if path is None:
            raise LocalTokenizerUnavailable(
                f"no local tokenizer for model {model!r} (set models[].tokenizer_path or models[].path)")
        return await asyncio.to_thread(self._tokenize, kind, body, model, path)

    def _tokenize(self, kind: Kind, body: dict[str, Any], model: str, path: str) -> list[list[int]]:
        tokenizer = self._tokenizer(model, path)
        if kind == "chat":
            return [chat_ids(tokenizer, body)]
        return completion_ids(tokenizer, body)

    def _tokenizer(self, model: str, path: str) -> Any:
        with self._lock:
            if model in self._loaded:
                return self._loaded[model]
            try:
                from transformers import AutoTokenizer  # optional extra: imported on first use only
            except ImportError as exc:
                raise LocalTokenizerUnavailable(
                    "the local tokenizer needs the 'local-tokenizer' extra (transformers)") from exc
            try:
                tokenizer = AutoTokenizer.from_pretrained(path)
            except Exception as exc:  # missing files, bad config: any of many library errors
                log.error("local tokenizer for %s could not be loaded from %s: %s", model, path, exc)
                raise LocalTokenizerUnavailable(
                    f"the local tokenizer of model {model!r} could not be loaded") from exc
            log.info("local tokenizer for %s loaded from %s", model, path)
            self._loaded[model] = tokenizer
            return tokenizer


def chat_ids(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    """The chat prompt's ids as vLLM's render computes them (see the module docstring)."""
    conversation = [_message(m) for m in body.get("messages") or []]
    kwargs: dict[str, Any] = dict(_TEMPLATE_DEFAULTS)
    kwargs.update({k: body[k] for k in _TEMPLATE_FIELDS if body.get(k) is not None})
    user_kwargs = body.get("chat_template_kwargs") or {}
    if body.get("reasoning_effort") is not None and "enable_thinking" not in user_kwargs:
        kwargs["enable_thinking"] = body["reasoning_effort"] != "none"
    kwargs.update({k: v for k, v in user_kwargs.items() if k not in _RESERVED_KWARGS})
    if kwargs["add_generation_prompt"] and kwargs["continue_final_message"]:
        raise BadRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    try:
        ids = tokenizer.apply_chat_template(conversation, tools=_tools(body), tokenize=True,
                                            return_dict=False, **kwargs)
    except Exception as exc:  # the template rejected the input (vLLM answers 400 for the same)
        raise BadRequest(f"The chat template rejected the request: {exc}", param="messages") from exc
    return _id_list(ids)


def completion_ids(tokenizer: Any, body: dict[str, Any]) -> list[list[int]]:
    """One id list per completions prompt: strings encoded, token-id prompts kept."""
    prompt = body.get("prompt")
    special = bool(body.get("add_special_tokens", True))
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list):
        prompts = prompt
    else:
        raise BadRequest("'prompt' must be a string, a list of strings or token ids", param="prompt")
    out: list[list[int]] = []
    for p in prompts:
        ids = p if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=special)
        if not ids:
            raise BadRequest("The prompt is empty", param="prompt")
        out.append(_id_list(ids))
    return out


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Tools as vLLM hands them to the template (its pydantic dump: unset description/parameters are
    None; with ``tool_choice: "none"`` they are still shown, vLLM's default)."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return None
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            out.append(tool)
            continue
        fn = tool["function"]
        dumped = {"name": fn.get("name"), "description": fn.get("description"),
                  "parameters": fn.get("parameters")}
        dumped.update({k: v for k, v in fn.items() if k not in dumped and v is not None})
        out.append({**{k: v for k, v in tool.items() if v is not None}, "type": tool.get("type", "function"),
                    "function": dumped})
    return out


def _message(message: dict[str, Any]) -> dict[str, Any]:
    """A client message as chat templates see it in vLLM: text parts joined, tool arguments parsed."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "refusal"):
                texts.append(str(part.get("text", part.get("refusal", ""))))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise UpstreamUnavailable(
                    f"render is unavailable and the local tokenizer handles text only (got {kind!r})")
        out["content"] = "\n".join(texts)
    calls = out.get("tool_calls")
    if out.get("role") == "assistant" and isinstance(calls, list):
        if not calls:
            out.pop("tool_calls")
        else:
            out["tool_calls"] = [_tool_call(c) for c in calls]
    return out


def _tool_call(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = dict(call["function"])
    args = function.get("arguments")
    if not args:
        function["arguments"] = {}
    elif isinstance(args, str):
        try:
            function["arguments"] = json.loads(args)
        except json.JSONDecodeError as exc:
            raise BadRequest("assistant tool_calls arguments must be JSON", param="tool_calls") from exc
    return {**call, "function": function}


def _id_list(ids: Any) -> list[int]:
    """transformers 4.x and 5.x differ in what apply_chat_template returns; a flat int list out."""
    if hasattr(ids, "get") and not isinstance(ids, list):  # a BatchEncoding
        ids = ids.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(i) for i in ids]
