"""A grammar with a reasoning parser on real vLLM, side by side with native ``vllm serve``.

vLLM starts enforcing a request's grammar only once reasoning has ended: the engine's reasoning
parser watches the output, and render tells the engine whether the prompt itself already ended it
(``reasoning_ended``). One ``--enable-scale-out`` engine with the ``olmo3`` reasoning parser (plain
``<think>``/``</think>`` text, which SmolLM2's vocabulary spells) is both the coordinator's engine and
the native reference, behind a render sidecar with the same parser. The assistant's turn is prefilled
(``continue_final_message``) so that the prompt ends reasoning (the grammar holds from the first
token), or leaves it open (the model reasons on, unconstrained, until it closes it or runs out).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import MAX_MODEL_LEN, SERVED, CoordinatorFactory, VllmStack, _echo, _ready, make_settings
from tests.support import CoordinatorServer, free_port, sse_events

pytestmark = pytest.mark.e2e

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = "Describe a person named Ann who is 30 years old, as JSON."
PREFILLS = {"reasoning ended in the prompt": "<think>Ann is thirty years old.</think>",
            "reasoning still open": "<think>Let me think about Ann"}


@pytest.fixture(scope="module")
def reasoning_stack(model_dir: Path, logs_dir: Path) -> Iterator[tuple[Any, Any]]:
    from render_sidecar.launch import RenderSidecar
    from token_engine.launch import VllmEngine

    render = RenderSidecar(model_dir, port=free_port(), served_model_name=SERVED, max_model_len=MAX_MODEL_LEN,
                           reasoning_parser="olmo3", log_path=logs_dir / "render-reasoning.log", echo=_echo(),
                           name="render-reasoning")
    engine = VllmEngine(model_dir, port=free_port(), served_model_name=SERVED, mode="scale-out",
                        max_model_len=MAX_MODEL_LEN, log_path=logs_dir / "native-reasoning.log", echo=_echo(),
                        extra_args=["--reasoning-parser", "olmo3"], name="native-reasoning")
    try:
        engine.start()
        render.start()
        _ready(render)
        _ready(engine)
        yield render, engine
    finally:
        engine.stop()
        render.stop()


@pytest.fixture(scope="module")
def coord(reasoning_stack: tuple[Any, Any]) -> Iterator[CoordinatorServer]:
    render, engine = reasoning_stack
    with CoordinatorServer(make_settings(render.url, [engine.url])) as server:
        yield server


def body(prefill: str, stream: bool) -> dict[str, Any]:
    return {"model": SERVED, "temperature": 0, "max_tokens": 40, "stream": stream,
            "messages": [{"role": "user", "content": ASK}, {"role": "assistant", "content": prefill}],
            "continue_final_message": True, "add_generation_prompt": False,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "strict": True, "schema": PERSON}}}


def parts(r: httpx.Response, stream: bool) -> dict[str, Any]:
    """Content, reasoning and finish reason, as a client assembles them."""
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        return {"content": choice["message"].get("content"), "reasoning": choice["message"].get("reasoning"),
                "finish_reason": choice["finish_reason"]}
    content, reasoning, finish = "", "", None
    for ev in sse_events(r):
        if not isinstance(ev, dict):
            continue
        assert "error" not in ev, ev
        for ch in ev["choices"]:
            delta = ch.get("delta") or {}
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning") or ""
            finish = ch.get("finish_reason") or finish
    return {"content": content or None, "reasoning": reasoning or None, "finish_reason": finish}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", sorted(PREFILLS))
def test_a_grammar_after_reasoning_equals_native(reasoning_stack: tuple[Any, Any], coord: CoordinatorServer,
                                                 case: str, stream: bool) -> None:
    _, engine = reasoning_stack
    sent = body(PREFILLS[case], stream)
    ours = parts(httpx.post(f"{coord.url}/v1/chat/completions", json=sent, timeout=180), stream)
    native = parts(httpx.post(f"{engine.url}/v1/chat/completions", json=sent, timeout=180), stream)
    print(f"{case}, stream={stream}: {ours}")
    assert ours == native, (ours, native)
    if case == "reasoning ended in the prompt":  # the grammar held from the first token
        person = json.loads(ours["content"])
        assert set(person) == {"name", "age"} and isinstance(person["age"], int), ours
    else:  # still reasoning: the grammar waits, so the text is the model's own
        assert ours["reasoning"] or ours["content"], ours


@pytest.mark.parametrize("stream", [False, True])
def test_a_thinking_budget_ends_reasoning_as_native_does(reasoning_stack: tuple[Any, Any],
                                                         coord: CoordinatorServer, stream: bool) -> None:
    """``thinking_token_budget``: the engine cuts reasoning after that many tokens by writing the
    parser's end string, so the answer (here held to the grammar from there on) starts early."""
    _, engine = reasoning_stack
    sent = {**body(PREFILLS["reasoning still open"], stream), "thinking_token_budget": 3}
    ours = parts(httpx.post(f"{coord.url}/v1/chat/completions", json=sent, timeout=180), stream)
    native = parts(httpx.post(f"{engine.url}/v1/chat/completions", json=sent, timeout=180), stream)
    print(f"thinking_token_budget 3, stream={stream}: {ours}")
    assert ours == native, (ours, native)
    unbounded = parts(httpx.post(f"{coord.url}/v1/chat/completions", json=body(PREFILLS["reasoning still open"],
                                                                                stream), timeout=180), stream)
    assert ours != unbounded, "the budget changed nothing"


def test_a_thinking_budget_on_engines_without_a_tokenizer_is_a_400(
        vllm_stack: VllmStack, coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(vllm_stack.render_url, [vllm_stack.engine.url])
    r = httpx.post(f"{coord.url}/v1/chat/completions", timeout=60, json={
        "model": SERVED, "messages": [{"role": "user", "content": ASK}], "max_tokens": 5,
        "thinking_token_budget": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget", r.text
