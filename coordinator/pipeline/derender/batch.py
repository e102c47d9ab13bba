"""A non-streaming answer: the engines' whole outputs in, one derender call, native's shape out.

Batch derender returns the text of every token it is given, so what native ``vllm serve`` does while
it detokenizes (hide the stopping token, cut at a stop string, the stop reason of an EOS, the
tool-call finish reason, the answer's role) is done here around the one call (``fixups.py`` names
each rule). A prompt with stop strings streamed internally (``PromptStream`` with ``collect``) comes
back as the engine response it would have been (``collected``).
"""

from __future__ import annotations

from typing import Any

from coordinator.pipeline.context import PromptPlan, RequestContext
from coordinator.pipeline.derender import token_names
from coordinator.pipeline.derender.fixups import (
    answer_role,
    attach_token_ids,
    eos_stop_reason,
    native_top_logprobs,
    stops_on_token,
    tool_call_finish_reason,
    without_stop_token,
)
from coordinator.pipeline.derender.shape import system_fingerprint
from coordinator.pipeline.derender.stop import truncate_at_stop
from coordinator.pipeline.derender.stream import PromptStream


def trim(ctx: RequestContext, responses: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], set[int]]:
    """The engine responses as derender must see them (the hidden stopping token taken out, a
    completion's logprobs cut to native's), and the global indexes of choices whose only token was
    that stopping token (derender rejects an empty choice; they answer with empty text)."""
    blank: set[int] = set()
    trimmed = []
    for plan, resp in zip(ctx.prompts, responses, strict=True):
        choices = []
        for c in resp["choices"]:
            if ctx.kind == "completion":
                native_top_logprobs(c, ctx.body)
            if stops_on_token(c, plan.stop):
                if len(c["token_ids"]) == 1:
                    blank.add(plan.index * plan.n + int(c.get("index", 0)))
                else:
                    c = without_stop_token(c)
            choices.append(c)
        trimmed.append({**resp, "choices": choices})
    return trimmed, blank


def finish(ctx: RequestContext, out: dict[str, Any], responses: list[dict[str, Any]],
           trimmed: list[dict[str, Any]], blank: set[int]) -> None:
    """Derender's answer made native's: token names, id, fingerprint, per-choice fix-ups, token ids,
    and the usage of what the engines generated (``responses``, before trimming)."""
    if token_names.wanted(ctx.body):
        token_names.name_batch(ctx.kind, out, [(p.index, p.n, r) for p, r in zip(ctx.prompts, trimmed,
                                                                                strict=True)])
    out["id"] = ctx.response_id
    out["model"] = ctx.public_model
    out["system_fingerprint"] = system_fingerprint(ctx.model)
    _finish_choices(ctx, out, blank)
    if ctx.body.get("return_token_ids"):
        attach_token_ids(ctx.kind, out, [(p.prompt_token_ids, p.n) for p in ctx.prompts],
                         {p.index * p.n + int(c.get("index", 0)): list(c.get("token_ids") or [])
                          for p, r in zip(ctx.prompts, responses, strict=True) for c in r["choices"]})
    counted = sum(len(c.get("token_ids") or []) for r in responses for c in r["choices"])
    usage = out.get("usage") or {}
    usage["completion_tokens"] = counted
    usage["total_tokens"] = int(usage.get("prompt_tokens") or 0) + counted


def collected(ctx: RequestContext, plan: PromptPlan, ps: PromptStream) -> dict[str, Any]:
    """A prompt streamed internally until done or stopped, as its GenerateResponse."""
    usage = {"prompt_tokens": plan.prompt_tokens, "completion_tokens": ps.completion_tokens,
             "total_tokens": plan.prompt_tokens + ps.completion_tokens}
    choices = []
    for i, st in sorted(ps.choices.items()):
        choices.append({"index": i, "finish_reason": st.finish_reason or "stop",
                        "stop_reason": st.stop_reason, "token_ids": st.token_ids,
                        "logprobs": {"content": st.logprobs} if st.logprobs else None})
    return {"request_id": plan.generate["request_id"], "model": ctx.model, "created": ctx.created,
            "usage": usage, "output_mode": "tokens", "choices": choices}


def _finish_choices(ctx: RequestContext, out: dict[str, Any], blank: set[int]) -> None:
    """Cut text at stop strings, blank stop-token-only outputs, fix stop and finish reasons and roles."""
    by_index = {p.index * p.n + c: p for p in ctx.prompts for c in range(p.n)}
    for choice in out.get("choices", []):
        index = int(choice.get("index", 0))
        plan = by_index.get(index)
        holder, key = (choice.get("message") or {}, "content") if ctx.kind == "chat" else (choice, "text")
        if index in blank:
            holder[key] = ""
        elif (plan is not None and isinstance(choice.get("stop_reason"), str)
              and isinstance(holder.get(key), str)):
            # Batch derender returns the text of all kept tokens; the stop string ends it.
            holder[key] = truncate_at_stop(holder[key], plan.stop)[0]
        if not isinstance(choice.get("stop_reason"), str):
            eos_stop_reason(choice, ctx.body.get("stop_token_ids"))
        if ctx.kind == "chat":
            tool_call_finish_reason(choice, ctx.body.get("tool_choice"))
            answer_role(choice, ctx.body)
