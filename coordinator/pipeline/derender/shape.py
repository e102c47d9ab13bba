"""The keys of every response and stream chunk, as native ``vllm serve`` sends them (vLLM 0.32).

Derender answers with ``model_dump()``: every field of vLLM's response models, ``null`` when unset.
Native serving writes non-streaming responses the same way, but each stream chunk with
``exclude_unset=True`` (``chat_completion/serving.py``, ``completion/serving.py``), so a chunk
carries only the fields its construction site set, and the final usage chunk with
``exclude_none=True``. The rules below restore what those construction sites set; they mutate
derender's dicts in place (no copies, no models) because they run on every streamed chunk.

Chat streams (``chat_completion_stream_generator``):

* **Role chunk first.** Native opens each choice with ``delta: {"role", "content": ""}``,
  ``logprobs: null``, ``finish_reason: null`` and top-level ``prompt_token_ids`` / ``prompt_text``
  (``null`` unless asked for), before any content. Derender folds the role into the first content
  delta instead, so the coordinator sends the role chunk itself and drops ``role`` from later deltas.
* **Deltas carry what was set.** Without a parser native builds ``DeltaMessage(content=text)``:
  ``content`` always present (``""`` when the token decodes to nothing; derender says ``null``),
  never ``reasoning``. With a parser the delta is what the parser built: ``null`` members are
  dropped, except ``content`` next to ``tool_calls`` (tool parsers set both).
* **A parser's silent steps are not chunks.** When the parser has nothing to say (e.g. while a
  ``<tool_call>`` is buffered) native sends no chunk unless it finishes the choice or carries
  logprobs or token ids; derender returns an empty delta, which the coordinator holds back.
* **Choice keys.** ``index``, ``delta``, ``logprobs``, ``finish_reason``, ``token_ids`` on every
  content chunk; ``stop_reason`` only on the finishing chunk.

Completion streams (``completion_stream_generator``) set every choice field, so only the
top-level keys change.

Both kinds, top level: ``usage`` only with ``continuous_usage_stats`` (chat adds
``completion_tokens_details: null``, completions have the three counts), never
``metrics``/``prompt_token_ids``/``prompt_text`` after the first chunk, and ``system_fingerprint``
on a choice's finishing chunk when no usage chunk follows, and on the usage chunk. Non-streaming
responses keep every key and get the fingerprint too.

A 0.33 sidecar's models have a few more fields (``kv_transfer_params`` on a chunk,
``weight_versions`` on a choice); in chunks they go when null, as native's ``exclude_unset`` drops
them; non-streamed bodies keep them, as native 0.33's do (docs/versions.md).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Any

from coordinator.pipeline.context import PromptPlan, RequestContext

# Top-level keys derender always writes that native chunks only carry when set.
_UNSET_IN_CHUNKS = ("system_fingerprint", "prompt_token_ids", "prompt_text", "metrics")
# Fields vLLM 0.33's stream models added (a 0.33 sidecar writes them, ``null``); native 0.33 chunks
# carry them only when set, and 0.32's have none: dropped when null (docs/versions.md).
_NEWER_IN_CHUNKS = ("kv_transfer_params",)
_NEWER_IN_CHOICES = ("weight_versions",)


@lru_cache(maxsize=64)
def system_fingerprint(model: str) -> str:
    """The coordinator's ``system_fingerprint`` for a served model.

    Native vLLM stamps ``vllm-<version>-<hash of the engine config>``; the coordinator cannot see an
    engine's config (and a fleet may mix them), so it names itself and the served model instead:
    stable across restarts, different per model, and a string where OpenAI clients expect one.
    """
    return "coordinator-" + hashlib.sha256(model.encode()).hexdigest()[:8]


def continuous_usage(ctx: RequestContext) -> bool:
    """Usage in every chunk: ``continuous_usage_stats`` counts only together with ``include_usage``."""
    opts = ctx.body.get("stream_options") or {}
    return ctx.include_usage and bool(opts.get("continuous_usage_stats"))


def role_chunk(ctx: RequestContext, plan: PromptPlan, index: int) -> dict[str, Any]:
    """Native's first chunk of a chat choice: the role, an empty content, nothing else."""
    messages = ctx.body.get("messages") or [{}]
    role = "assistant" if ctx.body.get("add_generation_prompt", True) else messages[-1].get("role")
    chunk: dict[str, Any] = {
        "id": ctx.response_id, "object": "chat.completion.chunk", "created": ctx.created,
        "model": ctx.public_model,
        "choices": [{"index": index, "delta": {"role": role, "content": ""}, "logprobs": None,
                     "finish_reason": None}],
    }
    if continuous_usage(ctx):
        chunk["usage"] = {"prompt_tokens": plan.prompt_tokens, "total_tokens": plan.prompt_tokens,
                          "completion_tokens": 0, "completion_tokens_details": None}
    chunk["prompt_token_ids"] = plan.prompt_token_ids if ctx.body.get("return_token_ids") else None
    chunk["prompt_text"] = None
    return chunk


def shape_stream_chunk(ctx: RequestContext, chunk: dict[str, Any], *, parsers: bool) -> bool:
    """Give a derendered content chunk native's keys; False when native would not send it at all."""
    for key in _UNSET_IN_CHUNKS:
        chunk.pop(key, None)
    for key in _NEWER_IN_CHUNKS:
        if key in chunk and chunk[key] is None:
            del chunk[key]
    usage = chunk.get("usage")
    if usage is None:
        chunk.pop("usage", None)
    else:
        _shape_chunk_usage(ctx, usage)
    choices = chunk.get("choices") or []
    finished = False
    for choice in choices:
        for key in _NEWER_IN_CHOICES:
            if key in choice and choice[key] is None:
                del choice[key]
        if choice.get("finish_reason") is not None:
            finished = True
        elif ctx.kind == "chat":
            choice.pop("stop_reason", None)
        if ctx.kind == "chat" and not _shape_delta(choice, parsers=parsers):
            return False
    if finished and not ctx.include_usage:
        chunk["system_fingerprint"] = system_fingerprint(ctx.model)
    return True


def shape_usage_chunk(ctx: RequestContext, chunk: dict[str, Any]) -> dict[str, Any]:
    """The final usage chunk: native writes it with ``exclude_none``, fingerprint included."""
    for key in _NEWER_IN_CHUNKS:
        if key in chunk and chunk[key] is None:
            del chunk[key]
    chunk["system_fingerprint"] = system_fingerprint(ctx.model)
    return chunk


def _shape_chunk_usage(ctx: RequestContext, usage: dict[str, Any]) -> None:
    usage.pop("prompt_tokens_details", None)
    if ctx.kind == "chat":
        usage.setdefault("completion_tokens_details", None)
    else:
        usage.pop("completion_tokens_details", None)


def _shape_delta(choice: dict[str, Any], *, parsers: bool) -> bool:
    """Chat delta keys as native sets them; False for a parser step native would not send."""
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return True
    delta.pop("role", None)  # sent in the role chunk
    if not parsers:
        content = delta.get("content")
        delta.clear()
        delta["content"] = content if isinstance(content, str) else ""
        return True
    tool_calls = delta.get("tool_calls")
    for key in [k for k, v in delta.items() if v is None and not (k == "content" and tool_calls)]:
        del delta[key]
    return bool(delta) or any(choice.get(k) is not None for k in ("finish_reason", "logprobs", "token_ids"))
