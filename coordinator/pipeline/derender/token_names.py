"""``return_tokens_as_token_ids``: logprob tokens named ``token_id:<id>``, as native vLLM names them.

Clients that must not depend on decoded text (RL trainers that rebuild the exact sequence, byte-level
tokens that decode to nothing) ask for the ids. Derender always decodes, so the coordinator renames
each logprob entry from the engine's ids, which come in the same order derender answered them
(vLLM 0.32 ``format_token_id_placeholder``, ``_create_chat_logprobs``, ``_create_completion_logprobs``):

* chat: ``token`` is the placeholder; a sampled token keeps the ``bytes`` of its decoded text, a top
  alternative gets the placeholder's bytes (native's own asymmetry, kept);
* completions: ``tokens`` and the ``top_logprobs`` keys are placeholders, and ``text_offset`` counts
  their length, running on across a stream's chunks.
"""

from __future__ import annotations

from typing import Any

LOGPROB_FLOOR = -9999.0


def wanted(body: dict[str, Any]) -> bool:
    return bool(body.get("return_tokens_as_token_ids"))


def placeholder(token_id: Any) -> str:
    return f"token_id:{int(token_id)}"


def _engine_entries(engine_choice: dict[str, Any]) -> list[dict[str, Any]]:
    lp = engine_choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    return list(content) if isinstance(content, list) else []


def name_chat(out_choice: dict[str, Any], engine_choice: dict[str, Any]) -> None:
    """A chat choice (batch or one stream chunk) derendered from ``engine_choice``."""
    lp = out_choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if not isinstance(content, list):
        return
    for entry, source in zip(content, _engine_entries(engine_choice), strict=False):
        entry["token"] = placeholder(source["token_id"])
        for top, alt in zip(entry.get("top_logprobs") or [], source.get("top_logprobs") or [], strict=False):
            top["token"] = placeholder(alt["token_id"])
            top["bytes"] = list(top["token"].encode())


def name_completion(out_choice: dict[str, Any], engine_choice: dict[str, Any], start: int = 0) -> int:
    """A completion choice (batch, or one stream chunk whose offsets start at ``start``); returns
    where the next chunk's offsets start."""
    lp = out_choice.get("logprobs")
    entries = _engine_entries(engine_choice)
    if not isinstance(lp, dict) or not isinstance(lp.get("tokens"), list):
        return start
    tokens: list[str] = []
    offsets: list[int] = []
    tops: list[dict[str, float] | None] = []
    offset = start
    for source, top in zip(entries, lp.get("top_logprobs") or [None] * len(entries), strict=False):
        token = placeholder(source["token_id"])
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        alts = source.get("top_logprobs") or []
        tops.append({placeholder(a["token_id"]): max(float(a["logprob"]), LOGPROB_FLOOR) for a in alts}
                    if top is not None else None)
    lp["tokens"], lp["text_offset"], lp["top_logprobs"] = tokens, offsets, tops
    return offset


def name_batch(kind: str, out: dict[str, Any], responses: list[tuple[int, int, dict[str, Any]]]) -> None:
    """A non-streaming answer: ``responses`` is each prompt's (index, n, engine response)."""
    engine = {p * n + int(c.get("index", 0)): c for p, n, r in responses for c in r.get("choices") or []}
    for choice in out.get("choices") or []:
        source = engine.get(int(choice.get("index", 0)))
        if source is None:
            continue
        if kind == "chat":
            name_chat(choice, source)
        else:
            name_completion(choice, source)


def name_prompt(ids: list[int], prompt_logprobs: list[Any]) -> dict[str, list[Any]]:
    """An echoed prompt's completion logprobs with placeholders (no decoding needed)."""
    tokens: list[str] = []
    offsets: list[int] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offset = 0
    for pos, tid in enumerate(ids):
        token = placeholder(tid)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        step = prompt_logprobs[pos] if pos < len(prompt_logprobs) else None
        if not step:
            token_lps.append(None)
            tops.append(None)
            continue
        own = step.get(str(tid))
        token_lps.append(max(float(own["logprob"]), LOGPROB_FLOOR) if own else None)
        tops.append({placeholder(k): max(float(v["logprob"]), LOGPROB_FLOOR) for k, v in step.items()})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
