"""docs/openai-api.md's refused-field table and the validator's field lists cover vLLM's request models.

Every field of vLLM's own ``ChatCompletionRequest`` and ``CompletionRequest`` is either served (the
validator's lists) or refused with a documented reason, and the table names nothing that is served
or that vLLM does not have: a vLLM upgrade that adds a field fails here until someone decides.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from coordinator.pipeline.validation import (
    _CHAT_ONLY_NO_OPS,
    _COMPLETION_ONLY_NO_OPS,
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    NO_OP_FIELDS,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "openai-api.md"


def refused() -> dict[str, str]:
    """Field → the endpoints cell of the table."""
    text = DOC.read_text(encoding="utf-8")
    table = text.split("<!-- refused-fields -->", 1)[1].split("<!-- /refused-fields -->", 1)[0]
    out: dict[str, str] = {}
    for row in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 3 and cells[2], row  # every refusal says why
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            out[name] = cells[1]
    return out


def served(kind: str) -> set[str]:
    if kind == "chat":
        return set(CHAT_FIELDS) | (set(NO_OP_FIELDS) - _COMPLETION_ONLY_NO_OPS)
    return set(COMPLETION_FIELDS) | (set(NO_OP_FIELDS) - _CHAT_ONLY_NO_OPS)


def vllm_fields(kind: str) -> set[str]:
    if kind == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        return set(ChatCompletionRequest.model_fields)
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    return set(CompletionRequest.model_fields)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_vllm_request_field_is_served_or_refused_with_a_reason(kind: str) -> None:
    table = refused()
    missing = sorted(vllm_fields(kind) - served(kind) - set(table))
    assert not missing, f"vLLM {kind} fields neither served nor in docs/openai-api.md's table: {missing}"


def test_the_table_names_only_vllm_fields_the_coordinator_does_not_serve() -> None:
    table = refused()
    for name in table:
        in_vllm = [k for k in ("chat", "completion") if name in vllm_fields(k)]
        assert in_vllm, f"{name}: no vLLM request has it (stale row)"
        assert all(name not in served(k) or name in NO_OP_FIELDS for k in in_vllm), \
            f"{name} is served, yet the table refuses it"
