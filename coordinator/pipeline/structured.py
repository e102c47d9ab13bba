"""Structured outputs on the client side: the request fields that ask for a grammar, and their checks.

The grammar itself is built by render (vLLM's own request models turn ``response_format``,
``structured_outputs``, ``tool_choice`` required / named and ``parallel_tool_calls: false`` into
``sampling_params.structured_outputs``) and compiled by an engine that loads a tokenizer
(``engines/capabilities.py``). What stays here is what must be caught before either sees it:

* shapes vLLM's models accept but cannot honour, or would turn into an engine-side failure after a
  200 (an empty ``choice`` list, an empty grammar or regex, several constraints at once);
* the ``param`` to name when a grammar is refused (``constraint_field``, ``name_constraint``).

Everything else (unknown schema keywords, a grammar the backend rejects) is refused by render or
by the engine with a 400, which reaches the client before any byte (``engines/client.py``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from coordinator.pipeline.errors import BadRequest, PipelineError

RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")
# StructuredOutputsParams' constraint keys (vLLM 0.32 sampling_params.py): exactly one may be set.
CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
OPTION_KEYS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def check_response_format(v: Any) -> None:
    """OpenAI's ``response_format``: ``text``, ``json_object``, ``json_schema`` (a name and a schema
    object) or vLLM's ``structural_tag``."""
    if not isinstance(v, dict) or v.get("type") not in RESPONSE_FORMATS:
        raise BadRequest(f"'response_format.type' must be one of {', '.join(map(repr, RESPONSE_FORMATS))}",
                         param="response_format.type" if isinstance(v, dict) else "response_format")
    if v["type"] != "json_schema":
        return
    spec = v.get("json_schema")
    if not isinstance(spec, dict):
        raise BadRequest("'response_format.json_schema' is required when 'response_format.type' is "
                         "'json_schema'", param="response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or not set(name) <= _NAME_CHARS:
        raise BadRequest("'response_format.json_schema.name' must be 1-64 characters of a-z, A-Z, 0-9, "
                         "underscores and dashes", param="response_format.json_schema.name")
    schema = spec.get("schema")
    if schema is not None and not isinstance(schema, dict | bool):
        raise BadRequest("'response_format.json_schema.schema' must be a JSON Schema object",
                         param="response_format.json_schema.schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest("'response_format.json_schema.strict' must be a boolean",
                         param="response_format.json_schema.strict")


def check_structured_outputs(v: Any) -> None:
    """vLLM's ``structured_outputs``: one constraint, each in a form a grammar backend can take."""
    if not isinstance(v, dict):
        raise BadRequest("'structured_outputs' must be an object", param="structured_outputs")
    unknown = sorted(k for k in v if k not in CONSTRAINT_KEYS and k not in OPTION_KEYS)
    if unknown:
        raise BadRequest(f"Unsupported field 'structured_outputs.{unknown[0]}'",
                         param=f"structured_outputs.{unknown[0]}")
    given = [k for k in CONSTRAINT_KEYS if v.get(k) is not None]
    if len(given) != 1:
        raise BadRequest("'structured_outputs' must set exactly one of " + ", ".join(CONSTRAINT_KEYS)
                         + (f" (got {', '.join(given)})" if given else ""), param="structured_outputs")
    key = given[0]
    value = v[key]
    param = f"structured_outputs.{key}"
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise BadRequest(f"'{param}' must be a non-empty list of strings", param=param)
    elif key in ("regex", "grammar"):
        if not isinstance(value, str) or not value.strip() or "\x00" in value:
            raise BadRequest(f"'{param}' must be a non-empty string without NUL characters", param=param)
    elif key == "json":
        if not isinstance(value, dict | bool | str) or (isinstance(value, str) and not value.strip()):
            raise BadRequest(f"'{param}' must be a JSON Schema (an object, or its JSON text)", param=param)
    elif key == "json_object":
        if value is not True:
            raise BadRequest(f"'{param}' must be true (omit structured_outputs for free text)", param=param)
    elif not isinstance(value, str | dict):
        raise BadRequest(f"'{param}' must be an object or its JSON text", param=param)


def constraint_field(body: Mapping[str, Any]) -> str | None:
    """The client field that asks for a grammar (for an error's ``param``); None when none does."""
    if body.get("structured_outputs") is not None:
        return "structured_outputs"
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return "response_format"
    choice = body.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        return "tool_choice"
    if body.get("parallel_tool_calls") is False:
        return "parallel_tool_calls"
    return None


# How render and the engines word a grammar they cannot build: xgrammar's "Grammar error: ...",
# vLLM's "Invalid grammar specification: ...", "invalid regex", JSON-schema conversion failures.
_GRAMMAR_REFUSAL = re.compile(r"grammar|regex|json.?schema|structural.?tag|structured output", re.IGNORECASE)


def name_constraint(error: PipelineError, body: object) -> None:
    """Give a 4xx about the request's grammar the ``param`` that asked for it: vLLM refuses a bad
    schema, regex or grammar with ``param: null``, and a client deserves to know which field."""
    if error.param is None and 400 <= error.status < 500 and isinstance(body, dict) \
            and _GRAMMAR_REFUSAL.search(error.message):
        error.param = constraint_field(body)
