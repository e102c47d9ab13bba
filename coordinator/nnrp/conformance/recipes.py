"""Conformance recipes: loading, ``${NAME}`` parameters, selection by manifest, event matching.

A recipe is a readable JSON file (seed 000 §10.2) and stays the source of truth: this module only
reads it, fills its parameters and judges a run's events against it. Nothing here does I/O beyond
reading the recipe files, so selection and matching are testable without a server
(``docs/nnrp.md``, "Conformance").
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from coordinator.nnrp.profile import (
    CANCELLED,
    COMPLETED,
    ERROR,
    PROFILE,
    SCHEMA_VERSION,
    TERMINAL_EVENT_TYPES,
    TOOL_CALL_DELTA,
    ExtensionSelection,
    Manifest,
    baseline_event,
    extension_violations,
)

_PARAM = re.compile(r"\$\{([A-Z][A-Z0-9_]*)\}")
TERMINALS = {"success": COMPLETED, "error": ERROR, "cancelled": CANCELLED}
# Type placeholders a recipe may put where a value of that JSON type is expected.
_TYPES: dict[str, tuple[type, ...]] = {
    "<string>": (str,), "<integer>": (int,), "<number>": (int, float), "<boolean>": (bool,),
    "<object>": (dict,), "<array>": (list,), "<null>": (type(None),),
}
RECIPE_FIELDS = frozenset({"id", "title", "case", "level", "kind", "profile", "schema_version", "operation",
                           "requires", "request", "actions", "expect", "timeout_s"})


class RecipeError(ValueError):
    """A recipe file that cannot be read, or a parameter it uses that was not given."""


@dataclass(frozen=True)
class Recipe:
    """One recipe as read from its file, parameters still unfilled (``raw``)."""

    id: str
    raw: Mapping[str, Any]
    source: str = ""

    @property
    def case(self) -> int | None:
        value = self.raw.get("case")
        return value if isinstance(value, int) else None

    @property
    def kind(self) -> str:
        return str(self.raw.get("kind", "operation"))

    @property
    def parameters(self) -> set[str]:
        return set(_PARAM.findall(json.dumps(self.raw)))

    def render(self, params: Mapping[str, str]) -> dict[str, Any]:
        """The recipe with every ``${NAME}`` replaced; a missing parameter is an error, not a blank."""
        missing = sorted(self.parameters - set(params))
        if missing:
            raise RecipeError(f"recipe {self.id!r} needs parameter(s) {', '.join(missing)}")
        filled: dict[str, Any] = substitute(self.raw, params)
        return filled


def substitute(value: Any, params: Mapping[str, str]) -> Any:
    """Fill ``${NAME}`` in every string of a JSON value (keys included)."""
    if isinstance(value, str):
        return _PARAM.sub(lambda m: params[m.group(1)] if m.group(1) in params else m.group(0), value)
    if isinstance(value, list):
        return [substitute(v, params) for v in value]
    if isinstance(value, Mapping):
        return {substitute(k, params): substitute(v, params) for k, v in value.items()}
    return value


def parse_recipe(data: object, source: str = "") -> Recipe:
    """Check a recipe's outline (unknown members are refused: a typo would silently skip a check)."""
    where = source or "recipe"
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: a recipe is a JSON object")
    unknown = sorted(set(data) - RECIPE_FIELDS)
    if unknown:
        raise RecipeError(f"{where}: unknown member(s) {', '.join(unknown)}")
    rid = data.get("id")
    if not isinstance(rid, str) or not rid:
        raise RecipeError(f"{where}: 'id' must be a non-empty string")
    kind = data.get("kind", "operation")
    if kind not in ("operation", "manifest"):
        raise RecipeError(f"{where}: 'kind' must be 'operation' or 'manifest'")
    expect = data.get("expect")
    if not isinstance(expect, dict):
        raise RecipeError(f"{where}: 'expect' must be an object")
    if kind == "operation":
        if not isinstance(data.get("operation"), str):
            raise RecipeError(f"{where}: 'operation' must be a string")
        request = data.get("request")
        if not isinstance(request, dict) or not isinstance(request.get("body"), dict):
            raise RecipeError(f"{where}: 'request.body' must be an object")
        if expect.get("terminal") not in TERMINALS:
            raise RecipeError(f"{where}: 'expect.terminal' must be one of {', '.join(TERMINALS)}")
        for i, entry in enumerate(expect.get("events", [])):
            if not isinstance(entry, dict) or not isinstance(entry.get("type"), str | list):
                raise RecipeError(f"{where}: 'expect.events[{i}].type' must be a string or a list")
    return Recipe(rid, data, source)


def load_recipes(paths: Iterable[Path] | None = None) -> list[Recipe]:
    """Recipes from files or folders (``*.json``, sorted); the packaged set (Levels 1 to 3) by default."""
    files: list[tuple[str, str]] = []
    if paths is None:
        folder = resources.files(__package__ or "coordinator.nnrp.conformance").joinpath("recipes")
        files = sorted((e.name, e.read_text(encoding="utf-8")) for e in folder.iterdir()
                       if e.name.endswith(".json"))
    else:
        for path in paths:
            found = sorted(path.glob("*.json")) if path.is_dir() else [path]
            files += [(str(p), p.read_text(encoding="utf-8")) for p in found]
    recipes = []
    for name, text in files:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RecipeError(f"{name}: not JSON ({exc})") from exc
        recipes.append(parse_recipe(data, name))
    ids = [r.id for r in recipes]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise RecipeError(f"recipe id(s) used twice: {', '.join(dupes)}")
    return recipes


# --------------------------------------------------------------------------------------------------
# Selection (seed 000 §10.3)
# --------------------------------------------------------------------------------------------------


def selected_extensions(recipe: Mapping[str, Any]) -> list[str]:
    """Extensions a recipe exercises: those its envelope selects plus those it requires."""
    names = list((recipe.get("request") or {}).get("extensions") or [])
    names += [n for n in (recipe.get("requires") or {}).get("extensions") or [] if n not in names]
    return names


def why_not_selected(recipe: Mapping[str, Any], manifest: Manifest,
                     chosen_extensions: Iterable[str] = ()) -> str | None:
    """None when the manifest supports the recipe, else why it is skipped.

    An extension must be declared; a critical one runs only when the run names it explicitly (it
    changes behaviour a baseline run must not depend on); a non-critical one needs nothing.
    """
    if recipe.get("profile", PROFILE) != manifest.profile:
        return f"profile {recipe.get('profile')!r} is not the manifest's"
    if recipe.get("schema_version", SCHEMA_VERSION) != manifest.schema_version:
        return f"schema version {recipe.get('schema_version')!r} is not the manifest's"
    level = recipe.get("level", 1)
    if level not in manifest.compatibility_levels:
        return f"Level {level} is not claimed"
    chosen = set(chosen_extensions)
    for name in selected_extensions(recipe):
        ext = manifest.extension(name)
        if ext is None:
            return f"extension {name!r} is not declared"
        if ext.critical and name not in chosen:
            return f"critical extension {name!r} is not selected for this run"
    if recipe.get("kind", "operation") == "manifest":
        return None
    requires = recipe.get("requires") or {}
    name = str(recipe.get("operation"))
    op = manifest.operation(name)
    if requires.get("declared", True) is False:
        return f"{name} is declared" if op is not None else None
    if op is None:
        return f"{name} is not declared"
    body = (recipe.get("request") or {}).get("body") or {}
    if body.get("stream") is True and not op.streaming:
        return f"{name} is not declared streaming"
    if body.get("stream") is not True and not op.non_streaming:
        return f"{name} is not declared non-streaming"
    for cap in ("streaming", "non_streaming", "tool_calls"):
        if requires.get(cap) is True and not getattr(op, cap):
            return f"{name} does not declare {cap}"
    return None


# --------------------------------------------------------------------------------------------------
# Matching
# --------------------------------------------------------------------------------------------------


def match_value(pattern: Any, value: Any, path: str = "$") -> str | None:
    """None when ``value`` matches ``pattern``, else where and why not.

    Objects match when every member of the pattern matches (other members are free); a list pattern
    matches when each of its items matches some item of the list; ``"<integer>"`` and its siblings
    match any value of that JSON type (``true`` is not an integer); ``"<string|null>"`` any of
    several; anything else must be equal.
    """
    if isinstance(pattern, str) and pattern.startswith("<") and pattern.endswith(">"):
        kinds = [f"<{k}>" for k in pattern[1:-1].split("|")]
        if all(k in _TYPES for k in kinds):
            for k in kinds:
                if isinstance(value, _TYPES[k]) and not (k in ("<integer>", "<number>")
                                                         and isinstance(value, bool)):
                    return None
            return f"{path}: {value!r} is not {pattern}"
    if isinstance(pattern, dict):
        if not isinstance(value, dict):
            return f"{path}: expected an object, got {value!r}"
        for key, sub in pattern.items():
            if key not in value:
                return f"{path}.{key}: missing"
            problem = match_value(sub, value[key], f"{path}.{key}")
            if problem:
                return problem
        return None
    if isinstance(pattern, list):
        if not isinstance(value, list):
            return f"{path}: expected an array, got {value!r}"
        for i, sub in enumerate(pattern):
            if all(match_value(sub, item) for item in value):
                return f"{path}: no item matches pattern [{i}] {sub!r}"
        return None
    if type(pattern) is not type(value) or pattern != value:
        return f"{path}: expected {pattern!r}, got {value!r}"
    return None


def match_events(patterns: Sequence[Mapping[str, Any]], events: Sequence[Mapping[str, Any]]) -> str | None:
    """None when the events follow the patterns, else the first mismatch.

    Each pattern stands for a run of consecutive events whose ``type`` it names (a string or a list
    of types): one or more (at most ``count`` when given, and exactly that many unless ``optional``),
    none allowed too with ``optional``; ``match``
    is checked on every event of the run. Every event must be covered, in order.
    """
    i = 0
    for n, pat in enumerate(patterns):
        types = pat["type"] if isinstance(pat["type"], list) else [pat["type"]]
        run: list[Mapping[str, Any]] = []
        while i < len(events) and events[i].get("type") in types:
            if "count" in pat and len(run) == pat["count"]:
                break
            run.append(events[i])
            i += 1
        least = 0 if pat.get("optional") else pat.get("count", 1)
        if len(run) < least:
            got = events[i].get("type") if i < len(events) else "the end"
            return f"events[{i}]: expected {' or '.join(types)} (pattern {n}), got {got}"
        for k, event in enumerate(run):
            problem = match_value(pat.get("match", {}), event, f"events[{i - len(run) + k}]")
            if problem:
                return problem
    if i < len(events):
        return f"events[{i}]: unexpected {events[i].get('type')} after the last pattern"
    return None


@dataclass
class Observed:
    """What one operation produced on the wire: every result frame for its id, in arrival order."""

    frames: list[Mapping[str, Any]] = field(default_factory=list)

    @property
    def events(self) -> list[Mapping[str, Any]]:
        return [f["event"] for f in self.frames]


def judge(recipe: Mapping[str, Any], observed: Observed, selection: ExtensionSelection) -> list[str]:
    """Every way a run broke the recipe or the profile's per-operation rules (empty: it passed)."""
    problems: list[str] = []
    seqs = [f.get("seq") for f in observed.frames]
    if seqs != list(range(len(seqs))):
        problems.append(f"seq is not 0, 1, 2, … in order: {seqs}")
    events = observed.events
    # A Responses stream numbers its own events (as over HTTP): 0, 1, 2, … in the order sent.
    numbers = [e["sequence_number"] for e in events if "sequence_number" in e]
    if numbers != list(range(len(numbers))):
        problems.append(f"sequence_number is not 0, 1, 2, … in order: {numbers}")
    terminal_at = [i for i, e in enumerate(events) if e.get("type") in TERMINAL_EVENT_TYPES]
    if not terminal_at:
        problems.append("no terminal event")
    elif len(terminal_at) > 1 or terminal_at[0] != len(events) - 1:
        problems.append(f"events after the terminal event: {[e.get('type') for e in events]}")
    for i, event in enumerate(events):
        problems += [f"events[{i}]: {p}" for p in extension_violations(event, selection)]
    base = [baseline_event(e) for e in events]
    expect = recipe["expect"]
    want = TERMINALS[expect["terminal"]]
    if base and base[-1].get("type") != want:
        problems.append(f"terminal {base[-1].get('type')} (expected {want}): {json.dumps(base[-1])[:300]}")
    if "events" in expect:
        problem = match_events(expect["events"], base)
        if problem:
            problems.append(problem)
    if expect.get("tool_calls"):
        problems += check_tool_calls(expect["tool_calls"], base)
    return problems


def assembled_tool_calls(events: Iterable[Mapping[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    """Tool calls put together as OpenAI streams are: per choice and call index, arguments joined."""
    calls: dict[tuple[int, int], dict[str, Any]] = {}
    for e in events:
        if e.get("type") != TOOL_CALL_DELTA:
            continue
        delta = e.get("tool_call") or {}
        call = calls.setdefault((int(e.get("choice_index", 0)), int(delta.get("index", 0))),
                                {"id": None, "name": None, "arguments": ""})
        fn = delta.get("function") or {}
        call["id"] = delta.get("id") or call["id"]
        call["name"] = fn.get("name") or call["name"]
        call["arguments"] += fn.get("arguments") or ""
    return calls


def check_tool_calls(expected: Sequence[Mapping[str, Any]], events: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each expected call (by ``name``) was assembled and its arguments parse as a JSON object."""
    calls = list(assembled_tool_calls(events).values())
    problems = []
    for want in expected:
        call = next((c for c in calls if c["name"] == want.get("name")), None)
        if call is None:
            problems.append(f"no tool call named {want.get('name')!r} (got {[c['name'] for c in calls]})")
            continue
        try:
            args = json.loads(call["arguments"])
        except json.JSONDecodeError:
            problems.append(f"tool call {call['name']!r}: arguments are not JSON: {call['arguments']!r}")
            continue
        if not isinstance(args, dict):
            problems.append(f"tool call {call['name']!r}: arguments are not a JSON object")
        elif want.get("arguments") is not None:
            problem = match_value(want["arguments"], args, f"tool_call[{call['name']}].arguments")
            if problem:
                problems.append(problem)
    return problems


def completed_text(event: Mapping[str, Any]) -> str:
    """The text of a non-streaming ``response.completed``: choice 0's message (chat), or the
    ``output_text`` parts of the message items (a Responses object)."""
    response = event.get("response") or {}
    if response.get("object") == "response":
        return "".join(str(part.get("text") or "") for item in response.get("output") or []
                       if item.get("type") == "message"
                       for part in item.get("content") or [] if part.get("type") == "output_text")
    return str(response["choices"][0]["message"].get("content") or "")


def delta_text(events: Iterable[Mapping[str, Any]], choice: int = 0) -> str:
    """Choice ``choice``'s streamed text (a Responses ``response.output_text.delta`` has no choice:
    it is choice 0's)."""
    return "".join(str(e.get("delta", "")) for e in events
                   if e.get("type") == "response.output_text.delta" and e.get("choice_index", 0) == choice)
