"""Token obfuscation: the engines see *physical* token ids, everything else sees *semantic* ones.

Render produces semantic ids (the tokenizer's). An obfuscated engine serves a copy of the model whose
embedding (and LM-head) rows were permuted with a secret key (``token_engine.model_prep``), so it
reads and writes physical ids: ``physical = perm(semantic)``. The coordinator maps every token-id
field of a request on its way to an engine and every one of the engine's answer on its way back, so
derender, stop handling, usage and the relay ledger keep working on semantic ids, while the engines
and the KV-affinity index work on physical ones. The permutation itself is a contract shared with
the model preparation (``coordinator.contracts.permutation``).

The helpers here are pure: they never mutate their arguments (the same rendered body is sent again
on a retry or a relay) and they copy only the containers they change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from coordinator.contracts.permutation import ObfuscationError, Obfuscator

# ---------------------------------------------------------------------------------------------------
# Wire mapping. Field names are those of vLLM 0.32's GenerateRequest / GenerateTokensResponse /
# GenerateTokensStreamResponse (vllm/entrypoints/scale_out/token_in_token_out/protocol.py) and
# SamplingParams (vllm/sampling_params.py).
# ---------------------------------------------------------------------------------------------------

Mapper = Callable[[Sequence[int]], list[int]]

# SamplingParams fields that are flat lists of token ids.
SAMPLING_ID_LISTS = ("stop_token_ids", "allowed_token_ids", "logprob_token_ids", "trace_decode_token_ids")


class UnmappableField(ObfuscationError):
    """A field whose meaning depends on the engine's tokenizer (text it would tokenize itself), which an
    obfuscated engine would apply to the wrong ids: refused rather than silently wrong."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"'{field}' cannot be used with token obfuscation: {why}")
        self.field = field


def request_to_physical(body: Mapping[str, Any], obf: Obfuscator) -> dict[str, Any]:
    """A GenerateRequest body on its way to an engine: every token id in it, semantic → physical."""
    out = dict(body)
    ids = body.get("token_ids")
    if isinstance(ids, list):
        out["token_ids"] = obf.to_physical(ids)
    sp = body.get("sampling_params")
    if isinstance(sp, Mapping):
        out["sampling_params"] = sampling_to_physical(sp, obf)
    return out


def sampling_to_physical(sp: Mapping[str, Any], obf: Obfuscator) -> dict[str, Any]:
    """Every id-carrying SamplingParams field. ``bad_words`` as strings and structured outputs are
    compiled by the engine's own tokenizer, against semantic ids: they are refused (fail closed)."""
    if sp.get("structured_outputs"):
        raise UnmappableField("structured_outputs",
                              "the engine would compile the grammar against unobfuscated token ids")
    return _sampling(sp, obf.to_physical, refuse_text=True)


def sampling_to_semantic(sp: Mapping[str, Any], obf: Obfuscator) -> dict[str, Any]:
    """The inverse of ``sampling_to_physical`` (tests, and logs of what an engine was sent)."""
    return _sampling(sp, obf.to_semantic, refuse_text=False)


def request_to_semantic(body: Mapping[str, Any], obf: Obfuscator) -> dict[str, Any]:
    out = dict(body)
    ids = body.get("token_ids")
    if isinstance(ids, list):
        out["token_ids"] = obf.to_semantic(ids)
    sp = body.get("sampling_params")
    if isinstance(sp, Mapping):
        out["sampling_params"] = sampling_to_semantic(sp, obf)
    return out


def _sampling(sp: Mapping[str, Any], fwd: Mapper, *, refuse_text: bool) -> dict[str, Any]:
    out = dict(sp)
    for name in SAMPLING_ID_LISTS:
        value = sp.get(name)
        if isinstance(value, list):
            out[name] = fwd(value)
    bias = sp.get("logit_bias")
    if isinstance(bias, Mapping) and bias:
        out["logit_bias"] = _map_keys(bias, fwd)
    rows = sp.get("prompt_logprob_token_ids")
    if isinstance(rows, list):
        out["prompt_logprob_token_ids"] = [_padded(row, fwd) for row in rows]
    bad = sp.get("bad_words")
    if isinstance(bad, list) and bad:
        if refuse_text and any(isinstance(w, str) for w in bad):
            raise UnmappableField("bad_words", "the engine would tokenize the words into unobfuscated ids")
        out["bad_words"] = [fwd(w) if isinstance(w, list) else w for w in bad]
    bad_ids = sp.get("_bad_words_token_ids")
    if isinstance(bad_ids, list):
        out["_bad_words_token_ids"] = [fwd(w) for w in bad_ids]
    return out


def _padded(row: Any, fwd: Mapper) -> Any:
    """``prompt_logprob_token_ids`` rows use -1 as padding: kept as is."""
    if not isinstance(row, list):
        return row
    real = [t for t in row if t != -1]
    mapped = iter(fwd(real))
    return [t if t == -1 else next(mapped) for t in row]


def _map_keys(table: Mapping[Any, Any], fwd: Mapper) -> dict[Any, Any]:
    """JSON object keys are strings ("123"); the key type is kept (int keys stay ints)."""
    keys = list(table)
    ids = [int(k) for k in keys]
    return {(str(m) if isinstance(k, str) else m): table[k] for k, m in zip(keys, fwd(ids), strict=True)}


def response_to_semantic(resp: Mapping[str, Any], obf: Obfuscator) -> dict[str, Any]:
    """A non-streaming GenerateTokensResponse from an engine: every token id, physical → semantic."""
    return _output(resp, obf.to_semantic)


def chunk_to_semantic(chunk: Mapping[str, Any], obf: Obfuscator) -> dict[str, Any]:
    """One GenerateTokensStreamResponse chunk (same id fields as the full response, as deltas)."""
    return _output(chunk, obf.to_semantic)


def response_to_physical(resp: Mapping[str, Any], obf: Obfuscator) -> dict[str, Any]:
    """The inverse (tests, and simulated engines that stand for an obfuscated model)."""
    return _output(resp, obf.to_physical)


def _output(resp: Mapping[str, Any], fwd: Mapper) -> dict[str, Any]:
    out = dict(resp)
    ids = resp.get("prompt_token_ids")
    if isinstance(ids, list):
        out["prompt_token_ids"] = fwd(ids)
    plp = resp.get("prompt_logprobs")
    if isinstance(plp, list):
        out["prompt_logprobs"] = [_map_keys(step, fwd) if isinstance(step, Mapping) else step
                                  for step in plp]
    choices = resp.get("choices")
    if isinstance(choices, list):
        out["choices"] = [_choice(c, fwd) if isinstance(c, Mapping) else c for c in choices]
    return out


def _choice(choice: Mapping[str, Any], fwd: Mapper) -> dict[str, Any]:
    out = dict(choice)
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        out["token_ids"] = fwd(ids)
    stop = choice.get("stop_reason")
    if type(stop) is int:  # a stop token id (EOS on a --tokens-only engine); a str is a stop string
        out["stop_reason"] = fwd([stop])[0]
    mask = choice.get("sampling_mask")
    if isinstance(mask, list):
        out["sampling_mask"] = [fwd(row) if isinstance(row, list) else row for row in mask]
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, Mapping) and isinstance(logprobs.get("content"), list):
        out["logprobs"] = {**logprobs, "content": [_entry(e, fwd) for e in logprobs["content"]]}
    return out


def _entry(entry: Any, fwd: Mapper) -> Any:
    """``{token_id, logprob, rank, top_logprobs: [{token_id, logprob, rank}]}``."""
    if not isinstance(entry, Mapping):
        return entry
    out = dict(entry)
    if type(entry.get("token_id")) is int:
        out["token_id"] = fwd([entry["token_id"]])[0]
    top = entry.get("top_logprobs")
    if isinstance(top, list):
        out["top_logprobs"] = [_entry(t, fwd) for t in top]
    return out
