"""Client mistakes are 400s that name the field, before anything is rendered or scheduled."""

import pytest

from coordinator.pipeline.errors import BadRequest
from coordinator.pipeline.validation import validate_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("patch", "param"), [
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"stop": 5}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": []}, "messages"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "  "}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": ""}}, "structured_outputs.json"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"pattern": "a+"}}, "structured_outputs.pattern"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"bad_words": "Paris"}, "bad_words"),
    ({"bad_words": [""]}, "bad_words"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": "10"}, "truncate_prompt_tokens"),
    ({"truncation_side": "middle"}, "truncation_side"),
    ({"logprob_token_ids": "5"}, "logprob_token_ids"),
    ({"logprob_token_ids": list(range(20))}, "logprob_token_ids"),   # 19 at most on the token route
    ({"frobnicate": 1}, "frobnicate"),
])
def test_invalid_chat_values_name_the_field(patch: dict, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        validate_request("chat", {**CHAT, **patch}, strict=True)
    assert info.value.param == param
    assert info.value.status == 400


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("patch", [
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "strict": True,
        "schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}},
    {"response_format": {"type": "text"}},
    {"structured_outputs": {"choice": ["yes", "no"]}},
    {"structured_outputs": {"regex": "[0-9]{3}", "disable_any_whitespace": True}},
    {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
    {"structured_outputs": {"json": {"type": "integer"}}},
    {"structured_outputs": {"json_object": True}},
    {"bad_words": ["Paris", "London"]},
    {"truncate_prompt_tokens": 40, "truncation_side": "left"},
    {"truncate_prompt_tokens": -1},
    {"logprob_token_ids": list(range(19))},
])
def test_grammar_bad_words_and_truncation_pass_validation_unchanged(kind: str, patch: dict) -> None:
    """Render builds grammars and truncates; an engine with a tokenizer runs grammars and bad words:
    the fields go on as sent."""
    body = CHAT if kind == "chat" else {"model": "m", "prompt": "hi"}
    out = validate_request(kind, {**body, **patch}, strict=True)  # type: ignore[arg-type]
    assert {k: out[k] for k in patch} == patch


def test_compat_mode_drops_unknown_fields_instead_of_failing() -> None:
    body = validate_request("chat", {**CHAT, "frobnicate": 1, "temperature": 0.5}, strict=False)
    assert "frobnicate" not in body and body["temperature"] == 0.5


@pytest.mark.parametrize("prompt", ["", [], [[]], [1, "a"], None, 3])
def test_bad_prompts_are_rejected(prompt: object) -> None:
    if prompt == "":
        validate_request("completion", {"model": "m", "prompt": prompt}, strict=True)  # empty text is valid
        return
    with pytest.raises(BadRequest) as info:
        validate_request("completion", {"model": "m", "prompt": prompt}, strict=True)
    assert info.value.param == "prompt"


def test_non_object_body_is_rejected() -> None:
    with pytest.raises(BadRequest):
        validate_request("chat", ["not", "an", "object"], strict=True)


def test_logprob_token_ids_ask_the_engine_for_every_id_and_completions_show_them_uncut() -> None:
    """The generate route cuts each position to ``sampling_params.logprobs`` entries (the sampled token
    first): asked for one entry more, with a repeat that adds no key, every id named comes back."""
    from coordinator.pipeline.derender.fixups import native_top_logprobs, widen_logprob_token_ids

    sp: dict = {"logprob_token_ids": [7, 9], "logprobs": None}
    widen_logprob_token_ids(sp)
    assert sp == {"logprob_token_ids": [7, 9, 7], "logprobs": 3}
    plain: dict = {"logprobs": 2}
    widen_logprob_token_ids(plain)
    assert plain == {"logprobs": 2}
    tops = [{"token_id": 3}, {"token_id": 7}, {"token_id": 9}]
    choice = {"logprobs": {"content": [{"token_id": 3, "rank": 4, "top_logprobs": list(tops)}]}}
    native_top_logprobs(choice, {"logprobs": 1, "logprob_token_ids": [7, 9]})
    assert choice["logprobs"]["content"][0]["top_logprobs"] == tops   # not cut to logprobs + 1
    native_top_logprobs(choice, {"logprobs": 1})
    assert choice["logprobs"]["content"][0]["top_logprobs"] == tops[:2]
