"""The openai-compatible/1 profile (docs/nnrp.md): envelope, event mapping, manifest, extension rules."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from coordinator.nnrp import profile as p

ROOT = Path(__file__).resolve().parents[2]
DIAG = p.Extension("llm-coordinator.diagnostics", critical=False)
STRICT = p.Extension("acme.strict-json", critical=True)


def manifest(tool_calls: bool = True, **kw: Any) -> p.Manifest:
    kw.setdefault("extensions", (DIAG, STRICT))
    return p.build_manifest(p.ServingCapabilities(tool_calls=tool_calls, **kw))


def envelope(**over: Any) -> dict[str, Any]:
    env: dict[str, Any] = {"schema_version": "openai-compatible/1", "operation": "chat.completions.create",
                           "body": {"model": "m", "messages": [{"role": "user", "content": "Say hello."}],
                                    "stream": True}}
    env.update(over)
    return env


def refused(env: Any, m: p.Manifest | None = None) -> p.ProfileError:
    with pytest.raises(p.ProfileError) as info:
        p.parse_envelope(env, m or manifest())
    return info.value


# --- chunks exactly as the coordinator's SSE path writes them (docs/openai-api.md, "Wire shape") ---

def role_chunk(index: int = 0) -> dict[str, Any]:
    return {"id": "chatcmpl-r1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}], "prompt_token_ids": None, "prompt_text": None}


def content_chunk(text: str, index: int = 0, finish: str | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "delta": {"content": text}, "logprobs": None,
                              "finish_reason": finish, "token_ids": None}
    if finish is not None:
        choice["stop_reason"] = None
    return {"id": "chatcmpl-r1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}


def usage_chunk() -> dict[str, Any]:
    return {"id": "chatcmpl-r1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            "system_fingerprint": "coordinator-0a1b2c3d"}


def tool_chunk(call: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-r1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"content": None, "tool_calls": [call]}, "logprobs": None,
                         "finish_reason": finish, "token_ids": None}]}


def run(chunks: list[dict[str, Any]], **kw: Any) -> list[dict[str, Any]]:
    mapper = p.ChatStreamMapper(**kw)
    events: list[Any] = [e for c in chunks for e in mapper.map_chunk(c)]
    end = mapper.complete()
    if end is not None:
        events.append(end)
    return events


# ------------------------------------------------------------------------------------------------
# constants
# ------------------------------------------------------------------------------------------------

def test_profile_constants() -> None:
    assert p.SCHEMA_VERSION == "openai-compatible/1" and p.PROFILE == "openai-compatible"
    assert p.LEVEL_1_OPERATIONS == {"chat.completions.create"}
    assert p.SERVABLE_OPERATIONS == {"chat.completions.create", "responses.create", "models.list"}
    assert p.KNOWN_UNSUPPORTED_OPERATIONS == {"embeddings.create"}
    assert {p.OPERATION_LEVELS[op] for op in ("responses.create", "models.list")} == {2, 3}
    assert "completions.create" not in p.OPERATION_LEVELS  # not part of the profile at all
    assert p.EVENT_TYPES == ("response.output_text.delta", "response.tool_call.delta", "response.usage",
                             "response.completed", "response.error", "response.cancelled")
    assert p.TERMINAL_EVENT_TYPES == {"response.completed", "response.error", "response.cancelled"}
    assert p.UNSUPPORTED_OPERATION in p.ERROR_CODES
    with pytest.raises(TypeError):
        p.OPERATION_LEVELS["completions.create"] = 1  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        manifest().adapter = "x"  # type: ignore[misc]


def test_profile_module_is_pure() -> None:
    """No framework, no engine, no pydantic: the profile runs (and is benchmarked) anywhere."""
    code = "import coordinator.nnrp.profile, sys; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    heavy = {m for m in out.stdout.split()
             if m.split(".")[0] in ("vllm", "torch", "fastapi", "starlette", "pydantic", "httpx")}
    assert not heavy


# ------------------------------------------------------------------------------------------------
# envelope
# ------------------------------------------------------------------------------------------------

def test_minimal_envelope_is_accepted_with_defaults() -> None:
    env = envelope()
    got = p.parse_envelope(env, manifest())
    assert got.operation == "chat.completions.create" and got.stream is True
    assert got.body is env["body"]  # handed on to the pipeline as is
    assert got.policy == p.Policy(timeout_ms=None, diagnostics="none", cache="default", transport="inline")
    assert got.include_openai_chunk is False
    assert got.extensions.selected == frozenset()


def test_full_envelope() -> None:
    env = envelope(profile="openai-compatible", include_openai_chunk=True,
                   policy={"timeout_ms": 30000, "diagnostics": "summary", "cache": "isolated", "transport": "inline"},
                   extensions=["acme.strict-json"])
    env["body"]["stream"] = False
    got = p.parse_envelope(env, manifest())
    assert got.stream is False and got.include_openai_chunk
    assert got.policy == p.Policy(30000, "summary", "isolated", "inline")
    assert got.extensions.selected == {"acme.strict-json"}


def test_stream_absent_or_null_is_non_streaming() -> None:
    env = envelope()
    del env["body"]["stream"]
    assert p.parse_envelope(env, manifest()).stream is False
    env["body"]["stream"] = None
    assert p.parse_envelope(env, manifest()).stream is False


def test_refusal_carries_the_openai_error_body() -> None:
    err = refused(envelope(operation="responses.create"))
    assert err.body() == {"error": {"message": "'responses.create' (Level 2) is not supported by this server",
                                    "type": "BadRequestError", "param": "operation",
                                    "code": "unsupported_operation"}}
    assert err.event() == {"type": "response.error", "status": 400, "error": err.body()["error"]}


@pytest.mark.parametrize(("env", "code", "param"), [
    ([1, 2], "invalid_envelope", None),
    ("{}", "invalid_envelope", None),
    (envelope(timeout_ms=5), "invalid_envelope", "timeout_ms"),  # policy goes under "policy"
    (envelope(profile="anthropic-compatible"), "unsupported_schema_version", "profile"),
    ({k: v for k, v in envelope().items() if k != "schema_version"}, "invalid_envelope", "schema_version"),
    (envelope(schema_version="openai-compatible/2"), "unsupported_schema_version", "schema_version"),
    ({k: v for k, v in envelope().items() if k != "operation"}, "invalid_envelope", "operation"),
    (envelope(operation=7), "invalid_envelope", "operation"),
    (envelope(operation="embeddings.create"), "unsupported_operation", "operation"),
    (envelope(operation="models.list"), "unsupported_operation", "operation"),
    (envelope(operation="completions.create"), "unsupported_operation", "operation"),
    (envelope(operation="chat.completions.delete"), "unsupported_operation", "operation"),
    (envelope(body=None), "invalid_body", "body"),
    (envelope(body=[{"role": "user"}]), "invalid_body", "body"),
    (envelope(body={"model": "m", "messages": [], "stream": "yes"}), "invalid_body", "body.stream"),
    (envelope(policy=[]), "invalid_envelope", "policy"),
    (envelope(policy={"timeout_ms": 0}), "invalid_envelope", "policy.timeout_ms"),
    (envelope(policy={"timeout_ms": 1.5}), "invalid_envelope", "policy.timeout_ms"),
    (envelope(policy={"timeout_ms": True}), "invalid_envelope", "policy.timeout_ms"),
    (envelope(policy={"timeout_ms": p.MAX_TIMEOUT_MS + 1}), "invalid_envelope", "policy.timeout_ms"),
    (envelope(policy={"diagnostics": "loud"}), "invalid_envelope", "policy.diagnostics"),
    (envelope(policy={"cache": "off"}), "invalid_envelope", "policy.cache"),
    (envelope(policy={"transport": "shm"}), "invalid_envelope", "policy.transport"),
    (envelope(policy={"retries": 2}), "invalid_envelope", "policy.retries"),
    (envelope(extensions="acme.strict-json"), "invalid_envelope", "extensions"),
    (envelope(extensions=[3]), "invalid_envelope", "extensions[0]"),
    (envelope(extensions=["acme.strict-json", "acme.strict-json"]), "invalid_envelope", "extensions[1]"),
    (envelope(extensions=["llm-coordinator.diagnostics", "acme.undeclared"]), "unsupported_extension", "extensions[1]"),
    (envelope(include_openai_chunk="yes"), "invalid_envelope", "include_openai_chunk"),
])
def test_envelope_refusals(env: Any, code: str, param: str | None) -> None:
    err = refused(env)
    assert (err.code, err.param, err.status, err.type) == (code, param, 400, "BadRequestError")
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("key", sorted(p.BODY_RESERVED_FIELDS))
def test_nnrp_policy_inside_the_openai_body_is_refused(key: str) -> None:
    env = envelope()
    env["body"][key] = 1000
    err = refused(env)
    assert (err.code, err.param) == ("policy_in_body", f"body.{key}")
    assert "envelope" in err.message


def test_openai_and_vllm_fields_in_the_body_are_the_pipelines_business() -> None:
    """The profile does not second-guess the body: the serving path validates it as the HTTP door does."""
    env = envelope()
    env["body"].update(temperature=7, top_k=5, cache_salt="s", metadata={"a": "b"}, tools=[{"type": "function"}])
    assert p.parse_envelope(env, manifest()).body["temperature"] == 7


def test_mode_not_served_is_unsupported_operation() -> None:
    only_stream = manifest(non_streaming=False)
    env = envelope()
    env["body"]["stream"] = False
    err = refused(env, only_stream)
    assert (err.code, err.param) == ("unsupported_operation", "body.stream")
    only_batch = manifest(streaming=False)
    err = refused(envelope(), only_batch)
    assert (err.code, err.param) == ("unsupported_operation", "body.stream")


# ------------------------------------------------------------------------------------------------
# streaming events
# ------------------------------------------------------------------------------------------------

def test_text_stream_events_in_order() -> None:
    chunks = [role_chunk(), content_chunk("Hel"), content_chunk("lo"), content_chunk("", finish="stop"), usage_chunk()]
    events = run(chunks)
    assert events == [
        {"type": "response.output_text.delta", "choice_index": 0, "delta": "Hel"},
        {"type": "response.output_text.delta", "choice_index": 0, "delta": "lo"},
        {"type": "response.usage", "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}},
        {"type": "response.completed", "id": "chatcmpl-r1", "model": "m", "finish_reason": "stop",
         "choices": [{"index": 0, "finish_reason": "stop"}]},
    ]
    json.dumps(events)  # JSON-ready as built


def test_stream_without_usage_chunk() -> None:
    events = run([role_chunk(), content_chunk("Hi", finish="length")])
    assert [e["type"] for e in events] == ["response.output_text.delta", "response.completed"]
    assert events[-1]["finish_reason"] == "length"


def test_openai_chunk_rides_on_the_first_event_of_its_chunk() -> None:
    chunks = [role_chunk(), content_chunk("Hi"), content_chunk("", finish="stop"), usage_chunk()]
    events = run(copy.deepcopy(chunks), include_openai_chunk=True)
    assert [e.get("openai_chunk") for e in events] == [chunks[1], chunks[3], None]
    assert p.baseline_event(events[0]) == {"type": "response.output_text.delta", "choice_index": 0, "delta": "Hi"}
    assert all("openai_chunk" not in e for e in run(chunks))


def test_tool_call_deltas_pass_through() -> None:
    first = {"index": 0, "id": "chatcmpl-tool-1", "type": "function",
             "function": {"name": "get_weather", "arguments": ""}}
    more = {"index": 0, "function": {"arguments": "{\"city\": \"Paris\"}"}}
    chunks = [role_chunk(), tool_chunk(first), tool_chunk(more), tool_chunk({"index": 0, "function": {"arguments": ""}},
                                                                            finish="tool_calls")]
    events = run(chunks)
    assert events[:3] == [{"type": "response.tool_call.delta", "choice_index": 0, "tool_call": call}
                          for call in (first, more, {"index": 0, "function": {"arguments": ""}})]
    assert events[3]["finish_reason"] == "tool_calls"
    assert len(events) == 4  # ``content: null`` next to tool calls gives no text event


def test_text_and_several_tool_calls_in_one_chunk() -> None:
    calls = [{"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"index": 1, "id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    chunk = tool_chunk(calls[0])
    chunk["choices"][0]["delta"] = {"content": "Let me check.", "tool_calls": calls}
    events = p.ChatStreamMapper(include_openai_chunk=True).map_chunk(chunk)
    assert [e["type"] for e in events] == ["response.output_text.delta", "response.tool_call.delta",
                                          "response.tool_call.delta"]
    assert [e.get("tool_call") for e in events[1:]] == calls
    assert "openai_chunk" in events[0] and "openai_chunk" not in events[1]


def test_two_choices_interleaved() -> None:
    chunks = [role_chunk(0), role_chunk(1), content_chunk("A", 0), content_chunk("B", 1),
              content_chunk("a", 0, finish="stop"), content_chunk("b", 1, finish="length"), usage_chunk()]
    events = run(chunks)
    deltas = [(e["choice_index"], e["delta"]) for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == [(0, "A"), (1, "B"), (0, "a"), (1, "b")]
    assert events[-2]["type"] == "response.usage"
    assert events[-1]["choices"] == [{"index": 0, "finish_reason": "stop"}, {"index": 1, "finish_reason": "length"}]
    assert events[-1]["finish_reason"] == "stop"


def test_choice_finishing_first_out_of_index_order() -> None:
    chunks = [content_chunk("x", 1, finish="stop"), content_chunk("y", 0, finish="length")]
    assert run(chunks)[-1]["choices"] == [{"index": 0, "finish_reason": "length"}, {"index": 1, "finish_reason": "stop"}]


def test_continuous_usage_on_content_chunks_is_not_a_usage_event() -> None:
    """``response.usage`` is the summary; per-chunk usage stays in ``openai_chunk``."""
    chunk = content_chunk("Hi")
    chunk["usage"] = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    assert [e["type"] for e in run([chunk, usage_chunk()])] == ["response.output_text.delta", "response.usage",
                                                                "response.completed"]


def test_error_chunk_ends_the_operation() -> None:
    """After the first byte the SSE path sends ``{"error": …}``; NNRP gets ``response.error``, then nothing."""
    mapper = p.ChatStreamMapper()
    assert mapper.map_chunk(content_chunk("Hi"))
    err = {"error": {"message": "engine failed", "type": "BadGatewayError", "param": None, "code": 502}}
    assert mapper.map_chunk(err) == [{"type": "response.error", "status": 502, "error": err["error"]}]
    assert mapper.terminated
    assert mapper.map_chunk(content_chunk("late")) == []
    assert mapper.complete() is None and mapper.cancel("client", "stop") is None


def test_error_event_from_a_pipeline_error_body() -> None:
    detail = {"message": "no healthy engine", "type": "ServiceUnavailableError", "param": None, "code": 503}
    assert p.error_event(detail) == {"type": "response.error", "status": 503, "error": detail}
    odd = p.error_event({"message": "boom", "code": "engine_down", "param": 3})
    assert odd == {"type": "response.error", "status": 500,
                   "error": {"message": "boom", "type": "InternalServerError", "param": None, "code": "engine_down"}}
    assert p.error_event({"message": "x", "code": True}, status=502)["error"]["code"] is None
    mapper = p.ChatStreamMapper()
    assert mapper.fail(detail) == {"type": "response.error", "status": 503, "error": detail}
    assert mapper.fail(detail) is None


def test_cancelled_event_and_nothing_after_it() -> None:
    mapper = p.ChatStreamMapper()
    mapper.map_chunk(content_chunk("Hel"))
    cancelled = mapper.cancel("client", "user pressed stop", operation_id="op-7", engine_abort_accepted=None)
    assert cancelled == {"type": "response.cancelled",
                         "diagnostics": {"source": "client", "reason": "user pressed stop", "operation_id": "op-7",
                                         "engine_abort_accepted": None}}
    assert mapper.map_chunk(content_chunk("lo")) == []
    assert mapper.complete() is None
    assert mapper.cancel("timeout", "again") is None


@pytest.mark.parametrize("source", p.CANCEL_SOURCES)
def test_cancel_sources(source: str) -> None:
    event = p.cancelled_event(source, "r", operation_id="o", engine_abort_accepted=True)
    assert event["diagnostics"]["source"] == source and event["diagnostics"]["engine_abort_accepted"] is True


def test_unknown_cancel_source_is_a_programming_error() -> None:
    mapper = p.ChatStreamMapper()
    with pytest.raises(ValueError):
        mapper.cancel("gremlins", "r")
    assert not mapper.terminated


def test_completed_after_cancel_race() -> None:
    """The stream ended first: the late cancel gives no event (exactly one terminal per operation)."""
    mapper = p.ChatStreamMapper()
    mapper.map_chunk(content_chunk("x", finish="stop"))
    assert mapper.complete() is not None
    assert mapper.cancel("client", "too late") is None


# ------------------------------------------------------------------------------------------------
# non-streaming
# ------------------------------------------------------------------------------------------------

def chat_completion(n: int = 1) -> dict[str, Any]:
    return {"id": "chatcmpl-r2", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": i, "message": {"role": "assistant", "content": f"answer {i}", "tool_calls": []},
                         "logprobs": None, "finish_reason": "stop" if i == 0 else "length", "stop_reason": None}
                        for i in range(n)],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                      "prompt_tokens_details": None}, "system_fingerprint": "coordinator-0a1b2c3d"}


def test_non_streaming_result() -> None:
    body = chat_completion(n=2)
    events = p.map_chat_completion(body)
    assert events == [
        {"type": "response.usage", "usage": body["usage"]},
        {"type": "response.completed", "id": "chatcmpl-r2", "model": "m", "finish_reason": "stop",
         "choices": [{"index": 0, "finish_reason": "stop"}, {"index": 1, "finish_reason": "length"}],
         "response": body},
    ]


def test_non_streaming_error_body() -> None:
    body = {"error": {"message": "bad", "type": "BadRequestError", "param": "max_tokens", "code": 400}}
    assert p.map_chat_completion(body) == [{"type": "response.error", "status": 400, "error": body["error"]}]


# ------------------------------------------------------------------------------------------------
# capability manifest
# ------------------------------------------------------------------------------------------------

def test_manifest_with_tool_parser() -> None:
    m = p.build_manifest(p.ServingCapabilities(tool_calls=True, extensions=(DIAG,)))
    assert m.to_dict() == {
        "adapter": "llm-coordinator", "profile": "openai-compatible", "schema_version": "openai-compatible/1",
        "compatibility_levels": [1],
        "operations": [{"name": "chat.completions.create", "streaming": True, "non_streaming": True,
                        "tool_calls": True}],
        "extensions": [{"name": "llm-coordinator.diagnostics", "critical": False}],
    }


def test_manifest_without_tool_parser_or_extensions() -> None:
    doc = p.build_manifest(p.ServingCapabilities()).to_dict()
    assert doc["operations"][0]["tool_calls"] is False
    assert doc["extensions"] == []
    assert doc["compatibility_levels"] == [1]


def test_level_1_is_not_claimed_without_both_modes() -> None:
    doc = p.build_manifest(p.ServingCapabilities(non_streaming=False)).to_dict()
    assert doc["compatibility_levels"] == []
    p.parse_manifest(doc)  # still a valid document


def test_manifest_of_the_server_lists_responses_and_models_list() -> None:
    """What the coordinator declares with its Responses conversion and model catalog wired."""
    m = p.build_manifest(p.ServingCapabilities(tool_calls=True, responses=True, models_list=True))
    assert m.to_dict() == {
        "adapter": "llm-coordinator", "profile": "openai-compatible", "schema_version": "openai-compatible/1",
        "compatibility_levels": [1, 2, 3],
        "operations": [
            {"name": "chat.completions.create", "streaming": True, "non_streaming": True, "tool_calls": True},
            {"name": "responses.create", "streaming": True, "non_streaming": True, "tool_calls": True},
            {"name": "models.list", "streaming": False, "non_streaming": True, "tool_calls": False}],
        "extensions": [],
    }
    assert p.parse_manifest(m.to_dict()) == m  # a valid capability document (case 10's rules)
    without_parser = p.build_manifest(p.ServingCapabilities(responses=True))
    assert without_parser.operation("responses.create") == p.OperationCapability(
        "responses.create", streaming=True, non_streaming=True, tool_calls=False)
    assert without_parser.operation("models.list") is None
    assert without_parser.compatibility_levels == (1, 2)


def test_levels_2_and_3_follow_what_is_served() -> None:
    stream_only = p.build_manifest(p.ServingCapabilities(non_streaming=False, responses=True, models_list=True))
    assert stream_only.compatibility_levels == ()  # responses one way only; models.list has no stream
    assert stream_only.operation("models.list") is None
    assert stream_only.operation("responses.create") is not None
    models_only = p.build_manifest(p.ServingCapabilities(models_list=True))
    assert models_only.compatibility_levels == (1, 3)
    assert p.parse_manifest(models_only.to_dict()) == models_only


def test_duplicate_extension_in_config() -> None:
    with pytest.raises(ValueError):
        p.build_manifest(p.ServingCapabilities(extensions=(DIAG, DIAG)))


@pytest.mark.parametrize("name", ["diagnostics", "Acme.X", ".x", "acme.", "acme..x", "acme x.y", ""])
def test_extension_names_are_namespaced(name: str) -> None:
    with pytest.raises(ValueError):
        p.Extension(name)


def test_manifest_round_trip() -> None:
    m = manifest()
    assert p.parse_manifest(json.loads(json.dumps(m.to_dict()))) == m
    doc = m.to_dict()
    doc["vendor_note"] = "later revisions may add members"
    assert p.parse_manifest(doc) == m


def bad(path: str, value: Any) -> dict[str, Any]:
    doc = manifest().to_dict()
    target: Any = doc
    *parents, last = path.split(".")
    for part in parents:
        target = target[int(part)] if part.isdigit() else target[part]
    if value is ...:
        del target[last]
    else:
        target[last] = value
    return doc


@pytest.mark.parametrize(("doc", "where"), [
    ([], "$"),
    (bad("adapter", ...), "adapter"),
    (bad("adapter", ""), "adapter"),
    (bad("profile", "openai"), "profile"),
    (bad("schema_version", "openai-compatible/2"), "schema_version"),
    (bad("compatibility_levels", [1, 1]), "compatibility_levels"),
    (bad("compatibility_levels", [4]), "compatibility_levels"),
    (bad("compatibility_levels", [1, 2]), "compatibility_levels"),  # Level 2 without responses.create
    (bad("compatibility_levels", "1"), "compatibility_levels"),
    (bad("operations", {}), "operations"),
    (bad("operations.0.tool_calls", ...), "operations[0].tool_calls"),
    (bad("operations.0.streaming", "yes"), "operations[0].streaming"),
    (bad("operations.0.name", "completions.create"), "operations[0].name"),
    (bad("operations.0.non_streaming", False), "compatibility_levels"),  # Level 1 claimed, not backed
    (bad("extensions", None), "extensions"),
    (bad("extensions.0.critical", "no"), "extensions[0].critical"),
    (bad("extensions.0.name", "diagnostics"), "extensions[0].name"),
    (bad("extensions.1.name", "llm-coordinator.diagnostics"), "extensions[1].name"),
])
def test_manifest_validation(doc: Any, where: str) -> None:
    with pytest.raises(p.ManifestError) as info:
        p.parse_manifest(doc)
    assert info.value.path == where


def test_manifest_duplicate_operation() -> None:
    doc = manifest().to_dict()
    doc["operations"].append(dict(doc["operations"][0]))
    with pytest.raises(p.ManifestError) as info:
        p.parse_manifest(doc)
    assert info.value.path == "operations[1].name"


def test_responses_and_models_list_envelopes() -> None:
    served = p.build_manifest(p.ServingCapabilities(responses=True, models_list=True))
    body = {"model": "m", "input": "Say hello.", "max_output_tokens": 16, "stream": True}
    got = p.parse_envelope(envelope(operation="responses.create", body=body), served)
    assert got.operation == "responses.create" and got.stream is True and got.body is body
    listing = p.parse_envelope(envelope(operation="models.list", body={}), served)
    assert listing.operation == "models.list" and listing.stream is False
    assert p.parse_envelope(envelope(operation="models.list", body={"stream": False}), served).stream is False


@pytest.mark.parametrize(("body", "code", "param"), [
    ({"stream": True}, "unsupported_operation", "body.stream"),  # a list is never streamed
    ({"limit": 5}, "invalid_body", "body.limit"),  # OpenAI's list takes no parameters
    ({"after": "m", "order": "asc"}, "invalid_body", "body.after"),  # the first in sorted order
    ({"timeout_ms": 5, "limit": 5}, "policy_in_body", "body.timeout_ms"),  # policy is checked first
    ([], "invalid_body", "body"),
])
def test_models_list_body_refusals(body: Any, code: str, param: str) -> None:
    served = p.build_manifest(p.ServingCapabilities(models_list=True))
    err = refused(envelope(operation="models.list", body=body), served)
    assert (err.code, err.param, err.status) == (code, param, 400)


def test_manifest_unsupported_operations_are_refused_by_parse_envelope() -> None:
    """An operation is served only when the manifest declares it, whatever the profile knows."""
    level2 = p.Manifest(adapter="x", compatibility_levels=(1, 2), operations=(
        p.OperationCapability("chat.completions.create", True, True, False),
        p.OperationCapability("responses.create", True, True, False)))
    assert p.parse_envelope(envelope(operation="responses.create"), level2).operation == "responses.create"
    assert refused(envelope(operation="responses.create")).code == "unsupported_operation"


# ------------------------------------------------------------------------------------------------
# §10.3 extension rules
# ------------------------------------------------------------------------------------------------

def test_non_critical_extensions_apply_without_selection_critical_only_when_selected() -> None:
    none = p.select_extensions(manifest(), None)
    assert none.allows("llm-coordinator.diagnostics") and not none.allows("acme.strict-json")
    assert none.active == {"llm-coordinator.diagnostics"}
    chosen = p.select_extensions(manifest(), ["acme.strict-json"])
    assert chosen.allows("acme.strict-json") and chosen.allows("llm-coordinator.diagnostics")
    assert not chosen.allows("acme.undeclared")


def test_selecting_an_undeclared_extension_is_refused_critical_or_not() -> None:
    with pytest.raises(p.ProfileError) as info:
        p.select_extensions(manifest(), ["acme.strict-json", "acme.nope"])
    assert (info.value.code, info.value.param) == ("unsupported_extension", "extensions[1]")
    for name in ("acme.strict-json", "llm-coordinator.diagnostics"):  # critical and non-critical alike
        with pytest.raises(p.ProfileError) as info:
            p.select_extensions(manifest(extensions=()), [name])
        assert (info.value.code, info.value.param) == ("unsupported_extension", "extensions[0]")


def test_extension_fields_are_added_only_when_allowed() -> None:
    sel = p.select_extensions(manifest(), None)
    event: Any = {"type": "response.output_text.delta", "choice_index": 0, "delta": "x"}
    assert p.add_extension_fields(event, "llm-coordinator.diagnostics", {"engine": "e1"}, sel)
    assert not p.add_extension_fields(event, "acme.strict-json", {"strict": True}, sel)
    assert not p.add_extension_fields(event, "acme.undeclared", {"x": 1}, sel)
    assert event["extensions"] == {"llm-coordinator.diagnostics": {"engine": "e1"}}
    assert p.extension_violations(event, sel) == []
    sel2 = p.select_extensions(manifest(), ["acme.strict-json"])
    assert p.add_extension_fields(event, "acme.strict-json", {"strict": True}, sel2)
    assert set(event["extensions"]) == {"llm-coordinator.diagnostics", "acme.strict-json"}


def test_extension_violations() -> None:
    sel = p.select_extensions(manifest(), None)
    event = {"type": "response.usage", "usage": {}, "extensions": {"acme.strict-json": {}, "acme.other": {}}}
    assert p.extension_violations(event, sel) == ["critical extension 'acme.strict-json' was not selected",
                                                  "extension 'acme.other' is not declared in the manifest"]
    assert p.extension_violations({"type": "response.usage", "extensions": []}, sel) == ["'extensions' is not an object"]
    assert p.extension_violations({"type": "response.usage"}, sel) == []


def test_baseline_view_ignores_extensions() -> None:
    """A Level-1 check never depends on extension data (rules 3 and 5)."""
    plain = {"type": "response.output_text.delta", "choice_index": 0, "delta": "x"}
    extended = {**plain, "extensions": {"llm-coordinator.diagnostics": {"engine": "e1"}},
                "openai_chunk": content_chunk("x")}
    assert p.baseline_event(extended) == plain


def test_spec_document_names_every_constant() -> None:
    """docs/nnrp.md is the spec another implementation is built from: it must not fall behind the code."""
    doc = (ROOT / "docs" / "nnrp.md").read_text()
    names = [*p.EVENT_TYPES, *p.ERROR_CODES, *p.BODY_RESERVED_FIELDS, *p.OPERATION_LEVELS, *p.CANCEL_SOURCES,
             *p.DIAGNOSTICS_LEVELS, *p.CACHE_MODES, *p.TRANSPORT_MODES, *p.ENVELOPE_FIELDS, p.SCHEMA_VERSION,
             p.ADAPTER, p.DIAGNOSTICS_EXTENSION]
    assert [n for n in names if f"`{n}`" not in doc and f'"{n}"' not in doc] == []
    assert "## Wire protocol v1\n" in doc
