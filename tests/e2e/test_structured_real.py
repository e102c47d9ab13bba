"""Structured outputs and forced tool calls on real vLLM, side by side with native ``vllm serve``.

The coordinator fronts the session's two kinds of engine: a ``--tokens-only`` engine (no tokenizer,
no grammars) and an ``--enable-scale-out`` one (tokenizer loaded, ``/inference/v1/generate``
served). It learns which is which from the engines themselves (``POST /tokenize``), sends every
constrained request to the engine that can compile its grammar, and the answer must equal what the
same engine's own OpenAI API answers (greedy): content, finish reason, usage.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.config import EngineSettings
from tests.conftest import SERVED, CoordinatorFactory, ToolStack, VllmStack
from tests.support import CoordinatorServer, leave_stream, sse_events, streamed_text

pytestmark = pytest.mark.e2e

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
FORMS: dict[str, dict[str, Any]] = {
    "json_schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "person", "strict": True, "schema": PERSON}}},
    "json_object": {"response_format": {"type": "json_object"}},
    "choice": {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    "regex": {"structured_outputs": {"regex": "[A-Z][a-z]+ is [0-9]{1,3} years old\\."}},
    "grammar": {"structured_outputs": {"grammar": 'root ::= "Ann" | "Bob" | "Cleo"'}},
    "json": {"structured_outputs": {"json": PERSON}},
}
ASK = "Describe a person named Ann who is 30 years old."


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": ASK}], "temperature": 0,
            "max_tokens": 40, **extra}


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=180)


def decisions(coord: CoordinatorServer) -> dict[str, float]:
    text = httpx.get(f"{coord.url}/metrics", timeout=30).text
    return {s.labels["engine"]: s.value for fam in text_string_to_metric_families(text)
            if fam.name == "coordinator_scheduling_decisions" for s in fam.samples if s.name.endswith("_total")}


def answer(resp: httpx.Response, stream: bool, kind: str = "chat") -> tuple[dict[int, str], list[Any], Any]:
    """Text per choice, finish reasons, usage: one shape for JSON and SSE answers."""
    assert resp.status_code == 200, resp.text
    if not stream:
        data = resp.json()
        texts = {c["index"]: (c["message"]["content"] if kind == "chat" else c["text"]) for c in data["choices"]}
        return texts, [c["finish_reason"] for c in data["choices"]], data["usage"]
    events = sse_events(resp)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
    finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c.get("finish_reason")]
    usage = next((e["usage"] for e in events[:-1] if e.get("usage")), None)
    return streamed_text(events, kind), finishes, usage


@pytest.fixture
def coord(vllm_stack: VllmStack, coordinator_factory: CoordinatorFactory) -> CoordinatorServer:
    return coordinator_factory(vllm_stack.render_url, [vllm_stack.engine.url, vllm_stack.native.url])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_structured_form_equals_native_and_runs_on_the_capable_engine(
        vllm_stack: VllmStack, coord: CoordinatorServer, form: str, stream: bool) -> None:
    body = chat(**FORMS[form])
    before = decisions(coord)
    ours = answer(post(coord.url, "/v1/chat/completions",
                       {**body, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}),
                  stream)
    native = answer(post(vllm_stack.native.url, "/v1/chat/completions", body), False)
    assert ours[0] == native[0] and ours[1] == native[1], (ours, native)
    assert {k: ours[2][k] for k in ("prompt_tokens", "completion_tokens")} == {
        k: native[2][k] for k in ("prompt_tokens", "completion_tokens")}
    after = decisions(coord)
    assert after.get(vllm_stack.native.url, 0) == before.get(vllm_stack.native.url, 0) + 1
    assert after.get(vllm_stack.engine.url, 0) == before.get(vllm_stack.engine.url, 0)  # never the token-only one
    text = ours[0][0]
    if form in ("json_schema", "json") and ours[1] == ["stop"]:
        doc = json.loads(text)
        assert set(doc) == {"name", "age"} and isinstance(doc["age"], int)
    if form == "choice":
        assert text in ("yes", "no", "maybe")
    if form == "grammar":
        assert text in ("Ann", "Bob", "Cleo")
    if form == "regex" and ours[1] == ["stop"]:
        assert re.fullmatch(r"[A-Z][a-z]+ is [0-9]{1,3} years old\.", text)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_with_several_prompts_and_n_equal_native(vllm_stack: VllmStack, coord: CoordinatorServer,
                                                              stream: bool) -> None:
    body = {"model": SERVED, "prompt": ["Is water wet? Answer:", "Is fire cold? Answer:"], "max_tokens": 4,
            "temperature": 0.8, "seed": 11, "n": 2, "structured_outputs": {"choice": ["yes", "no"]}}
    ours = answer(post(coord.url, "/v1/completions", {**body, "stream": stream}), stream, "completion")
    native = answer(post(vllm_stack.native.url, "/v1/completions", body), False, "completion")
    assert len(ours[0]) == 4 and set(ours[0].values()) <= {"yes", "no"}
    assert ours[0] == native[0]


def test_a_fleet_of_token_only_engines_refuses_a_grammar_with_a_400(
        vllm_stack: VllmStack, coordinator_factory: CoordinatorFactory) -> None:
    """Learned from the real engine's own /tokenize answer: no configuration says it."""
    coord = coordinator_factory(vllm_stack.render_url, [vllm_stack.engine.url])
    r = post(coord.url, "/v1/chat/completions", chat(**FORMS["json_schema"], stream=True))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert "no engine serving model" in r.json()["error"]["message"]
    assert coord.wait_idle() == 0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("constraint", "param"), [
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}},
     "structured_outputs"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= ( "}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
])
def test_a_grammar_that_cannot_be_built_is_a_400_naming_the_field_and_the_engine_lives(
        vllm_stack: VllmStack, coord: CoordinatorServer, constraint: dict[str, Any], param: str,
        stream: bool) -> None:
    r = post(coord.url, "/v1/chat/completions", chat(stream=stream, **constraint))
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == param
    assert httpx.get(f"{vllm_stack.native.url}/health", timeout=10).status_code == 200
    assert coord.wait_idle() == 0


@pytest.mark.parametrize(("pattern", "enum"), [("(a|aa)*(b|bb)*c{1,500}", None), (None, 5000)])
def test_hostile_but_valid_grammars_complete_and_leave_the_engine_serving(
        vllm_stack: VllmStack, coord: CoordinatorServer, pattern: str | None, enum: int | None) -> None:
    so = {"regex": pattern} if pattern else {"json": {"type": "string", "enum": [f"v{i}" for i in range(enum or 0)]}}
    r = post(coord.url, "/v1/chat/completions", chat(structured_outputs=so, max_tokens=12))
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    if pattern:
        assert re.fullmatch(r"(a|aa)*(b|bb)*c{1,500}", text) or r.json()["choices"][0]["finish_reason"] == "length"
    else:
        assert json.loads(text) in [f"v{i}" for i in range(enum or 0)]
    assert post(coord.url, "/v1/chat/completions", chat(max_tokens=4)).status_code == 200


# -- forced tool calls: render needs a tool parser to build their grammar ---------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True, "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}


def tool_chat(**extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "temperature": 0, "max_tokens": 60, "tools": [WEATHER, TIME], **extra}


def tool_calls(resp: httpx.Response, stream: bool) -> tuple[list[dict[str, str]], str | None]:
    """(name, arguments) of every tool call and the finish reason, from JSON or joined SSE deltas."""
    assert resp.status_code == 200, resp.text
    if not stream:
        choice = resp.json()["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls], \
            choice["finish_reason"]
    joined: dict[int, dict[str, str]] = {}
    finish = None
    for e in sse_events(resp)[:-1]:
        for c in e["choices"]:
            finish = c.get("finish_reason") or finish
            for tc in (c.get("delta") or {}).get("tool_calls") or []:
                slot = joined.setdefault(tc["index"], {"name": "", "arguments": ""})
                fn = tc.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
    return [joined[i] for i in sorted(joined)], finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_equal_native(
        vllm_stack: VllmStack, tool_stack: ToolStack, coordinator_factory: CoordinatorFactory, choice: str,
        stream: bool) -> None:
    """What an agent framework sends for a required tool or an output type: ``tool_choice``
    required or named and ``parallel_tool_calls: false``. Render (hermes) turns it into a grammar,
    the scale-out engine runs it; the call equals what ``vllm serve --tool-call-parser hermes``
    answers, and parses against the tool's strict schema."""
    url = str(tool_stack.render.url)
    coord = coordinator_factory(url, [vllm_stack.engine.url, vllm_stack.native.url],
                                render={"url": url, "parsers": True})
    tc: Any = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    body = tool_chat(tool_choice=tc, parallel_tool_calls=False)
    calls, finish = tool_calls(post(coord.url, "/v1/chat/completions", {**body, "stream": stream}), stream)
    native_calls, native_finish = tool_calls(
        post(str(tool_stack.native.url), "/v1/chat/completions", {**body, "stream": stream}), stream)
    assert len(calls) == 1, calls  # parallel_tool_calls: false

    def parsed(cs: list[dict[str, str]]) -> list[tuple[str, Any]]:
        return [(c["name"], json.loads(c["arguments"])) for c in cs]

    # Streamed arguments arrive as parser deltas whose spacing may differ: compare what they say.
    assert parsed(calls) == parsed(native_calls), (calls, native_calls)
    if choice == "named":
        assert calls[0]["name"] == "get_weather"
        args = json.loads(calls[0]["arguments"])
        assert set(args) == {"city"} and isinstance(args["city"], str)
    assert finish == native_finish
    assert coord.wait_idle() == 0


def test_forced_tool_calls_without_a_tool_parser_are_refused_as_native_refuses_them(
        vllm_stack: VllmStack, coord: CoordinatorServer) -> None:
    body = tool_chat(tool_choice="required")
    ours = post(coord.url, "/v1/chat/completions", body)
    native = post(vllm_stack.native.url, "/v1/chat/completions", body)
    assert ours.status_code == native.status_code == 400, (ours.text, native.text)
    assert ours.json()["error"]["param"] == "tool_choice"


def test_an_engine_marked_capable_by_mistake_answers_its_refusal_before_any_byte(
        vllm_stack: VllmStack, coordinator_factory: CoordinatorFactory) -> None:
    """Real vLLM ``--tokens-only`` refuses a grammar as the first event of a 200 stream; the client
    gets HTTP 400 and the OpenAI error body, as native answers."""
    coord = coordinator_factory(vllm_stack.render_url, [],
                                engines=[EngineSettings(url=vllm_stack.engine.url, tokenizer=True)])
    r = post(coord.url, "/v1/chat/completions", chat(stream=True, **FORMS["choice"]))
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    assert "requires a tokenizer" in r.json()["error"]["message"]
    assert coord.wait_idle() == 0


# -- the other doors: Responses `text.format`, Messages `output_config` ----------------------------
def test_responses_text_format_json_schema_equals_native(vllm_stack: VllmStack, coord: CoordinatorServer) -> None:
    body = {"model": SERVED, "input": ASK, "temperature": 0, "max_output_tokens": 40,
            "text": {"format": {"type": "json_schema", "name": "person", "strict": True, "schema": PERSON}}}
    ours = post(coord.url, "/v1/responses", body)
    native = post(vllm_stack.native.url, "/v1/responses", body)
    assert ours.status_code == native.status_code == 200, (ours.text, native.text)

    def text(r: httpx.Response) -> str:
        return "".join(p["text"] for item in r.json()["output"] if item["type"] == "message"
                       for p in item["content"])

    assert text(ours) == text(native) != ""
    assert ours.json()["usage"]["output_tokens"] == native.json()["usage"]["output_tokens"]


def test_messages_output_config_json_schema_equals_native(vllm_stack: VllmStack, coord: CoordinatorServer) -> None:
    body = {"model": SERVED, "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": ASK}],
            "output_config": {"format": {"type": "json_schema", "schema": PERSON}}}
    ours = post(coord.url, "/v1/messages", body)
    native = post(vllm_stack.native.url, "/v1/messages", body)
    assert ours.status_code == native.status_code == 200, (ours.text, native.text)
    assert ours.json()["content"] == native.json()["content"] and ours.json()["content"][0]["text"]
    assert ours.json()["stop_reason"] == native.json()["stop_reason"]


def test_messages_and_responses_name_their_own_field_when_no_engine_can(
        vllm_stack: VllmStack, coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(vllm_stack.render_url, [vllm_stack.engine.url])
    r = post(coord.url, "/v1/messages", {"model": SERVED, "max_tokens": 8, "messages": [
        {"role": "user", "content": ASK}], "output_config": {"format": {"type": "json_schema", "schema": PERSON}}})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "output_config" in r.json()["error"]["message"]
    r = post(coord.url, "/v1/responses", {"model": SERVED, "input": ASK, "max_output_tokens": 8, "text": {
        "format": {"type": "json_schema", "name": "p", "schema": PERSON}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text", r.text  # the Responses field


# -- the rest of the surface that needs render's or the engine's tokenizer -----------------------
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.parametrize("stream", [False, True])
def test_bad_words_equal_native_and_run_only_where_a_tokenizer_is(
        vllm_stack: VllmStack, coord: CoordinatorServer, stream: bool) -> None:
    """The engine turns the words into ids with its tokenizer; a token-only engine would silently
    ignore them, so they go to the scale-out engine only."""
    plain = answer(post(vllm_stack.native.url, "/v1/chat/completions",
                        {"model": SERVED, "messages": CAPITAL, "temperature": 0, "max_tokens": 16}), False)
    assert "Paris" in plain[0][0]  # the word the test bans is in the unconstrained answer
    body = {"model": SERVED, "messages": CAPITAL, "temperature": 0, "max_tokens": 16, "bad_words": ["Paris"]}
    before = decisions(coord)
    ours = answer(post(coord.url, "/v1/chat/completions", {**body, "stream": stream}), stream)
    native = answer(post(vllm_stack.native.url, "/v1/chat/completions", body), False)
    assert ours[0] == native[0] and "Paris" not in ours[0][0], (ours, native)
    after = decisions(coord)
    assert after.get(vllm_stack.native.url, 0) == before.get(vllm_stack.native.url, 0) + 1


def test_bad_words_on_a_token_only_fleet_are_a_400(vllm_stack: VllmStack,
                                                     coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(vllm_stack.render_url, [vllm_stack.engine.url])
    r = post(coord.url, "/v1/completions", {"model": SERVED, "prompt": "The capital of France is",
                                            "max_tokens": 4, "bad_words": ["Paris"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text


@pytest.mark.parametrize("side", [None, "left", "right"])
def test_truncate_prompt_tokens_equals_native(vllm_stack: VllmStack, coord: CoordinatorServer,
                                              side: str | None) -> None:
    """Render truncates with its tokenizer; the prompt the engine sees, the answer and the usage are
    native's (any engine may run it)."""
    long = " ".join(f"Note {i}: the archive keeps record {i * 37 % 100}." for i in range(30))
    extra = {"truncation_side": side} if side else {}
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}),
                       ("/v1/completions", {"prompt": long})):
        full = {"model": SERVED, "temperature": 0, "max_tokens": 8, "truncate_prompt_tokens": 40, **extra, **body}
        ours, native = post(coord.url, path, full), post(vllm_stack.native.url, path, full)
        assert ours.status_code == native.status_code == 200, (ours.text, native.text)
        kind = "chat" if "messages" in body else "completion"
        assert answer(ours, False, kind)[0] == answer(native, False, kind)[0]
        assert ours.json()["usage"]["prompt_tokens"] == native.json()["usage"]["prompt_tokens"] == 40


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_return_token_ids_gives_prompt_and_completion_ids_as_native(
        vllm_stack: VllmStack, coord: CoordinatorServer, kind: str, stream: bool) -> None:
    path, body = (("/v1/chat/completions", {"messages": CAPITAL}) if kind == "chat"
                  else ("/v1/completions", {"prompt": "The capital of France is"}))
    full = {"model": SERVED, "temperature": 0, "max_tokens": 6, "return_token_ids": True, **body}

    def ids(resp: httpx.Response, streamed: bool) -> tuple[Any, list[int]]:
        assert resp.status_code == 200, resp.text
        if not streamed:
            data = resp.json()
            choice = data["choices"][0]
            prompt = data.get("prompt_token_ids") if kind == "chat" else choice.get("prompt_token_ids")
            return prompt, choice["token_ids"]
        prompt, out = None, []
        for e in sse_events(resp)[:-1]:
            if kind == "chat" and e.get("prompt_token_ids"):
                prompt = e["prompt_token_ids"]
            for c in e["choices"]:
                if kind == "completion" and c.get("prompt_token_ids"):
                    prompt = c["prompt_token_ids"]
                out += c.get("token_ids") or []
        return prompt, out

    ours = ids(post(coord.url, path, {**full, "stream": stream}), stream)
    native = ids(post(vllm_stack.native.url, path, {**full, "stream": stream}), stream)
    assert ours == native and ours[0] and ours[1], (ours, native)


def test_a_client_leaving_a_constrained_stream_aborts_it_on_the_scale_out_engine(
        vllm_stack: VllmStack, coord: CoordinatorServer) -> None:
    """Aborts reach an ``--enable-scale-out`` engine as they reach a token-only one (its
    ``/inference/v1/abort_requests``; closing the stream alone also aborts in vLLM): the grammar's
    engine stops generating within a second of the client leaving."""
    proc = vllm_stack.native.process
    mark = proc.line_count()
    body = chat(stream=True, max_tokens=1500, structured_outputs={"regex": "(yes ){1000}"})
    leave_stream(f"{coord.url}/v1/chat/completions", body, "leave-so")
    line = proc.wait_for_line(r"Aborted request\(s\) generate-tokens-chatcmpl-leave-so", timeout=1.5, since=mark)
    assert line is not None, f"no abort within 1.5 s of the client leaving:\n{proc.tail()}"
    assert coord.wait_idle() == 0
