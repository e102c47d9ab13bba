"""schemathesis hooks: aim generated requests at the served model and keep generation short.

Loaded by schemathesis through ``SCHEMATHESIS_HOOKS`` (tests/compat/test_schemathesis.py). Without
them almost every generated body names a model the server does not have, carries a field the
coordinator documents as unsupported (both correct 4xx answers, so nothing past validation would
run), or asks for thousands of tokens from a CPU engine. The model name comes from ``COMPAT_MODEL``;
caps apply only to well-typed values so that negative cases on those fields stay negative. (The
4xx answers to unsupported fields are covered by tests/e2e.)
"""

from __future__ import annotations

import os
from typing import Any

import schemathesis

MAX_TOKENS = 8
MAX_N = 2
MAX_PROMPTS = 4
# Spec fields that docs/openai-api.md lists as not supported: dropped so that generation runs.
UNSUPPORTED = ("audio", "best_of", "echo", "function_call", "functions", "metadata", "modalities", "prediction",
               "prompt_cache_key", "prompt_cache_retention", "reasoning_effort", "safety_identifier",
               "service_tier", "store", "suffix", "verbosity", "web_search_options")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fit(body: Any) -> Any:
    if not isinstance(body, dict):
        return body
    body = {k: v for k, v in body.items() if k not in UNSUPPORTED}
    if isinstance(body.get("response_format"), dict) and body["response_format"].get("type") != "text":
        del body["response_format"]  # structured outputs are not supported either
    body["model"] = os.environ["COMPAT_MODEL"]
    # Absent or null (null reads as unset) means the server default: the whole context window, which
    # on a CPU engine outlasts any request timeout.
    budget = [k for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    if not budget:
        body["max_tokens"] = MAX_TOKENS
    for key in budget:
        if _is_int(body[key]) and body[key] > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if "prompt" in body and body["prompt"] is None:
        body["prompt"] = "Hello"  # the spec allows null (meaning its default prompt); the server needs text
    if _is_int(body.get("top_logprobs")) and "logprobs" not in body:
        body["logprobs"] = True  # a rule the spec cannot express: top_logprobs needs logprobs
    if _is_int(body.get("n")) and body["n"] > MAX_N:
        body["n"] = MAX_N
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > MAX_PROMPTS and not all(
            _is_int(t) for t in body["prompt"]):
        body["prompt"] = body["prompt"][:MAX_PROMPTS]  # a list of prompts: each one is a generation
    return body


@schemathesis.hook
def map_case(context: Any, case: Any) -> Any:
    """Every phase passes its cases through here (``map_body`` is skipped by the coverage phase)."""
    case.body = _fit(case.body)
    return case
