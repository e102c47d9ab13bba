"""What an engine can run beyond plain token generation, learned from the engine itself.

Why learned: a ``--tokens-only`` engine runs with ``skip_tokenizer_init``, so vLLM refuses structured
outputs on it (``SamplingParams._validate_structured_outputs``: "Structured outputs requires a
tokenizer..."), while an engine started with ``--enable-scale-out`` loads the tokenizer, serves the
same ``/inference/v1/generate`` and compiles grammars. Operators mix both (token-only engines are
lighter and start faster), and a flag in the coordinator's config would drift from the engines' own
command lines, so the coordinator asks each engine: ``POST /tokenize`` answers 200 only where a
tokenizer is loaded, and 400 "Tokenizer not available when `skip_tokenizer_init=True`" on a token-only
engine (vLLM 0.32, ``entrypoints/serve/tokenize``). ``engines[].tokenizer`` overrides what was
learned (docs/engine-capabilities.md).

The engine's own OpenAI API (the native route) is learned the same way: it works only where a
tokenizer is loaded (a ``--tokens-only`` vLLM registers ``/v1/chat/completions`` but fails on it),
and only where the route exists at all (an engine that serves the token route alone, like the
simulator, answers 404). The probe sends an empty body: vLLM validates it and answers 400 without
running anything. ``engines[].native_api`` overrides. Whether ``/inference/v1/abort_requests`` is
served is learned from the engine's answer to the first abort (``client.py``); without it, closing a
generate stream is what aborts the request in vLLM.
"""

from __future__ import annotations

import logging
from typing import Literal

import httpx

log = logging.getLogger(__name__)

Capability = Literal["tokenizer", "native_api"]
"""``tokenizer``: one is loaded, so grammars compile (``response_format`` json modes,
``structured_outputs``, ``tool_choice`` required / named, ``parallel_tool_calls: false``),
``bad_words`` apply, and a ``thinking_token_budget`` can end reasoning (vLLM spells the reasoning
parser's end string into ids with the engine's tokenizer). ``native_api``: the engine's own OpenAI
API may take requests (the native route)."""

TOKENIZER: Capability = "tokenizer"
NATIVE_API: Capability = "native_api"
NO_NEEDS: frozenset[Capability] = frozenset()

_PROBE_BODY = {"prompt": "."}


async def probe_tokenizer(http: httpx.AsyncClient, url: str, timeout_s: float) -> bool | None:
    """Whether the engine at ``url`` loads a tokenizer: True (``/tokenize`` answers 200), False (a 4xx:
    vLLM's "Tokenizer not available", or no such route), None (no answer: ask again next round)."""
    try:
        resp = await http.post(f"{url}/tokenize", json=_PROBE_BODY, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if resp.status_code == 200:
        return True
    if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
        return False
    return None


async def probe_native_api(http: httpx.AsyncClient, url: str, timeout_s: float,
                           headers: dict[str, str]) -> bool | None:
    """Whether the engine at ``url`` serves ``/v1/chat/completions``: True (any answer of the route's
    own: vLLM's 400 for the empty body), False (404 / 405: no such route), None (no answer, a 5xx, or
    a 401 / 403 that hides the route behind a key: ask again next round)."""
    try:
        resp = await http.post(f"{url}/v1/chat/completions", json={}, timeout=timeout_s, headers=headers)
    except httpx.HTTPError:
        return None
    if resp.status_code in (404, 405):
        return False
    if resp.status_code in (401, 403, 408, 429) or resp.status_code >= 500:
        return None
    return True


def has_grammar(sampling_params: object) -> bool:
    """Render puts every constraint it derived (``response_format``, ``structured_outputs``, forced
    tool calls) into ``sampling_params.structured_outputs``, so this one key says it all."""
    return isinstance(sampling_params, dict) and sampling_params.get("structured_outputs") is not None


def needs_of(sampling_params: object) -> frozenset[Capability]:
    """What an engine must be able to do to run a GenerateRequest's ``sampling_params``."""
    words = isinstance(sampling_params, dict) and (
        bool(sampling_params.get("bad_words")) or sampling_params.get("thinking_token_budget") is not None)
    if words or has_grammar(sampling_params):
        return frozenset({TOKENIZER})
    return NO_NEEDS


__all__ = ["NATIVE_API", "NO_NEEDS", "TOKENIZER", "Capability", "has_grammar", "needs_of", "probe_native_api",
           "probe_tokenizer"]
