"""Request-level guards that protect the fleet: token ids, JSON nesting, field values, error wording."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.api.body import json_depth_exceeds, parse_json
from coordinator.api.door import client_request_id
from coordinator.pipeline.errors import BadRequest, PipelineError, UpstreamClientError
from coordinator.pipeline.token_ids import check_client_ids, check_rendered
from coordinator.pipeline.validation import validate_request
from coordinator.pipeline.vocabulary import vocab_size_of

VOCAB = 1000
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


# ------------------------------------------------------------------------------ token ids
@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": [5, VOCAB]}, "prompt"),
    ({"prompt": [[1, 2], [3, 70368744177663]]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": "text", "stop_token_ids": [VOCAB + 5]}, "stop_token_ids"),
    ({"prompt": "text", "allowed_token_ids": [1, -3]}, "allowed_token_ids"),
    ({"prompt": "text", "logit_bias": {str(VOCAB): 1}}, "logit_bias"),
])
def test_out_of_vocabulary_ids_are_400s_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        check_client_ids({"model": "m", **body}, VOCAB, completion=True)
    assert info.value.param == param and "out of vocabulary" in info.value.message


def test_ids_at_the_edges_of_the_vocabulary_pass() -> None:
    check_client_ids({"prompt": [0, VOCAB - 1], "stop_token_ids": [VOCAB - 1], "logit_bias": {"0": 5}},
                     VOCAB, completion=True)


def test_unknown_vocabulary_refuses_client_ids_but_not_text() -> None:
    check_client_ids({"prompt": "plain text"}, None, completion=True)
    with pytest.raises(PipelineError) as info:
        check_client_ids({"prompt": [1, 2]}, None, completion=True)
    assert info.value.status == 503


def test_rendered_request_is_checked_again() -> None:
    good = {"token_ids": [1, 2, 3], "sampling_params": {"stop_token_ids": [2], "logit_bias": {"7": 1.0}}}
    check_rendered(good, VOCAB, prompt_field="messages")
    for bad, param in [({"token_ids": [1, VOCAB]}, "messages"),
                       ({"token_ids": [1], "sampling_params": {"allowed_token_ids": [VOCAB]}}, "allowed_token_ids"),
                       ({"token_ids": [1], "sampling_params": {"logit_bias": {"-4": 1}}}, "logit_bias"),
                       ({"token_ids": [1, "2"]}, "messages")]:
        with pytest.raises(BadRequest) as info:
            check_rendered(bad, VOCAB, prompt_field="messages")
        assert info.value.param == param
    # Without a known vocabulary the engine's int32 tensors are the last bound.
    with pytest.raises(BadRequest):
        check_rendered({"token_ids": [2**31]}, None, prompt_field="prompt")


def test_vocabulary_is_the_larger_of_model_and_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100}))
    (tmp_path / "tokenizer.json").write_text(json.dumps({
        "model": {"vocab": {"a": 0, "b": 97}}, "added_tokens": [{"id": 120, "content": "<x>"}]}))
    assert vocab_size_of(str(tmp_path)) == 121
    (tmp_path / "tokenizer.json").unlink()
    assert vocab_size_of(str(tmp_path)) == 100
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 64}}))
    assert vocab_size_of(str(tmp_path)) == 64
    assert vocab_size_of(str(tmp_path / "missing")) is None


# ------------------------------------------------------------------------------ JSON limits
def test_deep_nesting_is_a_400_not_a_crash() -> None:
    for depth in (65, 10_000, 100_000):
        with pytest.raises(BadRequest) as info:
            parse_json(("[" * depth + "]" * depth).encode(), max_depth=64)
        assert "deeper than 64" in info.value.message
    assert parse_json(b'{"a": [[{"b": 1}]]}', max_depth=4) == {"a": [[{"b": 1}]]}
    assert json_depth_exceeds({"a": [[{"b": 1}]]}, 3)


def test_invalid_json_is_a_400() -> None:
    for raw in (b"\x00", b"{", b"\xff\xfe"):
        with pytest.raises(BadRequest):
            parse_json(raw, max_depth=64)


# ------------------------------------------------------------------------------ strict mode
@pytest.mark.parametrize("extra", [
    {"store": False}, {"metadata": {"team": "a"}}, {"service_tier": "auto"}, {"user": "u1"},
    {"parallel_tool_calls": True}, {"modalities": ["text"]}, {"safety_identifier": "x"},
    {"stop": None, "seed": None, "logprobs": None}, {"stream": True, "stream_options": {"include_obfuscation": False}},
])
def test_no_op_openai_fields_are_accepted_in_strict_mode(extra: dict) -> None:
    body = validate_request("chat", {**CHAT, **extra}, strict=True)
    assert not {"store", "metadata", "service_tier", "modalities", "safety_identifier"} & set(body)


@pytest.mark.parametrize("extra", [{"best_of": 1}, {"suffix": None}, {"suffix": ""}])
def test_no_op_completion_fields_are_accepted(extra: dict) -> None:
    body = validate_request("completion", {"model": "m", "prompt": "x", **extra}, strict=True)
    assert not {"best_of", "suffix"} & set(body)


@pytest.mark.parametrize(("kind", "extra"), [
    ("completion", {"echo": True, "logprobs": 1, "max_tokens": 0}),  # the prompt alone, scored
    ("completion", {"prompt_logprobs": -1}),
    ("chat", {"echo": True, "add_generation_prompt": False}),
    ("chat", {"prompt_logprobs": 5}),
])
def test_echo_and_prompt_logprobs_go_to_render(kind: str, extra: dict) -> None:
    base = CHAT if kind == "chat" else {"model": "m", "prompt": "x"}
    body = validate_request(kind, {**base, **extra}, strict=True)  # type: ignore[arg-type]
    assert {k: body[k] for k in extra} == extra


@pytest.mark.parametrize(("kind", "extra", "param"), [
    ("completion", {"echo": "yes"}, "echo"),
    ("completion", {"max_tokens": 0}, "max_tokens"),  # only with echo (vLLM's rule)
    ("chat", {"echo": True, "max_tokens": 0}, "max_tokens"),
    ("completion", {"prompt_logprobs": -2}, "prompt_logprobs"),
])
def test_bad_echo_values_are_400s_naming_the_field(kind: str, extra: dict, param: str) -> None:
    base = CHAT if kind == "chat" else {"model": "m", "prompt": "x"}
    with pytest.raises(BadRequest) as info:
        validate_request(kind, {**base, **extra}, strict=True)  # type: ignore[arg-type]
    assert info.value.param == param


@pytest.mark.parametrize(("kind", "extra", "param"), [
    ("chat", {"store": True}, "store"),
    ("chat", {"service_tier": "flex"}, "service_tier"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("completion", {"best_of": 3}, "best_of"),
    ("completion", {"suffix": "end"}, "suffix"),
    ("chat", {"best_of": 1}, "best_of"),  # a completions-only field on chat is still unknown
    ("chat", {"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
])
def test_fields_we_cannot_honour_are_still_400s(kind: str, extra: dict, param: str) -> None:
    base = CHAT if kind == "chat" else {"model": "m", "prompt": "x"}
    with pytest.raises(BadRequest) as info:
        validate_request(kind, {**base, **extra}, strict=True)  # type: ignore[arg-type]
    assert info.value.param == param
    if "stream_options" not in extra:  # compat mode drops them instead
        assert param not in validate_request(kind, {**base, **extra}, strict=False)  # type: ignore[arg-type]


@pytest.mark.parametrize(("patch", "param"), [
    ({"model": None}, "model"),
    ({"messages": [{"role": "bogus", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"seed": 2**64}, "seed"),
    ({"max_tokens": 2**40}, "max_tokens"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"allowed_token_ids": "1,2"}, "allowed_token_ids"),
])
def test_bad_values_name_the_openai_field(patch: dict, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        validate_request("chat", {**CHAT, **patch}, strict=True)
    assert info.value.param == param


# ------------------------------------------------------------------------------ error wording
def test_pydantic_dumps_from_render_become_one_user_message() -> None:
    dump = ("2 validation errors:\n  {'type': 'string_type', 'loc': 'body.messages.0.ChatCompletionUserMessageParam"
            ".content', 'msg': 'Input should be a valid string', 'input': '5'}\n  {'type': 'literal_error', 'loc': "
            "'body.messages.0.ChatCompletionDeveloperMessageParam.role', 'msg': \"Input should be 'developer'\", "
            "'input': 'user'}")
    err = UpstreamClientError(400, {"error": {"message": dump, "type": "Bad Request", "param": "body.messages"}}, "x")
    assert err.param == "messages[0].content"
    assert err.message == "Invalid value for 'messages[0].content': Input should be a valid string"
    assert err.type == "BadRequestError" and "{" not in err.message


def test_operator_flags_are_not_shown_to_clients() -> None:
    msg = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    err = UpstreamClientError(400, {"error": {"message": msg, "type": "BadRequestError"}}, "x")
    assert "--" not in err.message and err.param == "tool_choice" and err.hint == msg
    # An engine without a reasoning parser refuses a thinking budget naming the flag (vLLM 0.32).
    msg = ("thinking_token_budget is set but reasoning_config is not configured. Please set "
           "--reasoning-parser and/or --reasoning-config to use thinking_token_budget.")
    err = UpstreamClientError(400, {"error": {"message": msg, "type": "BadRequestError"}}, "x")
    assert err.param == "thinking_token_budget" and "'thinking_token_budget' is not supported" in err.message


# ------------------------------------------------------------------------------ request ids
@pytest.mark.parametrize(("header", "kept"), [
    ("trace-42", True), ("a.b:c_d-1", True), ("x" * 128, True), ("x" * 129, False),
    ("has space", False), ("quote\"", False), ("", False), (None, False), ("ünïcode", False),
])
def test_client_request_ids_are_kept_only_when_safe(header: str | None, kept: bool) -> None:
    rid = client_request_id(header, 128)
    assert (rid == header) is kept
    assert len(rid) <= 128 and rid.isascii()


def test_empty_stream_options_and_zero_top_logprobs_are_accepted_as_native_does() -> None:
    validate_request("chat", {**CHAT, "stream_options": {}}, strict=True)
    validate_request("chat", {**CHAT, "top_logprobs": 0}, strict=True)
    with pytest.raises(BadRequest):
        validate_request("chat", {**CHAT, "top_logprobs": 2}, strict=True)
    with pytest.raises(BadRequest):
        validate_request("chat", {**CHAT, "stream_options": {"include_usage": True}}, strict=True)


@pytest.mark.parametrize("raw", [
    b'{"messages": [{"role": "user", "content": "\\udc80"}]}',          # a lone escaped surrogate
    b'{"messages": [{"role": "user", "content": "\xed\xb2\x80"}]}',     # one written as UTF-8 bytes
])
def test_an_unpaired_surrogate_is_a_400_not_a_500(raw: bytes) -> None:
    """It used to pass parsing and fail re-encoding for render (UnicodeEncodeError → 500)."""
    with pytest.raises(BadRequest, match="surrogate"):
        parse_json(raw, max_depth=32)


def test_a_paired_surrogate_escape_is_the_character_it_spells() -> None:
    assert parse_json(b'{"c": "\\ud83d\\ude00"}', max_depth=32) == {"c": "\U0001F600"}
