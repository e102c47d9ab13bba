"""How the prompt is written into an answer (``derender/echo.py``), on the engine's and derender's
own shapes: what a client of ``echo`` / ``prompt_logprobs`` reads. Equality with native vLLM on the
real engines is tests/e2e/test_echo_real.py."""

from __future__ import annotations

from typing import Any

from coordinator.pipeline.context import PromptPlan, RequestContext, StopSpec
from coordinator.pipeline.derender.echo import apply_batch, apply_stream, build, decode_body

IDS = [504, 3575, 282]
# The engine's prompt logprobs: position 0 has none; then the prompt token first, alternatives after.
ENGINE = [None,
          {"3575": {"logprob": -11.5, "rank": 2923, "decoded_token": None},
           "29": {"logprob": -0.8, "rank": 1, "decoded_token": None}},
          {"282": {"logprob": float("-inf"), "rank": 1, "decoded_token": None}}]
# What batch chat derender answers for decode_body(IDS, ENGINE): one entry per position.
DECODED = ("The capital of", [
    {"token": "The", "logprob": 0.0, "top_logprobs": []},
    {"token": " capital", "logprob": -11.5, "top_logprobs": [{"token": " capital", "logprob": -11.5},
                                                             {"token": "-", "logprob": -0.8}]},
    {"token": " of", "logprob": -9999.0, "top_logprobs": [{"token": " of", "logprob": -9999.0}]},
])


def ctx(kind: str = "completion", n: int = 1, **body: Any) -> tuple[RequestContext, PromptPlan]:
    plan = PromptPlan(index=0, generate={"sampling_params": {"prompt_logprobs": 1}}, prompt_token_ids=IDS, n=n,
                      stop=StopSpec(()))
    c = RequestContext(kind=kind, request_id="r", body=body, model="m", stream=False, include_usage=False,
                       prompts=[plan])  # type: ignore[arg-type]
    return c, plan


def test_decode_body_sends_each_position_with_the_engines_alternatives_in_order() -> None:
    body = decode_body(IDS, ENGINE)
    choice = body["choices"][0]
    assert choice["token_ids"] == IDS
    content = choice["logprobs"]["content"]
    assert [e["token_id"] for e in content] == IDS
    assert [t["token_id"] for t in content[1]["top_logprobs"]] == [3575, 29]
    assert content[2]["logprob"] == -9999.0  # -inf is not JSON


def test_completion_echo_puts_the_prompt_before_text_and_logprobs() -> None:
    c, plan = ctx(prompt="The capital of", echo=True, logprobs=1)
    echo = build(c, plan, ENGINE, DECODED)
    out = {"choices": [{"index": 0, "text": " Paris", "logprobs": {
        "tokens": [" Paris"], "token_logprobs": [-0.2], "top_logprobs": [{" Paris": -0.2}], "text_offset": [0]}}]}
    apply_batch(c, out, [echo])
    choice = out["choices"][0]
    assert choice["text"] == "The capital of Paris"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["The", " capital", " of", " Paris"]
    assert lp["token_logprobs"] == [None, -11.5, -9999.0, -0.2]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {" capital": -11.5, "-": -0.8}
    assert lp["text_offset"] == [0, 3, 11, 14]  # the output's offsets run on from the prompt's
    assert choice["prompt_logprobs"][1]["29"] == {"logprob": -0.8, "rank": 1, "decoded_token": "-"}


def test_max_tokens_zero_answers_the_prompt_alone() -> None:
    c, plan = ctx(prompt="The capital of", echo=True, logprobs=0, max_tokens=0)
    echo = build(c, plan, ENGINE, DECODED)
    out = {"choices": [{"index": 0, "text": " Paris", "logprobs": {
        "tokens": [" Paris"], "token_logprobs": [-0.2], "top_logprobs": [{}], "text_offset": [0]}}]}
    apply_batch(c, out, [echo])
    assert out["choices"][0]["text"] == "The capital of"
    assert out["choices"][0]["logprobs"]["tokens"] == ["The", " capital", " of"]


def test_a_token_prompt_echoes_its_decoded_text_and_return_token_ids_echoes_none() -> None:
    c, plan = ctx(prompt=IDS, echo=True)
    assert build(c, plan, None, DECODED).text == "The capital of"
    c, plan = ctx(prompt="The capital of", echo=True, return_token_ids=True)
    assert build(c, plan, None, None).text == ""


def test_a_stream_echoes_on_each_choices_first_chunk_and_moves_later_offsets() -> None:
    c, plan = ctx(prompt="The capital of", echo=True, logprobs=1)
    echo = build(c, plan, ENGINE, DECODED)
    first = {"index": 0, "text": " Paris", "logprobs": {"tokens": [" Paris"], "token_logprobs": [-0.2],
                                                         "top_logprobs": [{}], "text_offset": [0]}}
    later = {"index": 0, "text": ".", "logprobs": {"tokens": ["."], "token_logprobs": [-0.1],
                                                    "top_logprobs": [{}], "text_offset": [6]}}
    apply_stream(echo, plan, first, first=True)
    apply_stream(echo, plan, later, first=False)
    assert first["text"] == "The capital of Paris" and first["prompt_token_ids"] == IDS
    assert first["logprobs"]["text_offset"] == [0, 3, 11, 14]
    assert later["text"] == "." and later["logprobs"]["text_offset"] == [20]


def test_chat_echo_needs_the_answers_role_and_prompt_logprobs_go_on_top() -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    c, plan = ctx("chat", n=2, messages=messages, echo=True)
    echo = build(c, plan, ENGINE, DECODED)
    out = {"choices": [{"index": i, "message": {"role": "assistant", "content": "!"}} for i in range(2)]}
    apply_batch(c, out, [echo])
    assert [ch["message"]["content"] for ch in out["choices"]] == ["Hello\nthere!"] * 2
    assert out["prompt_logprobs"][0] is None and out["prompt_logprobs"][2]["282"]["decoded_token"] == " of"
    c, plan = ctx("chat", messages=messages[:1], echo=True)  # the last message is the user's
    assert build(c, plan, None, None).text == ""
