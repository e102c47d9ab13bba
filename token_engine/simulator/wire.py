"""Structural fingerprints of wire objects, for comparing a real engine's replies with the simulator's.

Why: values (token ids, timestamps, logprobs) legitimately differ between a real vLLM engine and the
simulator, but the *shape* must not: the same keys in the same order, the same JSON types, and null in the
same places. `wire_shape` reduces a decoded JSON value to that shape (comparable with `==`, order-sensitive);
`wire_diff` lists the differences with JSON paths; `sse_payloads` splits an SSE body into its `data:` payloads
while checking vLLM's exact `data: <payload>\\n\\n` framing.
"""

from __future__ import annotations

import json
from typing import Any, TypeAlias

Shape: TypeAlias = "str | tuple[tuple[str, Shape], ...] | list[Shape]"
"""A scalar type name ("null", "bool", "int", "float", "str"), an object as ordered (key, shape) pairs, or a
list as the distinct shapes of its elements in order of first appearance ([] for an empty list)."""


def wire_shape(obj: Any) -> Shape:
    """The shape of a decoded JSON value; bytes, or a str starting with `{`/`[`, are parsed as JSON first."""
    if isinstance(obj, bytes | bytearray):
        obj = json.loads(obj)
    elif isinstance(obj, str) and obj[:1] in ("{", "["):
        obj = json.loads(obj)
    return _shape(obj)


def _shape(obj: Any) -> Shape:
    if obj is None:
        return "null"
    if isinstance(obj, bool):
        return "bool"
    if isinstance(obj, int):
        return "int"
    if isinstance(obj, float):
        return "float"
    if isinstance(obj, str):
        return "str"
    if isinstance(obj, dict):
        return tuple((str(k), _shape(v)) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        distinct: list[Shape] = []
        for item in obj:
            s = _shape(item)
            if s not in distinct:
                distinct.append(s)
        return distinct
    raise TypeError(f"not a JSON value: {type(obj).__name__}")


def wire_diff(
    expected: Any,
    actual: Any,
    *,
    path: str = "$",
    empty_list_matches: bool = True,
    numbers_match: bool = False,
) -> list[str]:
    """Human-readable differences between two decoded JSON values' shapes (empty list = same shape).

    `empty_list_matches`: an empty list is compatible with any list (a choice may legitimately have no
    tokens). `numbers_match`: treat int and float alike (JSON writers differ on `1` vs `1.0`).
    """
    return _diff(_shape(expected), _shape(actual), path, empty_list_matches, numbers_match)


def _kind(s: Shape) -> str:
    if isinstance(s, tuple):
        return "object"
    if isinstance(s, list):
        return "list"
    return s


def _diff(exp: Shape, act: Shape, path: str, empty_ok: bool, numbers_match: bool) -> list[str]:
    if exp == act:
        return []
    ek, ak = _kind(exp), _kind(act)
    if numbers_match and {ek, ak} <= {"int", "float"}:
        return []
    if ek != ak:
        return [f"{path}: expected {ek}, got {ak}"]
    if isinstance(exp, tuple) and isinstance(act, tuple):
        out: list[str] = []
        ekeys, akeys = [k for k, _ in exp], [k for k, _ in act]
        missing = [k for k in ekeys if k not in akeys]
        extra = [k for k in akeys if k not in ekeys]
        if missing:
            out.append(f"{path}: missing keys {missing}")
        if extra:
            out.append(f"{path}: unexpected keys {extra}")
        common_e = [k for k in ekeys if k in akeys]
        common_a = [k for k in akeys if k in ekeys]
        if common_e != common_a:
            out.append(f"{path}: key order {common_a}, expected {common_e}")
        amap = dict(act)
        for k, es in exp:
            if k in amap:
                out.extend(_diff(es, amap[k], f"{path}.{k}", empty_ok, numbers_match))
        return out
    if isinstance(exp, list) and isinstance(act, list):
        if empty_ok and (not exp or not act):
            return []
        out = []
        for i, es in enumerate(exp):
            if not any(not _diff(es, a, path, empty_ok, numbers_match) for a in act):
                out.append(f"{path}[*]: no element shaped like expected element #{i}")
                if len(act) == 1:
                    out.extend(_diff(es, act[0], f"{path}[0]", empty_ok, numbers_match))
        for i, a in enumerate(act):
            if not any(not _diff(es, a, path, empty_ok, numbers_match) for es in exp):
                out.append(f"{path}[*]: unexpected element shape #{i}")
        return out
    return [f"{path}: expected {exp}, got {act}"]


def sse_payloads(body: str | bytes) -> list[str]:
    """The `data:` payloads of an SSE body; vLLM's framing (`data: <payload>\\n\\n` only) is enforced."""
    text = body.decode("utf-8") if isinstance(body, bytes | bytearray) else body
    if not text.endswith("\n\n"):
        raise ValueError("SSE body does not end with a blank line")
    payloads: list[str] = []
    for event in text[:-2].split("\n\n"):
        if not event.startswith("data: ") or "\n" in event:
            raise ValueError(f"unexpected SSE event framing: {event[:80]!r}")
        payloads.append(event[len("data: ") :])
    return payloads


def stream_shapes(body: str | bytes) -> list[Shape]:
    """`wire_shape` of every SSE payload; `[DONE]` maps to the string "[DONE]"."""
    return ["[DONE]" if p == "[DONE]" else wire_shape(json.loads(p)) for p in sse_payloads(body)]
