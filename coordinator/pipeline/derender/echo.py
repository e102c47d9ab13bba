"""The prompt in the answer: ``echo`` and prompt logprobs, written as native vLLM writes them.

What native serving does (vLLM 0.32 ``completion/serving.py``, ``chat_completion/serving.py``):

* **Completions with ``echo``.** Each choice's text starts with the prompt's text: the client's
  string, or the decoded ids of a token prompt (empty with ``return_token_ids``, which returns the
  ids instead). With ``max_tokens: 0`` the engine runs one step and the choice is the prompt alone.
  With ``logprobs`` the choice's logprobs start with one entry per prompt token (the first has no
  logprob and no alternatives) and ``text_offset`` runs on from the prompt into the output. A stream
  puts all of it on each choice's first chunk, with the prompt's ids.
* **``prompt_logprobs``** (asked for, or implied by ``echo`` with ``logprobs``/``top_logprobs``):
  on each completion choice, at the top of a chat answer; per prompt position
  ``{id: {logprob, rank, decoded_token}}``, the first position ``null``. Streams never carry them.
* **Chat ``return_prompt_text``**: the templated prompt at the top of the answer, or on each role
  chunk of a stream (render's ``/detokenize`` of the prompt's ids).
* **Chat ``echo``.** The last message's content starts each choice's content when that message has
  the answer's role; a stream sends it as one chunk per choice right after the role chunks.

A ``--tokens-only`` engine sends prompt logprobs as ids (``decoded_token: null``). They are decoded
by batch chat derender: the prompt's ids go to it as one choice whose logprobs are the prompt's
(``decode_body``), so every position is decoded with the byte-fallback correction native's engine
applies (``v1/engine/logprobs.py``), from the same preceding ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coordinator.pipeline.context import PromptPlan, RequestContext
from coordinator.pipeline.derender import token_names

LOGPROB_FLOOR = -9999.0  # native clamps -inf so the JSON stays valid (clamp_prompt_logprobs)

# A completion choice's logprobs: tokens, token_logprobs, top_logprobs, text_offset.
Logprobs = dict[str, list[Any]]


def engine_prompt_logprobs(plan: PromptPlan) -> int | None:
    """How many alternatives per prompt position the engine is asked for (render sets it from
    ``prompt_logprobs``, or from ``echo`` with ``logprobs``); None: the prompt is not scored."""
    value = plan.generate["sampling_params"].get("prompt_logprobs")
    return int(value) if value is not None else None


def echoes_logprobs(ctx: RequestContext) -> bool:
    """A completion choice's logprobs include the prompt's (which a stream must fetch first)."""
    return ctx.kind == "completion" and bool(ctx.body.get("echo")) and ctx.body.get("logprobs") is not None


def chat_echo_text(ctx: RequestContext) -> str:
    """What chat ``echo`` puts before the answer: the last message's content if its role is the
    answer's (``assistant`` unless ``add_generation_prompt`` is off); text parts joined by lines."""
    messages = ctx.body.get("messages") or []
    if not ctx.body.get("echo") or not messages:
        return ""
    role = "assistant" if ctx.body.get("add_generation_prompt", True) else messages[-1].get("role")
    last = messages[-1]
    if last.get("role") != role:
        return ""
    content = last.get("content") or ""
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p)
    return str(content)


def client_prompt_text(ctx: RequestContext, plan: PromptPlan) -> str | None:
    """A completion prompt's text as the client sent it; None for a token-id prompt."""
    prompt = ctx.body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and plan.index < len(prompt) and isinstance(prompt[plan.index], str):
        return str(prompt[plan.index])
    return None


def decode_body(ids: list[int], prompt_logprobs: list[Any] | None) -> dict[str, Any]:
    """A generate response for batch chat derender that decodes the prompt and its logprobs.

    One choice: the prompt's ids as its tokens and, per position, the prompt token with the
    engine's alternatives in the engine's order (the first position, which has none, gets a
    placeholder that ``PromptEcho`` drops). Derender answers one content entry per position, its
    ``top_logprobs`` in the order sent."""
    content = []
    for pos, tid in enumerate(ids):
        step = prompt_logprobs[pos] if prompt_logprobs is not None and pos < len(prompt_logprobs) else None
        tops = [{"token_id": int(k), "logprob": _floor(v["logprob"])} for k, v in (step or {}).items()]
        own = step.get(str(tid)) if step else None
        content.append({"token_id": tid, "logprob": _floor(own["logprob"]) if own else 0.0,
                        "top_logprobs": tops})
    choice: dict[str, Any] = {"index": 0, "token_ids": ids, "finish_reason": "length",
                              "logprobs": {"content": content} if prompt_logprobs is not None else None}
    return {"request_id": "prompt", "choices": [choice]}


@dataclass(frozen=True)
class PromptEcho:
    """One prompt's part of the answer (see the module docstring)."""

    text: str = ""                          # put before each choice's text ("" when nothing is echoed)
    logprobs: Logprobs | None = None        # put before each choice's logprobs (completion echo)
    prompt_logprobs: list[Any] | None = None  # native's ``prompt_logprobs`` field, decoded
    only: bool = False                      # ``max_tokens: 0``: the prompt is the whole answer
    prompt_text: str | None = None          # chat ``return_prompt_text``: the templated prompt

    @property
    def width(self) -> int:
        """How far the prompt's tokens move the output's ``text_offset``."""
        if not self.logprobs or not self.logprobs["tokens"]:
            return 0
        return int(self.logprobs["text_offset"][-1]) + len(self.logprobs["tokens"][-1])

    def before(self, text: str | None) -> str:
        return self.text if self.only else self.text + (text or "")

    def before_logprobs(self, out: Logprobs | None) -> Logprobs | None:
        if self.logprobs is None:
            return out
        if self.only or not out:
            return {k: list(v) for k, v in self.logprobs.items()}
        shift, mine = self.width, self.logprobs
        return {"tokens": mine["tokens"] + list(out.get("tokens") or []),
                "token_logprobs": mine["token_logprobs"] + list(out.get("token_logprobs") or []),
                "top_logprobs": mine["top_logprobs"] + list(out.get("top_logprobs") or []),
                "text_offset": mine["text_offset"] + [o + shift for o in out.get("text_offset") or []]}


def build(ctx: RequestContext, plan: PromptPlan, prompt_logprobs: list[Any] | None,
          decoded: tuple[str, list[dict[str, Any]]] | None) -> PromptEcho:
    """``prompt_logprobs``: the engine's (ids only); ``decoded``: derender's answer to ``decode_body``
    (the prompt's text and one logprob entry per position), or None when nothing needed decoding."""
    field = _prompt_logprobs_field(plan.prompt_token_ids, prompt_logprobs, decoded[1] if decoded else None)
    if ctx.kind == "chat":
        return PromptEcho(text=chat_echo_text(ctx), prompt_logprobs=field)
    if not ctx.body.get("echo"):
        return PromptEcho(prompt_logprobs=field)
    text = "" if ctx.body.get("return_token_ids") else (
        client_prompt_text(ctx, plan) or (decoded[0] if decoded else ""))
    logprobs = None
    if ctx.body.get("logprobs") is not None and prompt_logprobs is not None:
        if token_names.wanted(ctx.body):
            logprobs = token_names.name_prompt(plan.prompt_token_ids, prompt_logprobs)
        elif decoded is not None:
            logprobs = _completion_logprobs(decoded[1])
    return PromptEcho(text=text, logprobs=logprobs, prompt_logprobs=field,
                      only=ctx.body.get("max_tokens") == 0)


def needs_decoding(ctx: RequestContext, plan: PromptPlan, prompt_logprobs: list[Any] | None) -> bool:
    """Whether derender must decode this prompt: logprobs to name, or a token prompt to echo."""
    if prompt_logprobs is not None:
        return True
    return (ctx.kind == "completion" and bool(ctx.body.get("echo")) and not ctx.body.get("return_token_ids")
            and client_prompt_text(ctx, plan) is None)


def apply_batch(ctx: RequestContext, out: dict[str, Any], echoes: list[PromptEcho]) -> None:
    """Put each prompt's echo into a non-streaming answer (global choice index → prompt)."""
    if ctx.kind == "chat":
        out["prompt_logprobs"] = echoes[0].prompt_logprobs
        if echoes[0].prompt_text is not None:
            out["prompt_text"] = echoes[0].prompt_text
        if echoes[0].text:
            for choice in out.get("choices", []):
                message = choice.get("message") or {}
                message["content"] = echoes[0].text + (message.get("content") or "")
        return
    by_index = {p.index * p.n + c: echoes[p.index] for p in ctx.prompts for c in range(p.n)}
    echo_on = bool(ctx.body.get("echo"))
    for choice in out.get("choices", []):
        mine = by_index.get(int(choice.get("index", 0)))
        if mine is None:
            continue
        choice["prompt_logprobs"] = mine.prompt_logprobs
        if echo_on:
            choice["text"] = mine.before(choice.get("text"))
            choice["logprobs"] = mine.before_logprobs(choice.get("logprobs"))


def apply_stream(echo: PromptEcho, plan: PromptPlan, choice: dict[str, Any], *, first: bool) -> None:
    """A streamed completion choice: the echo on its first chunk (native sends the prompt's ids with
    it, asked for or not), offsets moved on every chunk."""
    if first:
        choice["prompt_token_ids"] = plan.prompt_token_ids
        choice["text"] = echo.before(choice.get("text"))
        choice["logprobs"] = echo.before_logprobs(choice.get("logprobs"))
        return
    lp = choice.get("logprobs")
    if echo.logprobs is not None and isinstance(lp, dict) and lp.get("text_offset"):
        shift = echo.width
        lp["text_offset"] = [o + shift for o in lp["text_offset"]]


def echo_chunk(ctx: RequestContext, plan: PromptPlan, index: int, text: str) -> dict[str, Any]:
    """Native's chat echo chunk: the last message's content, right after the role chunks."""
    chunk: dict[str, Any] = {"id": ctx.response_id, "object": "chat.completion.chunk", "created": ctx.created,
                             "model": ctx.public_model,
                             "choices": [{"index": index, "delta": {"content": text}, "logprobs": None,
                                          "finish_reason": None}]}
    opts = ctx.body.get("stream_options") or {}
    if ctx.include_usage and opts.get("continuous_usage_stats"):
        chunk["usage"] = {"prompt_tokens": plan.prompt_tokens, "completion_tokens": 0,
                          "total_tokens": plan.prompt_tokens, "completion_tokens_details": None}
    return chunk


def _floor(value: Any) -> float:
    return max(float(value), LOGPROB_FLOOR)


def _prompt_logprobs_field(ids: list[int], engine: list[Any] | None,
                           decoded: list[dict[str, Any]] | None) -> list[Any] | None:
    if engine is None:
        return None
    field: list[Any] = []
    for pos, step in enumerate(engine):
        if not step:
            field.append(None)
            continue
        tops = decoded[pos]["top_logprobs"] if decoded and pos < len(decoded) else []
        names = [t.get("token") for t in tops]
        entry = {}
        for j, (tid, lp) in enumerate(step.items()):
            entry[str(tid)] = {"logprob": _floor(lp["logprob"]), "rank": lp.get("rank"),
                               "decoded_token": names[j] if j < len(names) else None}
        field.append(entry)
    return field


def _completion_logprobs(decoded: list[dict[str, Any]]) -> Logprobs:
    """The prompt's entries of a completion choice's logprobs (native ``_create_completion_logprobs``):
    the first position has no logprob; offsets are the running length of the tokens' text."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for pos, entry in enumerate(decoded):
        token = str(entry.get("token") or "")
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if pos == 0:
            token_logprobs.append(None)
            tops.append(None)
        else:
            token_logprobs.append(_floor(entry["logprob"]))
            tops.append({str(t["token"]): _floor(t["logprob"]) for t in entry.get("top_logprobs") or []})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
