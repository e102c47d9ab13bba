"""End to end against real vLLM: render sidecar + token-only CPU engine behind the coordinator.

The reference is native vLLM (`/v1/chat/completions` of an engine started with `--enable-scale-out`)
on the same model and dtype; greedy outputs must agree token for token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import SERVED, VllmStack, make_settings
from tests.support import CoordinatorServer, leave_stream, sse_events, streamed_text

pytestmark = pytest.mark.e2e

NON_ASCII_PROMPTS = {
    "japanese": "Translate to Japanese: Good morning, my friend.",
    "chinese": "你好，请用中文介绍一下北京。",
    "cyrillic": "Translate to Russian: I love my cat.",
    "emoji": "Write a smiley emoji: 😀",
}


@pytest.fixture(scope="module")
def coord(vllm_stack: VllmStack) -> Iterator[CoordinatorServer]:
    with CoordinatorServer(make_settings(vllm_stack.render_url, [vllm_stack.engine.url])) as server:
        yield server


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 40, **extra}


def native_chat(stack: VllmStack, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{stack.native.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_openai_sdk_strict_chat_and_completions(coord: CoordinatorServer) -> None:
    client = openai.OpenAI(base_url=f"{coord.url}/v1", api_key="unused", max_retries=0,
                           _strict_response_validation=True)
    r = client.chat.completions.create(model="gpt-4o-mini", temperature=0, max_tokens=30,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in (r.choices[0].message.content or "")
    assert r.usage is not None and r.usage.completion_tokens > 0

    pieces = []
    with client.chat.completions.create(model="gpt-4o-mini", temperature=0, max_tokens=30, stream=True,
                                        stream_options={"include_usage": True},
                                        messages=[{"role": "user", "content": "What is the capital of France?"}]
                                        ) as stream:
        chunks = list(stream)
    for c in chunks:
        if c.choices:
            pieces.append(c.choices[0].delta.content or "")
    assert "Paris" in "".join(pieces)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None

    c = client.completions.create(model="gpt-4o-mini", prompt="The capital of France is", max_tokens=8,
                                  temperature=0)
    assert "Paris" in c.choices[0].text
    models = client.models.list()
    assert {"gpt-4o-mini", SERVED} <= {m.id for m in models.data}


@pytest.mark.parametrize("name", [*NON_ASCII_PROMPTS, "paris"])
def test_greedy_stream_equals_nonstream_equals_native(coord: CoordinatorServer, vllm_stack: VllmStack,
                                                      name: str) -> None:
    content = NON_ASCII_PROMPTS.get(name, "What is the capital of France?")
    body = chat(content)
    native = native_chat(vllm_stack, body)
    ours = httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=120).json()
    sresp = httpx.post(f"{coord.url}/v1/chat/completions", timeout=120,
                       json={**body, "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(sresp)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    deltas = [(ch.get("delta") or {}).get("content") or "" for ev in events if isinstance(ev, dict)
              for ch in ev.get("choices", [])]
    assert all("\ufffd" not in d for d in deltas), "a streamed delta carried U+FFFD"

    want = native["choices"][0]
    assert ours["choices"][0]["message"]["content"] == want["message"]["content"]
    assert streamed_text(events)[0] == want["message"]["content"]
    if name != "paris":
        assert any(ord(ch) > 127 for ch in want["message"]["content"]), "prompt no longer yields non-ASCII"
    finish = [ch["finish_reason"] for ev in events if isinstance(ev, dict) for ch in ev.get("choices", [])
              if ch.get("finish_reason")]
    assert ours["choices"][0]["finish_reason"] == want["finish_reason"] == finish[-1]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert ours["usage"][key] == native["usage"][key] == events[-2]["usage"][key], key


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_behave_like_native(coord: CoordinatorServer, vllm_stack: VllmStack, stream: bool) -> None:
    body = chat("What is the capital of France?", stop=[" is", "zzz"])
    native = native_chat(vllm_stack, body)
    if stream:
        events = sse_events(httpx.post(f"{coord.url}/v1/chat/completions", timeout=120,
                                       json={**body, "stream": True, "stream_options": {"include_usage": True}}))
        text = streamed_text(events)[0]
        last = [ch for ev in events if isinstance(ev, dict) for ch in ev.get("choices", [])][-1]
        finish, stop_reason, usage = last["finish_reason"], last["stop_reason"], events[-2]["usage"]
    else:
        ours = httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=120).json()
        text = ours["choices"][0]["message"]["content"]
        finish, stop_reason, usage = (ours["choices"][0]["finish_reason"], ours["choices"][0]["stop_reason"],
                                      ours["usage"])
    want = native["choices"][0]
    assert text == want["message"]["content"] and " is" not in text
    assert (finish, stop_reason) == (want["finish_reason"], want["stop_reason"]) == ("stop", " is")
    assert usage["completion_tokens"] == native["usage"]["completion_tokens"]


def test_three_prompt_streaming_completions(coord: CoordinatorServer) -> None:
    prompts = ["The capital of France is", "One, two, three,", "Emoji list: 😀 😃 😄 😁"]
    base = {"model": SERVED, "temperature": 0, "max_tokens": 12}
    singles = [httpx.post(f"{coord.url}/v1/completions", json={**base, "prompt": p}, timeout=120).json()
               for p in prompts]
    resp = httpx.post(f"{coord.url}/v1/completions", timeout=120,
                      json={**base, "prompt": prompts, "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(resp)
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    texts = streamed_text(events, kind="completion")
    assert sorted(texts) == [0, 1, 2]
    for i, single in enumerate(singles):
        assert texts[i] == single["choices"][0]["text"]
    usage = events[-2]["usage"]
    assert usage["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert usage["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    ids = {ev["id"] for ev in events if isinstance(ev, dict)}
    assert len(ids) == 1


def test_client_disconnect_aborts_engine_within_one_second(coord: CoordinatorServer,
                                                          vllm_stack: VllmStack) -> None:
    proc = vllm_stack.engine.process
    mark = proc.line_count()
    body = chat("Count from one to one thousand.", max_tokens=1500, ignore_eos=True, stream=True)
    headers = leave_stream(f"{coord.url}/v1/chat/completions", body, "disc-e2e-2")
    assert headers["x-request-id"] == "disc-e2e-2"
    closed_at = time.monotonic()
    line = proc.wait_for_line(r"Aborted request\(s\) generate-tokens-chatcmpl-disc-e2e-2", timeout=1.0,
                              since=mark)
    assert line is not None, f"no abort within 1 s of the disconnect:\n{proc.tail()}"
    assert time.monotonic() - closed_at <= 1.5
    assert coord.wait_idle() == 0


def test_closing_a_generate_stream_aborts_it_in_vllm(vllm_stack: VllmStack) -> None:
    """What the coordinator relies on for an engine without ``/inference/v1/abort_requests``: closing
    the connection of a generate stream, with no abort call, ends the request inside vLLM."""
    engine = vllm_stack.engine
    rendered = httpx.post(f"{vllm_stack.render_url}/v1/chat/completions/render", timeout=60,
                          json=chat("Count from one to one thousand.", max_tokens=1500, ignore_eos=True))
    assert rendered.status_code == 200, rendered.text
    body = {**rendered.json(), "stream": True}
    mark = engine.process.line_count()
    leave_stream(f"{engine.url}/inference/v1/generate", body, "close-only-1")
    line = engine.process.wait_for_line(r"Request generate-tokens-close-only-1\S* aborted", timeout=5.0,
                                        since=mark)
    assert line is not None, f"closing the stream did not abort it:\n{engine.process.tail()}"


BAD_INPUTS: list[tuple[str, Any, int, str | None]] = [
    ("not json", b"{nope", 400, None),
    ("not an object", [1, 2], 400, None),
    ("temperature high", chat("hi", temperature=3), 400, "temperature"),
    ("max_tokens zero", chat("hi", max_tokens=0), 400, "max_tokens"),
    ("max_tokens beyond context", chat("hi", max_tokens=5000), 400, "max_tokens"),
    ("unknown model", {**chat("hi"), "model": "nope"}, 404, "model"),
    ("unsupported field", chat("hi", frobnicate=True), 400, "frobnicate"),
    ("render rejects message content", {**chat("hi"), "messages": [{"role": "user", "content": 5}]}, 400, None),
    ("render rejects tools", chat("hi", tools=[{"type": "function"}]), 400, None),
    ("stream_options without stream", chat("hi", stream_options={"include_usage": True}), 400, "stream_options"),
]


@pytest.mark.parametrize(("name", "body", "status", "param"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_openai_error(coord: CoordinatorServer, name: str, body: Any, status: int,
                                     param: str | None) -> None:
    if isinstance(body, bytes):
        r = httpx.post(f"{coord.url}/v1/chat/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=60)
    else:
        r = httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param
    assert coord.wait_idle() == 0


def test_stop_token_ids_and_logprobs_match_native(coord: CoordinatorServer, vllm_stack: VllmStack) -> None:
    # " Paris" ends the answer when its token id is a stop token; logprobs must resolve identically.
    ids = httpx.post(f"{vllm_stack.render_url}/tokenize", json={"prompt": " Paris", "add_special_tokens": False},
                     timeout=30).json()["tokens"]
    body = chat("What is the capital of France?", stop_token_ids=ids[:1], logprobs=True, top_logprobs=2)
    native = native_chat(vllm_stack, body)
    ours = httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=120).json()
    want, got = native["choices"][0], ours["choices"][0]
    assert (got["finish_reason"], got["stop_reason"]) == (want["finish_reason"], want["stop_reason"]) == (
        "stop", ids[0])
    assert got["message"]["content"] == want["message"]["content"]
    assert ours["usage"] == {**native["usage"], **{k: ours["usage"][k] for k in ("prompt_tokens_details",
                                                                                   "completion_tokens_details")}}
    got_lp = [(t["token"], round(t["logprob"], 3), [x["token"] for x in t["top_logprobs"]])
              for t in got["logprobs"]["content"]]
    want_lp = [(t["token"], round(t["logprob"], 3), [x["token"] for x in t["top_logprobs"]])
               for t in want["logprobs"]["content"]]
    assert got_lp == want_lp and len(got_lp) == ours["usage"]["completion_tokens"]


def test_seeded_sampling_with_n_2_matches_native(coord: CoordinatorServer, vllm_stack: VllmStack) -> None:
    body = chat("Name a color.", temperature=0.8, seed=1234, n=2, max_tokens=16)
    native = native_chat(vllm_stack, body)
    ours = httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=120).json()
    assert [c["message"]["content"] for c in ours["choices"]] == [c["message"]["content"] for c in native["choices"]]
    events = sse_events(httpx.post(f"{coord.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120))
    texts = streamed_text(events)
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in native["choices"]]
    roles = [ch["index"] for ev in events if isinstance(ev, dict) for ch in ev["choices"]
             if (ch.get("delta") or {}).get("role")]
    assert sorted(roles) == [0, 1], "each choice gets its role exactly once"


def test_context_budget_on_clamps_to_the_shorter_engine_and_matches_native(vllm_stack: VllmStack) -> None:
    """``context_budget_mode: on`` with the engine declared at 96 tokens of context: a budget of 1000
    is clamped to 96 - prompt, the real engine generates exactly that many greedy tokens, and the text
    is the native server's for that max_tokens."""
    from coordinator.config import EngineSettings

    settings = make_settings(vllm_stack.render_url, [], limits={"context_budget_mode": "on"},
                             engines=[EngineSettings(url=vllm_stack.engine.url, max_model_len=96)])
    body = chat("Tell me a long story about a dragon.", max_tokens=1000)
    with CoordinatorServer(settings) as coord:
        ours = httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=120)
        assert ours.status_code == 200, ours.text
        usage = ours.json()["usage"]
        assert usage["completion_tokens"] == 96 - usage["prompt_tokens"]
        assert ours.json()["choices"][0]["finish_reason"] == "length"
        native = native_chat(vllm_stack, {**body, "max_tokens": 96 - usage["prompt_tokens"]})
        assert ours.json()["choices"][0]["message"]["content"] == native["choices"][0]["message"]["content"]
        off = make_settings(vllm_stack.render_url, [],
                            engines=[EngineSettings(url=vllm_stack.engine.url, max_model_len=96)])
    with CoordinatorServer(off) as coord:
        refused = httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=120)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
