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
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_invalid_chat_values_name_the_field(patch: dict, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        validate_request("chat", {**CHAT, **patch}, strict=True)
    assert info.value.param == param
    assert info.value.status == 400


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
