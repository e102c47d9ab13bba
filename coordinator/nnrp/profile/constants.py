"""The profile's frozen names: operations, event types, error codes, envelope fields."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

PROFILE: Final = "openai-compatible"
SCHEMA_VERSION: Final = "openai-compatible/1"
ADAPTER: Final = "llm-coordinator"

CHAT_COMPLETIONS_CREATE: Final = "chat.completions.create"
RESPONSES_CREATE: Final = "responses.create"
MODELS_LIST: Final = "models.list"
EMBEDDINGS_CREATE: Final = "embeddings.create"

# Every operation name the profile defines, with the compatibility level that introduces it. A name
# outside this table is not part of openai-compatible/1 at all (``completions.create`` included).
OPERATION_LEVELS: Final[Mapping[str, int]] = MappingProxyType({
    CHAT_COMPLETIONS_CREATE: 1,
    RESPONSES_CREATE: 2,
    MODELS_LIST: 3,
    EMBEDDINGS_CREATE: 3,
})
LEVEL_1_OPERATIONS: Final = frozenset({CHAT_COMPLETIONS_CREATE})
# What this server can serve; each is declared (and so served) only when its configuration runs it.
SERVABLE_OPERATIONS: Final = frozenset({CHAT_COMPLETIONS_CREATE, RESPONSES_CREATE, MODELS_LIST})
# Known to the profile, never implemented by this server: submitting one is ``unsupported_operation``.
KNOWN_UNSUPPORTED_OPERATIONS: Final = frozenset(OPERATION_LEVELS) - SERVABLE_OPERATIONS

OUTPUT_TEXT_DELTA: Final = "response.output_text.delta"
TOOL_CALL_DELTA: Final = "response.tool_call.delta"
USAGE: Final = "response.usage"
COMPLETED: Final = "response.completed"
ERROR: Final = "response.error"
CANCELLED: Final = "response.cancelled"
EVENT_TYPES: Final = (OUTPUT_TEXT_DELTA, TOOL_CALL_DELTA, USAGE, COMPLETED, ERROR, CANCELLED)
# Exactly one of these ends every operation; nothing follows it.
TERMINAL_EVENT_TYPES: Final = frozenset({COMPLETED, ERROR, CANCELLED})

# Error codes the profile itself defines (``error.code``). Errors raised by the serving path after
# the envelope was accepted keep the code the HTTP door would send (the HTTP status, an integer).
INVALID_ENVELOPE: Final = "invalid_envelope"
INVALID_BODY: Final = "invalid_body"
POLICY_IN_BODY: Final = "policy_in_body"
UNSUPPORTED_SCHEMA_VERSION: Final = "unsupported_schema_version"
UNSUPPORTED_OPERATION: Final = "unsupported_operation"
UNSUPPORTED_EXTENSION: Final = "unsupported_extension"
ERROR_CODES: Final = frozenset({INVALID_ENVELOPE, INVALID_BODY, POLICY_IN_BODY, UNSUPPORTED_SCHEMA_VERSION,
                                UNSUPPORTED_OPERATION, UNSUPPORTED_EXTENSION})
BAD_REQUEST_TYPE: Final = "BadRequestError"  # the type name the HTTP door uses for a 400

ENVELOPE_FIELDS: Final = frozenset({"profile", "schema_version", "operation", "body", "policy", "extensions",
                                    "include_openai_chunk"})
POLICY_FIELDS: Final = frozenset({"timeout_ms", "diagnostics", "cache", "transport"})
DIAGNOSTICS_LEVELS: Final = ("none", "summary")
CACHE_MODES: Final = ("default", "isolated")
TRANSPORT_MODES: Final = ("inline",)
MAX_TIMEOUT_MS: Final = 86_400_000
# NNRP policy in the OpenAI body is refused, not ignored: a client that put ``timeout_ms`` there
# believes it has a deadline. None of these names is an OpenAI or vLLM request field.
BODY_RESERVED_FIELDS: Final = POLICY_FIELDS | frozenset({"timeout", "policy", "extensions",
                                                         "include_openai_chunk", "nnrp"})

CANCEL_SOURCES: Final = ("client", "timeout", "session", "server")

# The adapter's own diagnostics schema (issue: unknown diagnostic fields are ignored unless the client
# selects it). Declared by the server once it emits those fields; nothing here declares it by default.
DIAGNOSTICS_EXTENSION: Final = "llm-coordinator.diagnostics"
