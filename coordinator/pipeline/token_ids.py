"""Every token id bound for an engine is checked against the model's vocabulary, twice.

Token-only engines skip vLLM's vocabulary check (they have no tokenizer), and one out-of-range id
kills the engine process; with retries one request could take down engine after engine. So the
coordinator checks:

1. **before render**, the ids the client wrote (completions prompts, ``stop_token_ids``,
   ``allowed_token_ids``, ``logit_bias`` keys), so the error names the client's field;
2. **after render**, everything render produced for the engine (prompt ids and the same sampling
   fields), so nothing that slipped through render or was added by it reaches an engine unchecked.

Ids must be ``0 <= id < vocab_size``. When the vocabulary is unknown (no ``models[].vocab_size`` and
no readable model folder), requests carrying client ids are refused with 503 (fail closed), and
rendered ids are still held to the int32 range the engine's tensors use.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeGuard

from coordinator.pipeline.errors import BadRequest, VocabularyUnknown

INT32_LIMIT = 2**31  # engine tensors hold ids as int32: the last line when the vocabulary is unknown

# Sampling fields that carry token ids, as the client names them (and as render passes them on).
ID_LIST_FIELDS = ("stop_token_ids", "allowed_token_ids", "logprob_token_ids")
ENGINE_MAX_LOGPROBS = 20  # vLLM's default --max-logprobs (engines and the sidecar's derender)
# The token route returns named ids as a position's top logprobs, one of whose entries is the sampled
# token (derender/fixups.py, widen_logprob_token_ids); native takes 128 (vLLM's MAX_LOGPROB_TOKEN_IDS).
MAX_LOGPROB_TOKEN_IDS = ENGINE_MAX_LOGPROBS - 1


def check_client_ids(body: dict[str, Any], vocab_size: int | None, *, completion: bool) -> None:
    """Ids written by the client (types were checked by validation): each inside the vocabulary."""
    fields: list[tuple[str, Iterable[int]]] = []
    prompt = body.get("prompt") if completion else None
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
        if isinstance(prompt[0], list):
            fields.extend(("prompt", p) for p in prompt)
        else:
            fields.append(("prompt", prompt))
    for name in ID_LIST_FIELDS:
        if isinstance(body.get(name), list):
            fields.append((name, body[name]))
    if isinstance(body.get("logit_bias"), dict):
        fields.append(("logit_bias", bias_keys(body["logit_bias"])))
    if not fields:
        return
    if vocab_size is None:
        raise VocabularyUnknown(
            "This server cannot accept token ids right now: the model's vocabulary size is unknown.",
            param=fields[0][0])
    for name, ids in fields:
        _check(name, ids, vocab_size)


def check_rendered(generate: dict[str, Any], vocab_size: int | None, *, prompt_field: str) -> None:
    """What render produced for the engine: prompt ids and every id-carrying sampling field."""
    limit = vocab_size if vocab_size is not None else INT32_LIMIT
    ids = generate.get("token_ids")
    if not is_id_list(ids):
        raise BadRequest("The rendered prompt is not a list of token ids", param=prompt_field)
    _check(prompt_field, ids, limit)
    sp = generate.get("sampling_params") or {}
    for name in ID_LIST_FIELDS:
        value = sp.get(name)
        if value is not None:
            if not is_id_list(value):
                raise BadRequest(f"'{name}' must be a list of token ids", param=name)
            _check(name, value, limit)
    bias = sp.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise BadRequest("'logit_bias' must map token ids to numbers", param="logit_bias")
        _check("logit_bias", bias_keys(bias), limit)


def is_id_list(value: Any) -> TypeGuard[list[int]]:
    """A JSON list of integers (booleans and floats are not token ids)."""
    return isinstance(value, list) and all(type(t) is int for t in value)


def bias_keys(bias: dict[Any, Any]) -> list[int]:
    """JSON object keys are strings; vLLM parses them as ints. Anything else is a client error."""
    keys: list[int] = []
    for key in bias:
        try:
            keys.append(int(key))
        except (TypeError, ValueError):
            raise BadRequest(f"'logit_bias' keys must be token ids, got {key!r}",
                             param="logit_bias") from None
    return keys


def _check(name: str, ids: Iterable[int], limit: int) -> None:
    values = list(ids)
    if not values:
        return
    low, high = min(values), max(values)
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        raise BadRequest(f"Token id {bad} in '{name}' is out of vocabulary: token ids must satisfy "
                         f"0 <= id < {limit}.", param=name)
