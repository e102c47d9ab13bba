"""The capability manifest a client reads before it submits, and the extension rules (§10.3)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.nnrp.profile.constants import (
    ADAPTER,
    CHAT_COMPLETIONS_CREATE,
    INVALID_ENVELOPE,
    MODELS_LIST,
    OPERATION_LEVELS,
    PROFILE,
    RESPONSES_CREATE,
    SCHEMA_VERSION,
    UNSUPPORTED_EXTENSION,
)
from coordinator.nnrp.profile.events import Event, ManifestError, ProfileError

# ``vendor.feature``: at least two dot-separated lowercase parts, so an extension can never be
# mistaken for a profile field and two vendors' names cannot collide.
_EXTENSION_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*(\.[a-z0-9][a-z0-9_-]*)+")


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


