"""The configuration reference, docs/configuration.md, generated from the pydantic model.

A hand-kept list of keys drifts from ``coordinator/config.py`` the day someone adds a key; a page
generated from ``Settings`` cannot, and tests/unit/test_config_reference.py fails when the committed
page is stale. Each section is a model class: its docstring is the section's introduction and every
field is one table row (dotted key, readable type, default as YAML writes it, environment variable,
description). Prose that explains more than one key lives in docs/configuration.notes.md, which is
copied verbatim: its ``intro`` block at the top, every other block after the table it names.

A key without a description is an error (exit status 2, the keys listed), so the page cannot regress
to rows that say nothing.

    python -m deploy.config_reference                    # the page on stdout
    python -m deploy.config_reference --write docs/configuration.md
    python -m deploy.config_reference --check docs/configuration.md   # exit 1 when stale
    python -m deploy.config_reference --yaml             # every default, as a starting config
"""

from __future__ import annotations

import argparse
import collections.abc
import difflib
import enum
import inspect
import json
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, SecretBytes, SecretStr, TypeAdapter
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from coordinator.config import Settings

DEFAULT_NOTES = Path(__file__).resolve().parents[1] / "docs" / "configuration.notes.md"
NO_ENV = "—"
_NOTES_MARKER = re.compile(r"^<!--\s*notes:\s*(\S+)\s*-->\s*$")
_LISTS = (list, tuple, set, frozenset, collections.abc.Sequence, collections.abc.Set)
_MAPS = (dict, collections.abc.Mapping)
_BOUNDS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))
_LOWER_FIRST = {"ge": "≤", "gt": "<"}  # "1 ≤ int ≤ 65535" reads better than "int ≥ 1, ≤ 65535"


class MissingDescriptionError(ValueError):
    """Keys (or sections) the reference could only show without an explanation."""

    def __init__(self, keys: list[str]) -> None:
        super().__init__("configuration keys without a description (add description= to the field, or a "
                         "docstring to the class, in coordinator/config.py):\n"
                         + "\n".join(f"  {k}" for k in keys))
        self.keys = keys


@dataclass(frozen=True)
class Row:
    key: str
    type: str
    default: str
    env: str
    description: str


@dataclass
class Section:
    """One model class in the tree: a heading, its docstring, a table, and the sections below it."""

    path: str
    depth: int
    intro: list[str]
    rows: list[Row] = field(default_factory=list)
    children: list[Section] = field(default_factory=list)

    def walk(self) -> collections.abc.Iterator[Section]:
        yield self
        for child in self.children:
            yield from child.walk()


# --- types ----------------------------------------------------------------------------------------

def _strip_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` → (X, True); anything else → (itself, False)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return (args[0] if len(args) == 1 else Union[tuple(args)]), True  # noqa: UP007
    return tp, False


def _model(tp: Any) -> type[BaseModel] | None:
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _item_model(tp: Any) -> tuple[str, type[BaseModel]] | None:
    """The entries' model of ``list[Model]`` (key suffix ``[]``) or ``dict[str, Model]`` (``.<name>``)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in _LISTS and args and (model := _model(_strip_optional(args[0])[0])) is not None:
        return "[]", model
    if origin in _MAPS and len(args) == 2 and (model := _model(_strip_optional(args[1])[0])) is not None:
        return ".<name>", model
    return None


def _is_complex(tp: Any) -> bool:
    """Whether pydantic-settings reads the value from the environment as JSON."""
    tp = _strip_optional(tp)[0]
    return _model(tp) is not None or typing.get_origin(tp) in (*_LISTS, *_MAPS) or tp in (list, dict)


def type_name(tp: Any) -> str:
    """A readable type: ``list[str]``, ``"strict" | "compat"``, ``int | null``, ``map[str, any]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if origin is typing.Annotated:
        constraints = _constraints(args[1:])
        return f"{type_name(args[0])} {constraints}".strip()
    if origin is Literal:
        return " | ".join(json.dumps(v.value if isinstance(v, enum.Enum) else v) for v in args)
    if origin in (Union, types.UnionType):
        inner, optional = _strip_optional(tp)
        if optional:
            return f"{type_name(inner)} | null"
        return " | ".join(type_name(a) for a in args)
    if origin in _MAPS:
        return f"map[{type_name(args[0])}, {type_name(args[1])}]" if args else "map"
    if origin is tuple and args and args[-1] is not Ellipsis:
        return "[" + ", ".join(type_name(a) for a in args) + "]"
    if origin in _LISTS:
        return f"list[{type_name(args[0])}]" if args else "list"
    if isinstance(tp, type):
        if issubclass(tp, BaseModel):
            return "object"
        if issubclass(tp, SecretStr | SecretBytes):
            return "secret"
        if issubclass(tp, enum.Enum):
            return " | ".join(json.dumps(m.value) for m in tp)
        if issubclass(tp, Path):
            return "path"
        if tp in (dict, list):
            return {"dict": "map", "list": "list"}[tp.__name__]
        return tp.__name__
    return str(tp).replace("typing.", "")


def _number(value: Any) -> str:
    return json.dumps(value) if isinstance(value, int | float) else str(value)


def _constraints(metadata: collections.abc.Iterable[Any]) -> str:
    """``≥ 0``, ``> 0, ≤ 1``, ``length ≥ 1``... from annotated-types / pydantic metadata."""
    out: list[str] = []
    for m in metadata:
        found = False
        for attr, symbol in _BOUNDS:
            if getattr(m, attr, None) is not None:
                out.append(f"{symbol} {_number(getattr(m, attr))}")
                found = True
        for attr, text in (("min_length", "length ≥"), ("max_length", "length ≤"),
                           ("multiple_of", "multiple of"), ("pattern", "matching")):
            if getattr(m, attr, None) is not None:
                out.append(f"{text} {getattr(m, attr)}")
                found = True
        if not found and not callable(m):  # validators are behaviour, not a constraint worth a cell
            out.append(str(m))
    return ", ".join(out)


def field_type(info: FieldInfo) -> str:
    """The field's type with its own constraints (``Field(ge=..)``), which apply to the non-null part."""
    inner, optional = _strip_optional(info.annotation)
    base = type_name(inner)
    bounded = [m for m in info.metadata if any(getattr(m, a, None) is not None for a, _ in _BOUNDS)]
    bounds = {a: getattr(m, a) for m in bounded for a, _ in _BOUNDS if getattr(m, a, None) is not None}
    rest = _constraints(m for m in info.metadata if m not in bounded)
    lower = [a for a in bounds if a in _LOWER_FIRST]
    upper = [a for a in bounds if a not in _LOWER_FIRST]
    if len(lower) == 1 and len(upper) == 1:
        lo, hi = lower[0], upper[0]
        text = f"{_number(bounds[lo])} {_LOWER_FIRST[lo]} {base} {dict(_BOUNDS)[hi]} {_number(bounds[hi])}"
        text = f"{text}, {rest}" if rest else text
    else:
        limits = ", ".join([*(f"{dict(_BOUNDS)[a]} {_number(v)}" for a, v in bounds.items()),
                            *([rest] if rest else [])])
        text = f"{base} {limits}" if limits else base
    return f"{text} | null" if optional else text


# --- defaults -------------------------------------------------------------------------------------

def yaml_inline(value: Any) -> str:
    """One value as YAML writes it in flow style (``true``, ``null``, ``[]``, ``{a: 1}``)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=2**31 - 1, sort_keys=False,
                          allow_unicode=True).strip()
    return text.removesuffix("...").strip()


def default_value(info: FieldInfo) -> Any:
    """The field's default as plain JSON data (what a YAML file would hold)."""
    value = info.get_default(call_default_factory=True, validated_data={})
    annotation: Any = Any if info.annotation is None else info.annotation
    try:
        return TypeAdapter(annotation).dump_python(value, mode="json")
    except Exception:  # a type pydantic cannot serialise: show what it is
        return repr(value)


def _default_cell(info: FieldInfo) -> str:
    return "required" if info.is_required() else f"`{yaml_inline(default_value(info))}`"


def defaults(model: type[BaseModel]) -> dict[str, Any]:
    """Every key with its default (required keys left out), as the YAML file would hold them."""
    return {_key(name, info): default_value(info) for name, info in model.model_fields.items()
            if not info.is_required()}


# --- the walk -------------------------------------------------------------------------------------

def _key(name: str, info: FieldInfo) -> str:
    return info.alias or name


def _paragraphs(doc: str | None) -> list[str]:
    """A docstring as Markdown paragraphs (RST ````code```` becomes ```code```)."""
    text = inspect.cleandoc(doc or "").replace("``", "`")
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


class _Walker:
    def __init__(self, root: type[BaseModel]) -> None:
        cfg = root.model_config
        self.settings = isinstance(root, type) and issubclass(root, BaseSettings)
        self.prefix = str(cfg.get("env_prefix", "")) if self.settings else ""
        delimiter = cfg.get("env_nested_delimiter") if self.settings else None
        self.delimiter = str(delimiter) if delimiter else None
        self.upper = not cfg.get("case_sensitive", False)
        self.missing: list[str] = []

    def env_name(self, name: str, info: FieldInfo, parent_env: str | None) -> str | None:
        if parent_env is None and not self.settings:
            return None
        if parent_env is None:  # a root field: an alias replaces the prefixed name in pydantic-settings
            alias = info.validation_alias if isinstance(info.validation_alias, str) else info.alias
            env = alias or f"{self.prefix}{name}"
        elif self.delimiter is None:
            return None
        else:
            env = f"{parent_env}{self.delimiter}{_key(name, info)}"
        return env.upper() if self.upper else env

    def section(self, model: type[BaseModel], path: str, env: str | None, depth: int,
                extra_intro: str | None = None) -> Section:
        doc = model.__dict__.get("__doc__")
        if not doc and not extra_intro:
            self.missing.append(f"{path} (class {model.__name__} has no docstring)")
        intro = ([" ".join(extra_intro.split())] if extra_intro else []) + _paragraphs(doc)
        sec = Section(path, depth, intro)
        self.fill(sec, model, path, env)
        return sec

    def fill(self, sec: Section, model: type[BaseModel], path: str, env: str | None) -> None:
        """The rows of ``model``'s fields into ``sec``; nested models become child sections."""
        for name, info in model.model_fields.items():
            key = f"{path}.{_key(name, info)}" if path else _key(name, info)
            field_env = self.env_name(name, info, env) if env is not None else None
            inner = _strip_optional(info.annotation)[0]
            nested = _model(inner)
            if nested is not None and inner is info.annotation:
                sec.children.append(self.section(nested, key, field_env, sec.depth + 1, info.description))
                continue
            self.row(sec, key, info, field_env)
            item = _item_model(inner)
            if item is not None:
                sec.children.append(self.section(item[1], f"{key}{item[0]}", None, sec.depth + 1))
            elif nested is not None:  # an optional object: its row above, its keys below
                sec.children.append(self.section(nested, key, None, sec.depth + 1))

    def row(self, sec: Section, key: str, info: FieldInfo, env: str | None) -> None:
        if not (info.description or "").strip():
            self.missing.append(key)
        env_cell = NO_ENV if env is None else f"`{env}`" + (" (JSON)" if _is_complex(info.annotation) else "")
        sec.rows.append(Row(key, field_type(info), _default_cell(info), env_cell, info.description or ""))


def build_sections(root: type[BaseModel] = Settings) -> list[Section]:
    """The top-level sections: one per model (or list of models) under the root, root scalars first.

    Raises ``MissingDescriptionError`` when a key has no description or a section no docstring."""
    walker = _Walker(root)
    top = Section("", 2, [])
    sections: list[Section] = []
    for name, info in root.model_fields.items():
        key, env = _key(name, info), walker.env_name(name, info, None)
        inner = _strip_optional(info.annotation)[0]
        nested, item = _model(inner), _item_model(inner)
        if nested is not None and inner is info.annotation:
            sections.append(walker.section(nested, key, env, 2, info.description))
        elif item is not None:  # a list section: the list's own row, then its entries' keys
            (suffix, entry), doc = item, item[1].__dict__.get("__doc__")
            if not doc:
                walker.missing.append(f"{key}{suffix} (class {entry.__name__} has no docstring)")
            sec = Section(key, 2, _paragraphs(doc))
            walker.row(sec, key, info, env)
            walker.fill(sec, entry, f"{key}{suffix}", None)
            sections.append(sec)
        else:
            walker.row(top, key, info, env)
            if nested is not None:  # an optional object at the top: its row, then its keys
                top.children.append(walker.section(nested, key, None, 3))
    if walker.missing:
        raise MissingDescriptionError(walker.missing)
    return ([top] if top.rows else []) + sections


# --- the page -------------------------------------------------------------------------------------

def parse_notes(text: str) -> dict[str, str]:
    """``<!-- notes: NAME -->`` blocks of the hand-written notes file (text before the first is a preface)."""
    blocks: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        marker = _NOTES_MARKER.match(line)
        if marker:
            if marker.group(1) in blocks:
                raise ValueError(f"notes block {marker.group(1)!r} appears twice")
            current = blocks[marker.group(1)] = []
        elif current is not None:
            current.append(line)
    return {name: "\n".join(lines).strip("\n") for name, lines in blocks.items()}


def _table(rows: list[Row]) -> list[str]:
    out = ["| key | type | default | environment | description |", "|---|---|---|---|---|"]
    out += [f"| `{r.key}` | `{_cell(r.type)}` | {_cell(r.default)} | {r.env} | {_cell(r.description)} |"
            for r in rows]
    return out


def render(root: type[BaseModel] = Settings, notes: dict[str, str] | None = None) -> str:
    """The whole page. Same model and notes → the same bytes."""
    notes = dict(notes or {})
    sections = build_sections(root)
    known = {"intro"} | {s.path or "top" for sec in sections for s in sec.walk()}
    unknown = sorted(set(notes) - known)
    if unknown:
        raise ValueError(f"notes blocks name no section: {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(known))})")
    out = [
        "# Configuration", "",
        "<!-- Generated from coordinator/config.py and docs/configuration.notes.md by `make config-doc`;",
        "     edit those, not this file (tests/unit/test_config_reference.py fails when it is stale).",
        "-->", "",
    ]
    if notes.get("intro"):
        out += [notes["intro"], ""]
    out += ["## Keys by section", "",
            " · ".join(f"[{s.path}](#{s.path})" for s in sections if s.path)
            + " · [all defaults as YAML](#all-defaults-as-yaml)", ""]
    for top in sections:
        for sec in top.walk():
            out += ["#" * min(sec.depth, 4) + " " + (sec.path or "Top-level keys"), ""]
            for paragraph in sec.intro:
                out += [paragraph, ""]
            if sec.rows:
                out += [*_table(sec.rows), ""]
            if notes.get(sec.path or "top"):
                out += [notes[sec.path or "top"], ""]
    out += [
        "## All defaults as YAML", "",
        "Every key with its default value, generated from the model (`python -m deploy.config_reference "
        "--yaml` prints it). A config file needs only the keys it changes.", "",
        "```yaml", default_yaml(root).rstrip("\n"), "```", "",
    ]
    return "\n".join(out)


def default_yaml(root: type[BaseModel] = Settings) -> str:
    return yaml.safe_dump(defaults(root), sort_keys=False, default_flow_style=False, width=100,
                          allow_unicode=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.config_reference", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", metavar="PATH", help="write the page to PATH")
    mode.add_argument("--check", metavar="PATH", help="exit 1 when PATH differs from the generated page")
    mode.add_argument("--yaml", action="store_true", help="print every default as a YAML config file")
    parser.add_argument("--notes", metavar="PATH", type=Path, default=DEFAULT_NOTES,
                        help="hand-written blocks for the page (default: docs/configuration.notes.md)")
    args = parser.parse_args(argv)
    if args.yaml:
        sys.stdout.write(default_yaml())
        return 0
    try:
        page = render(Settings, parse_notes(args.notes.read_text(encoding="utf-8")))
    except MissingDescriptionError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.write:
        Path(args.write).write_text(page, encoding="utf-8")
    elif args.check:
        current = Path(args.check).read_text(encoding="utf-8") if Path(args.check).exists() else ""
        if current != page:
            diff = difflib.unified_diff(current.splitlines(), page.splitlines(), args.check, "generated",
                                        lineterm="", n=1)
            print("\n".join(list(diff)[:60]), file=sys.stderr)
            print(f"{args.check} is stale: run `make config-doc`", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
