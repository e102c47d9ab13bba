"""The render sidecar's own routes and headers: what our sidecar adds to vLLM's render server and the
coordinator relies on. Both sides import these names, so a renamed path or field fails both.

A plain ``vllm launch render`` answers none of them; the coordinator then falls back as
docs/parsers.md and docs/render.md describe (probe call, hashing itself, converting in-process).
"""

from __future__ import annotations

from typing import TypedDict

CAPABILITIES_PATH = "/derender/capabilities"
"""``GET``: a ``Capabilities`` document."""
MESSAGES_CHAT_PATH = "/v1/messages/chat"
"""``POST`` an Anthropic Messages request: the equivalent chat completion request (vLLM's converter)."""
COUNT_TOKENS_CHAT_PATH = "/v1/messages/count_tokens/chat"
"""``POST`` an Anthropic count-tokens request: the chat request whose prompt is counted."""
RESPONSES_CHAT_PATH = "/v1/responses/chat"
"""``POST`` an OpenAI Responses request: the equivalent chat completion request."""

PREFIX_HASH_HEADER = "x-prefix-hash"
"""On a render call: ``<block_size> <model>``; the answer's ``GenerateRequest``s then carry
``block_hashes`` (``coordinator.contracts.hashing`` seeded with the model) and the header is echoed, so
a sidecar without the route is recognised."""


class SessionCacheLimits(TypedDict):
    max_entries: int
    max_bytes: int
    idle_ttl_s: float


class Capabilities(TypedDict):
    """What a coordinator must mirror: the parsers the sidecar derenders with, and its session cache."""

    tool_call_parser: str | None
    reasoning_parser: str | None
    enable_auto_tool_choice: bool
    parsers: bool  # a derenderer with a parser is loaded
    session_cache: SessionCacheLimits | None
    vllm_version: str


def prefix_hash_spec(block_size: int, model: str) -> str:
    """The ``x-prefix-hash`` value asking for ``block_size``-token blocks seeded with ``model``."""
    return f"{block_size} {model}"


def parse_prefix_hash_spec(value: bytes) -> tuple[int, str] | None:
    """``b"16 my-model"`` → (16, "my-model"); None for anything else."""
    size, _, model = value.decode("latin-1").partition(" ")
    if not size.isdigit() or not 0 < int(size) <= 65536 or not model:
        return None
    return int(size), model
