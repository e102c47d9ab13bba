"""Engine request bodies for each leg of a topology.

Union sends the rendered GenerateRequest as is. Handoff (P/D) sends a prefill leg that computes the
prompt's KV and stops after one token, then a decode leg that carries the ``kv_transfer_params`` the
prefill engine returned (vLLM's P/D contract through ``/inference/v1/generate``).
"""

from __future__ import annotations

import secrets
from typing import Any


def attempt_id(request_id: str, leg: str = "") -> str:
    """Unique per attempt and leg even when clients reuse an X-Request-Id: vLLM aborts *every* request
    sharing an external id, so two attempts must never share one."""
    return f"{request_id}-{leg}{secrets.token_hex(3)}"


def prefill_body(generate: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """One token, no streaming (only non-streaming responses carry ``kv_transfer_params``), one choice,
    nothing that makes the engine generate or report more than it must."""
    sp = dict(generate["sampling_params"])
    sp["max_tokens"] = 1
    sp["n"] = 1
    for key in ("min_tokens", "logprobs", "prompt_logprobs"):
        sp.pop(key, None)
    return {**generate, "sampling_params": sp, "stream": False, "stream_options": None,
            "kv_transfer_params": dict(kv_transfer_params)}


def decode_body(generate: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The real request plus the prefill's params, verbatim. A connector that returns none (e.g. a
    shared-storage connector) needs none: the decode engine finds the KV by prompt hash."""
    if kv_transfer_params is None:
        return generate
    return {**generate, "kv_transfer_params": kv_transfer_params}
