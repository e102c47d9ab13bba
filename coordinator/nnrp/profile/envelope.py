"""The request envelope a submit carries, checked against the manifest."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.nnrp.profile.constants import (
    BODY_RESERVED_FIELDS,
    CACHE_MODES,
    DIAGNOSTICS_LEVELS,
    ENVELOPE_FIELDS,
    INVALID_BODY,
    INVALID_ENVELOPE,
    MAX_TIMEOUT_MS,
    MODELS_LIST,
    OPERATION_LEVELS,
    POLICY_FIELDS,
    POLICY_IN_BODY,
    PROFILE,
    SCHEMA_VERSION,
    TRANSPORT_MODES,
    UNSUPPORTED_OPERATION,
    UNSUPPORTED_SCHEMA_VERSION,
)
from coordinator.nnrp.profile.events import ProfileError
from coordinator.nnrp.profile.manifest import (
    ExtensionSelection,
    Manifest,
    OperationCapability,
    select_extensions,
)


@dataclass(frozen=True, slots=True)
class Policy:
    """NNRP-only policy of one operation; none of it exists in the OpenAI body.

    ``timeout_ms``: deadline from submit, then the operation is cancelled (source ``timeout``).
    ``diagnostics``: ``none`` or ``summary`` (one diagnostics record when the operation ends).
    ``cache``: ``default``, or ``isolated`` (the prompt shares no cached prefix with other requests).
    ``transport``: ``inline`` (results in the operation's result frames; the only mode of v1).
    """

    timeout_ms: int | None = None
    diagnostics: str = "none"
    cache: str = "default"
    transport: str = "inline"


@dataclass(frozen=True, slots=True)
class Envelope:
    """An accepted submit. ``body`` is the client's OpenAI request object, not copied; its content is
    validated by the serving path exactly as the HTTP door validates it."""

    operation: str
    body: dict[str, Any]
    stream: bool
    policy: Policy
    extensions: ExtensionSelection
    include_openai_chunk: bool = False


def _choice(policy: Mapping[str, Any], key: str, allowed: tuple[str, ...]) -> str:
    value = policy.get(key)
    if value is None:
        return allowed[0]
    if value not in allowed:
        raise ProfileError(INVALID_ENVELOPE, f"'policy.{key}' must be one of {', '.join(allowed)}",
                           param=f"policy.{key}")
    return str(value)


def _parse_policy(raw: object) -> Policy:
    if raw is None:
        return Policy()
    if not isinstance(raw, Mapping):
        raise ProfileError(INVALID_ENVELOPE, "'policy' must be an object", param="policy")
    unknown = sorted(set(raw) - POLICY_FIELDS)
    if unknown:
        raise ProfileError(INVALID_ENVELOPE, f"unknown policy field '{unknown[0]}'",
                           param=f"policy.{unknown[0]}")
    timeout = raw.get("timeout_ms")
    if timeout is not None and (type(timeout) is not int or not 1 <= timeout <= MAX_TIMEOUT_MS):
        raise ProfileError(INVALID_ENVELOPE, f"'policy.timeout_ms' must be an integer from 1 to "
                           f"{MAX_TIMEOUT_MS}", param="policy.timeout_ms")
    return Policy(timeout_ms=timeout, diagnostics=_choice(raw, "diagnostics", DIAGNOSTICS_LEVELS),
                  cache=_choice(raw, "cache", CACHE_MODES),
                  transport=_choice(raw, "transport", TRANSPORT_MODES))


def _check_operation(operation: object, manifest: Manifest) -> OperationCapability:
    if not isinstance(operation, str):
        raise ProfileError(INVALID_ENVELOPE, "'operation' must be a string", param="operation")
    level = OPERATION_LEVELS.get(operation)
    if level is None:
        raise ProfileError(UNSUPPORTED_OPERATION, f"{operation!r} is not an operation of {SCHEMA_VERSION}",
                           param="operation")
    cap = manifest.operation(operation)
    if cap is None:
        raise ProfileError(UNSUPPORTED_OPERATION, f"{operation!r} (Level {level}) is not supported by this "
                           "server", param="operation")
    return cap


def parse_envelope(data: object, manifest: Manifest) -> Envelope:
    """Accept a submitted envelope or raise ``ProfileError`` for the first failing check.

    Checks, in order: an object with only envelope fields; ``profile`` and ``schema_version``; the
    operation is in the profile and declared by ``manifest``; ``body`` is an object without NNRP policy
    fields and with a boolean (or absent) ``stream``; that mode is served; a ``models.list`` body has
    nothing else; policy; extensions; ``include_openai_chunk``.
    """
    if not isinstance(data, Mapping):
        raise ProfileError(INVALID_ENVELOPE, "the envelope must be a JSON object")
    unknown = sorted(set(data) - ENVELOPE_FIELDS)
    if unknown:
        raise ProfileError(INVALID_ENVELOPE, f"unknown envelope field '{unknown[0]}'", param=unknown[0])
    profile = data.get("profile")
    if profile is not None and profile != PROFILE:
        raise ProfileError(UNSUPPORTED_SCHEMA_VERSION, f"this server speaks the {PROFILE!r} profile only",
                           param="profile")
    version = data.get("schema_version")
    if version is None:
        raise ProfileError(INVALID_ENVELOPE, "'schema_version' is required", param="schema_version")
    if version != SCHEMA_VERSION:
        raise ProfileError(UNSUPPORTED_SCHEMA_VERSION, f"schema_version must be {SCHEMA_VERSION!r}",
                           param="schema_version")
    if data.get("operation") is None:
        raise ProfileError(INVALID_ENVELOPE, "'operation' is required", param="operation")
    cap = _check_operation(data["operation"], manifest)
    body = data.get("body")
    if not isinstance(body, dict):
        raise ProfileError(INVALID_BODY, "'body' must be a JSON object (the OpenAI request)", param="body")
    reserved = sorted(BODY_RESERVED_FIELDS.intersection(body))
    if reserved:
        raise ProfileError(POLICY_IN_BODY, f"'{reserved[0]}' is NNRP policy: put it in the envelope, not in "
                           "the OpenAI body", param=f"body.{reserved[0]}")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ProfileError(INVALID_BODY, "'stream' must be a boolean", param="body.stream")
    stream = bool(stream)
    if (stream and not cap.streaming) or (not stream and not cap.non_streaming):
        mode = "streaming" if stream else "non-streaming"
        raise ProfileError(UNSUPPORTED_OPERATION, f"{cap.name} is not served {mode} by this server",
                           param="body.stream")
    if cap.name == MODELS_LIST:  # OpenAI's list takes no parameters: one given would be silently lost
        extra = sorted(set(body) - {"stream"})
        if extra:
            raise ProfileError(INVALID_BODY, f"models.list takes no request fields, got '{extra[0]}'",
                               param=f"body.{extra[0]}")
    policy = _parse_policy(data.get("policy"))
    selection = select_extensions(manifest, data.get("extensions"))
    chunk = data.get("include_openai_chunk")
    if chunk is not None and not isinstance(chunk, bool):
        raise ProfileError(INVALID_ENVELOPE, "'include_openai_chunk' must be a boolean",
                           param="include_openai_chunk")
    return Envelope(operation=cap.name, body=body, stream=stream, policy=policy, extensions=selection,
                    include_openai_chunk=bool(chunk))


