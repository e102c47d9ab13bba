"""The openai-compatible/1 API profile: what an NNRP operation carrying an OpenAI request looks like.

The profile is the contract between an NNRP client and this server that does not depend on frames or
sockets: the request envelope a submit carries, the operation names, the events an operation's
results are made of, the error body, and the capability manifest a client reads before it submits.
It is kept apart from the wire protocol and from the pipeline so that both doors' behaviour can be
checked, and the mapping benchmarked, without an engine, a socket or vLLM (``docs/nnrp.md``).

Everything here is pure: no I/O, no framework, no vLLM. Envelopes and manifests are frozen
dataclasses, events are plain JSON-ready dicts (typed as ``TypedDict``) because one is built per
streamed chunk and goes straight to an encoder.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Literal, NotRequired, TypedDict

# --------------------------------------------------------------------------------------------------
# Frozen constants
# --------------------------------------------------------------------------------------------------

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

# ``vendor.feature``: at least two dot-separated lowercase parts, so an extension can never be
# mistaken for a profile field and two vendors' names cannot collide.
_EXTENSION_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*(\.[a-z0-9][a-z0-9_-]*)+")


# --------------------------------------------------------------------------------------------------
# Errors and event shapes
# --------------------------------------------------------------------------------------------------


class OpenAIErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | int | None


class OpenAIErrorBody(TypedDict):
    error: OpenAIErrorDetail


class TextDeltaEvent(TypedDict):
    type: Literal["response.output_text.delta"]
    choice_index: int
    delta: str
    openai_chunk: NotRequired[Mapping[str, Any]]
    extensions: NotRequired[dict[str, Any]]


class ToolCallDeltaEvent(TypedDict):
    type: Literal["response.tool_call.delta"]
    choice_index: int
    tool_call: Mapping[str, Any]  # the OpenAI ``delta.tool_calls[]`` entry, unchanged
    openai_chunk: NotRequired[Mapping[str, Any]]
    extensions: NotRequired[dict[str, Any]]


class UsageEvent(TypedDict):
    type: Literal["response.usage"]
    usage: Mapping[str, Any]
    openai_chunk: NotRequired[Mapping[str, Any]]
    extensions: NotRequired[dict[str, Any]]


class ChoiceFinish(TypedDict):
    index: int
    finish_reason: str | None


class CompletedEvent(TypedDict):
    type: Literal["response.completed"]
    id: str | None
    model: str | None
    finish_reason: str | None  # choice 0's; ``choices`` has every choice's
    choices: list[ChoiceFinish]
    response: NotRequired[Mapping[str, Any]]  # the whole chat.completion (non-streaming only)
    extensions: NotRequired[dict[str, Any]]


class ErrorEvent(TypedDict):
    type: Literal["response.error"]
    status: int
    error: OpenAIErrorDetail
    openai_chunk: NotRequired[Mapping[str, Any]]
    extensions: NotRequired[dict[str, Any]]


class CancelDiagnostics(TypedDict):
    source: str
    reason: str
    operation_id: str | None
    engine_abort_accepted: bool | None


class CancelledEvent(TypedDict):
    type: Literal["response.cancelled"]
    diagnostics: CancelDiagnostics
    extensions: NotRequired[dict[str, Any]]


Event = TextDeltaEvent | ToolCallDeltaEvent | UsageEvent | CompletedEvent | ErrorEvent | CancelledEvent
# What one chunk can give: these are the events that may carry ``openai_chunk``.
ChunkEvent = TextDeltaEvent | ToolCallDeltaEvent | UsageEvent | ErrorEvent


class ProfileError(Exception):
    """A submit the profile refuses, with the OpenAI error body and event the client gets for it.

    ``code`` is one of ``ERROR_CODES``; ``param`` is the path inside the envelope (``body.timeout_ms``,
    ``extensions[1]``) so a client sees which part of its submit was wrong.
    """

    def __init__(self, code: str, message: str, *, param: str | None = None, status: int = 400,
                 type_: str = BAD_REQUEST_TYPE) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.status = status
        self.type = type_

    def detail(self) -> OpenAIErrorDetail:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def body(self) -> OpenAIErrorBody:
        return {"error": self.detail()}

    def event(self) -> ErrorEvent:
        return {"type": ERROR, "status": self.status, "error": self.detail()}


class ManifestError(ValueError):
    """A capability document that does not follow the profile (``path`` names the offending member)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


def error_event(detail: Mapping[str, Any], status: int | None = None) -> ErrorEvent:
    """``response.error`` from an OpenAI error detail, e.g. a pipeline error's ``body()["error"]``.

    Without an explicit status the integer ``code`` the HTTP door puts there is used, else 500; the
    four members are always present so clients can read the body exactly as over HTTP.
    """
    code = detail.get("code")
    if status is None:
        status = code if type(code) is int and 400 <= code <= 599 else 500
    param = detail.get("param")
    return {"type": ERROR, "status": status, "error": {
        "message": str(detail.get("message") or "Internal server error"),
        "type": str(detail.get("type") or "InternalServerError"),
        "param": param if isinstance(param, str) else None,
        "code": code if isinstance(code, str | int) and not isinstance(code, bool) else None,
    }}


def cancelled_event(source: str, reason: str, *, operation_id: str | None = None,
                    engine_abort_accepted: bool | None = None) -> CancelledEvent:
    """``response.cancelled``; ``engine_abort_accepted`` is None when the engine had not answered the abort
    (or no engine request existed) by the time the event had to go out, which is immediately."""
    if source not in CANCEL_SOURCES:
        raise ValueError(f"cancel source must be one of {CANCEL_SOURCES}, not {source!r}")
    diagnostics: CancelDiagnostics = {"source": source, "reason": reason, "operation_id": operation_id,
                                      "engine_abort_accepted": engine_abort_accepted}
    return {"type": CANCELLED, "diagnostics": diagnostics}


# --------------------------------------------------------------------------------------------------
# Capability manifest and the §10.3 extension rules
# --------------------------------------------------------------------------------------------------


def _check_extension_name(name: object, path: str) -> str:
    if not isinstance(name, str) or not _EXTENSION_NAME.fullmatch(name):
        raise ManifestError(path, f"an extension name is 'vendor.feature' in lowercase, not {name!r}")
    return name


@dataclass(frozen=True, slots=True)
class Extension:
    """A provider extension. ``critical``: it changes what standard fields mean, so it is applied
    only for a client that selected it; a non-critical one only adds fields clients may ignore."""

    name: str
    critical: bool = False

    def __post_init__(self) -> None:
        _check_extension_name(self.name, "extension.name")


@dataclass(frozen=True, slots=True)
class OperationCapability:
    name: str
    streaming: bool
    non_streaming: bool
    tool_calls: bool


@dataclass(frozen=True, slots=True)
class Manifest:
    """The capability document a client reads before it submits, and conformance selects recipes by."""

    adapter: str
    compatibility_levels: tuple[int, ...]
    operations: tuple[OperationCapability, ...]
    extensions: tuple[Extension, ...] = ()
    profile: str = PROFILE
    schema_version: str = SCHEMA_VERSION

    def operation(self, name: str) -> OperationCapability | None:
        return next((op for op in self.operations if op.name == name), None)

    def extension(self, name: str) -> Extension | None:
        return next((ext for ext in self.extensions if ext.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "adapter": self.adapter,
            "profile": self.profile,
            "schema_version": self.schema_version,
            "compatibility_levels": list(self.compatibility_levels),
            "operations": [{"name": op.name, "streaming": op.streaming, "non_streaming": op.non_streaming,
                            "tool_calls": op.tool_calls} for op in self.operations],
            "extensions": [{"name": ext.name, "critical": ext.critical} for ext in self.extensions],
        }


@dataclass(frozen=True, slots=True)
class ServingCapabilities:
    """What the running configuration can really do, as the server will derive it from its config.

    ``tool_calls`` is true only when a tool parser is configured: without one the engine's output is
    never split into tool-call deltas, so advertising them would select recipes that must fail.
    ``responses``: ``responses.create`` is wired (its requests need the render sidecar's conversion);
    ``models_list``: ``models.list`` is wired (the model catalog). Both default to off, so a manifest
    never declares an operation nobody gave the session the means to run.
    """

    tool_calls: bool = False
    streaming: bool = True
    non_streaming: bool = True
    extensions: tuple[Extension, ...] = ()
    responses: bool = False
    models_list: bool = False


def build_manifest(caps: ServingCapabilities) -> Manifest:
    """The manifest for a configuration. Level 1 is claimed only when chat is served both ways, Level 2
    only when ``responses.create`` is, Level 3 when ``models.list`` is declared (it has no stream)."""
    if len({ext.name for ext in caps.extensions}) != len(caps.extensions):
        raise ValueError("extension names must be unique")
    both = caps.streaming and caps.non_streaming
    ops = [OperationCapability(CHAT_COMPLETIONS_CREATE, streaming=caps.streaming,
                               non_streaming=caps.non_streaming, tool_calls=caps.tool_calls)]
    levels = [1] if both else []
    if caps.responses:
        # Tool calls reach a Responses client as function_call items, split by the same parser.
        ops.append(OperationCapability(RESPONSES_CREATE, streaming=caps.streaming,
                                       non_streaming=caps.non_streaming, tool_calls=caps.tool_calls))
        levels += [2] if both else []
    if caps.models_list and caps.non_streaming:
        ops.append(OperationCapability(MODELS_LIST, streaming=False, non_streaming=True, tool_calls=False))
        levels.append(3)
    return Manifest(adapter=ADAPTER, compatibility_levels=tuple(levels), operations=tuple(ops),
                    extensions=tuple(caps.extensions))


def _bool(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        raise ManifestError(path, "must be a boolean")
    return value


def _members(data: object, path: str, required: frozenset[str]) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ManifestError(path, "must be an object")
    missing = sorted(required - set(data))
    if missing:
        raise ManifestError(f"{path}.{missing[0]}" if path != "$" else missing[0], "is required")
    return data


def parse_manifest(data: object) -> Manifest:
    """Validate a capability document (Level-1 case 10) and read it into a ``Manifest``.

    Unknown members are allowed (a later profile revision may add some); everything the profile
    defines must be present with the right type, names must be unique, only profile operations may
    be declared, and a claimed level must be backed by its operations.
    """
    doc = _members(data, "$", frozenset({"adapter", "profile", "schema_version", "compatibility_levels",
                                         "operations", "extensions"}))
    if not isinstance(doc["adapter"], str) or not doc["adapter"]:
        raise ManifestError("adapter", "must be a non-empty string")
    if doc["profile"] != PROFILE:
        raise ManifestError("profile", f"must be {PROFILE!r}")
    if doc["schema_version"] != SCHEMA_VERSION:
        raise ManifestError("schema_version", f"must be {SCHEMA_VERSION!r}")
    levels = doc["compatibility_levels"]
    if (not isinstance(levels, list) or any(type(lv) is not int or lv not in (1, 2, 3) for lv in levels)
            or len(set(levels)) != len(levels)):
        raise ManifestError("compatibility_levels", "must be a list of distinct levels among 1, 2, 3")
    ops_doc = doc["operations"]
    if not isinstance(ops_doc, list):
        raise ManifestError("operations", "must be a list")
    ops: list[OperationCapability] = []
    for i, raw in enumerate(ops_doc):
        path = f"operations[{i}]"
        op = _members(raw, path, frozenset({"name", "streaming", "non_streaming", "tool_calls"}))
        if op["name"] not in OPERATION_LEVELS:
            raise ManifestError(f"{path}.name", f"{op['name']!r} is not an operation of {SCHEMA_VERSION}")
        if any(o.name == op["name"] for o in ops):
            raise ManifestError(f"{path}.name", f"{op['name']!r} is declared twice")
        ops.append(OperationCapability(op["name"], _bool(op["streaming"], f"{path}.streaming"),
                                       _bool(op["non_streaming"], f"{path}.non_streaming"),
                                       _bool(op["tool_calls"], f"{path}.tool_calls")))
    exts_doc = doc["extensions"]
    if not isinstance(exts_doc, list):
        raise ManifestError("extensions", "must be a list")
    exts: list[Extension] = []
    for i, raw in enumerate(exts_doc):
        path = f"extensions[{i}]"
        ext = _members(raw, path, frozenset({"name", "critical"}))
        name = _check_extension_name(ext["name"], f"{path}.name")
        if any(e.name == name for e in exts):
            raise ManifestError(f"{path}.name", f"{name!r} is declared twice")
        exts.append(Extension(name, _bool(ext["critical"], f"{path}.critical")))
    if 1 in levels:
        chat = next((o for o in ops if o.name == CHAT_COMPLETIONS_CREATE), None)
        if chat is None or not (chat.streaming and chat.non_streaming):
            raise ManifestError("compatibility_levels", "Level 1 needs chat.completions.create streaming "
                                "and non-streaming")
    for level in levels:
        if level > 1 and not any(OPERATION_LEVELS[o.name] == level for o in ops):
            raise ManifestError("compatibility_levels", f"Level {level} is claimed but none of its "
                                "operations is declared")
    return Manifest(adapter=doc["adapter"], compatibility_levels=tuple(levels), operations=tuple(ops),
                    extensions=tuple(exts))


@dataclass(frozen=True, slots=True)
class ExtensionSelection:
    """The extensions in effect for one operation: what the server declared and the client selected."""

    declared: tuple[Extension, ...]
    selected: frozenset[str]

    def allows(self, name: str) -> bool:
        """An extension's fields may appear in this operation's events: declared, and either
        non-critical (clients ignore what they do not know) or critical and selected."""
        ext = next((e for e in self.declared if e.name == name), None)
        return ext is not None and (not ext.critical or name in self.selected)

    @property
    def active(self) -> frozenset[str]:
        return frozenset(e.name for e in self.declared if not e.critical or e.name in self.selected)


def select_extensions(manifest: Manifest, selected: object, *,
                      param: str = "extensions") -> ExtensionSelection:
    """Check a client's selection: a list of distinct names, each declared by ``manifest``.

    Selecting an undeclared extension is refused rather than ignored: the client asked for behaviour
    it will then assume, critical or not, and a typo must not pass silently.
    """
    if selected is None:
        return ExtensionSelection(manifest.extensions, frozenset())
    if not isinstance(selected, list):
        raise ProfileError(INVALID_ENVELOPE, f"'{param}' must be a list of extension names", param=param)
    names: set[str] = set()
    for i, name in enumerate(selected):
        where = f"{param}[{i}]"
        if not isinstance(name, str):
            raise ProfileError(INVALID_ENVELOPE, f"'{where}' must be a string", param=where)
        if name in names:
            raise ProfileError(INVALID_ENVELOPE, f"extension {name!r} is selected twice", param=where)
        if manifest.extension(name) is None:
            raise ProfileError(UNSUPPORTED_EXTENSION, f"extension {name!r} is not declared by this server",
                               param=where)
        names.add(name)
    return ExtensionSelection(manifest.extensions, frozenset(names))


def add_extension_fields(event: Event, name: str, fields: Mapping[str, Any],
                         selection: ExtensionSelection) -> bool:
    """Put an extension's fields under ``event["extensions"][name]`` when the selection allows it.

    Extension data never sits next to the standard fields, so it cannot change their meaning
    (§10.3 rule 1) and ignoring it is dropping one member. Returns whether the fields were added.
    """
    if not selection.allows(name):
        return False
    exts: dict[str, Any] = event.setdefault("extensions", {})
    exts[name] = dict(fields)
    return True


def extension_violations(event: Mapping[str, Any], selection: ExtensionSelection) -> list[str]:
    """What an event carries that §10.3 forbids: undeclared extensions, critical ones not selected."""
    exts = event.get("extensions")
    if exts is None:
        return []
    if not isinstance(exts, Mapping):
        return ["'extensions' is not an object"]
    problems = []
    for name in exts:
        ext = next((e for e in selection.declared if e.name == name), None)
        if ext is None:
            problems.append(f"extension {name!r} is not declared in the manifest")
        elif ext.critical and name not in selection.selected:
            problems.append(f"critical extension {name!r} was not selected")
    return problems


def baseline_event(event: Mapping[str, Any]) -> dict[str, Any]:
    """The event as a Level-1 check sees it: without extension data or the raw OpenAI chunk, which
    no Level-1 result may depend on (§10.3 rules 3 and 5; consumers must not rely on ``openai_chunk``)."""
    return {k: v for k, v in event.items() if k not in ("extensions", "openai_chunk")}


# --------------------------------------------------------------------------------------------------
# Request envelope
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# OpenAI chat output → profile events
# --------------------------------------------------------------------------------------------------


class EventMapper:
    """What every operation's mapper keeps: exactly one terminal event, and nothing after it.

    ``fail`` and ``cancel`` give the terminal event of an end outside the operation's output (a
    pipeline error, a cancellation), or None once another terminal event was produced. ``flush`` gives
    the events an operation's output still owes once its stream ended, before ``complete()``'s
    terminal event (none for chat; a Responses stream closes its open output item). A non-streaming
    operation uses only the terminal state: its whole result is mapped at once.
    """

    __slots__ = ("terminated",)

    def __init__(self) -> None:
        self.terminated = False

    def flush(self) -> Sequence[Mapping[str, Any]]:
        return ()

    def fail(self, detail: Mapping[str, Any], status: int | None = None) -> ErrorEvent | None:
        """The terminal event for a failure outside the chunk stream (e.g. a pipeline error)."""
        if self.terminated:
            return None
        self.terminated = True
        return error_event(detail, status)

    def cancel(self, source: str, reason: str, *, operation_id: str | None = None,
               engine_abort_accepted: bool | None = None) -> CancelledEvent | None:
        """The terminal event for a cancellation; None if the operation already ended otherwise."""
        if self.terminated:
            return None
        event = cancelled_event(source, reason, operation_id=operation_id,
                                engine_abort_accepted=engine_abort_accepted)
        self.terminated = True
        return event


class ChatStreamMapper(EventMapper):
    """Turns one operation's chat.completion.chunk dicts, as the SSE path emits them, into events.

    Per chunk and choice: non-empty ``delta.content`` → ``response.output_text.delta``, each
    ``delta.tool_calls[]`` entry → ``response.tool_call.delta``; the usage chunk (``choices: []``) →
    ``response.usage``; a ``{"error": …}`` chunk → ``response.error``. A finish reason is remembered
    and reported by ``complete()``, the terminal ``response.completed`` after the stream ended (so it
    follows the usage event, which comes after every choice finished). The role-opening chunk and empty
    deltas carry no profile data and give no event. After a terminal event the mapper is closed: later
    chunks give nothing and another terminal gives None, so nothing can follow ``response.cancelled``.
    """

    __slots__ = ("_finish", "_id", "_model", "include_openai_chunk")

    def __init__(self, *, include_openai_chunk: bool = False) -> None:
        super().__init__()
        self.include_openai_chunk = include_openai_chunk
        self._finish: dict[int, str | None] = {}
        self._id: str | None = None
        self._model: str | None = None

    def map_chunk(self, chunk: Mapping[str, Any]) -> list[ChunkEvent]:
        if self.terminated:
            return []
        events: list[ChunkEvent] = []
        if "error" in chunk and "choices" not in chunk:
            self.terminated = True
            err = chunk["error"]
            events.append(error_event(err if isinstance(err, Mapping) else {"message": str(err)}))
            if self.include_openai_chunk:
                events[0]["openai_chunk"] = chunk
            return events
        if self._id is None:
            self._id = chunk.get("id")
            self._model = chunk.get("model")
        choices = chunk.get("choices") or ()
        for choice in choices:
            index = choice.get("index", 0)
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                events.append({"type": OUTPUT_TEXT_DELTA, "choice_index": index, "delta": content})
            for call in delta.get("tool_calls") or ():
                events.append({"type": TOOL_CALL_DELTA, "choice_index": index, "tool_call": call})
            finish = choice.get("finish_reason")
            if finish is not None or index not in self._finish:
                self._finish[index] = finish
        usage = chunk.get("usage")
        if not choices and isinstance(usage, Mapping):
            events.append({"type": USAGE, "usage": usage})
        if events and self.include_openai_chunk:
            events[0]["openai_chunk"] = chunk
        return events

    def complete(self) -> CompletedEvent | None:
        """The terminal event once the chunk stream ended normally; None if already terminated."""
        if self.terminated:
            return None
        self.terminated = True
        return _completed(self._id, self._model, self._finish)


def _completed(response_id: Any, model: Any, finish: Mapping[int, str | None]) -> CompletedEvent:
    choices: list[ChoiceFinish] = [{"index": i, "finish_reason": finish[i]} for i in sorted(finish)]
    return {"type": COMPLETED, "id": response_id if isinstance(response_id, str) else None,
            "model": model if isinstance(model, str) else None,
            "finish_reason": choices[0]["finish_reason"] if choices else None, "choices": choices}


def map_chat_completion(response: Mapping[str, Any]) -> list[Event]:
    """A non-streaming result: ``response.usage`` (when the body has usage) then ``response.completed``
    carrying the whole chat.completion as ``response``; an OpenAI error body gives ``response.error``."""
    if "error" in response and "choices" not in response:
        err = response["error"]
        return [error_event(err if isinstance(err, Mapping) else {"message": str(err)})]
    events: list[Event] = []
    usage = response.get("usage")
    if isinstance(usage, Mapping):
        events.append({"type": USAGE, "usage": usage})
    finish = {c.get("index", i): c.get("finish_reason") for i, c in enumerate(response.get("choices") or ())}
    completed = _completed(response.get("id"), response.get("model"), finish)
    completed["response"] = response
    events.append(completed)
    return events
