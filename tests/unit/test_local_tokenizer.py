"""The local tokenizer (render fallback): same ids as the real render sidecar, and when the render
stage falls back to it or not (a fake sidecar over httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from coordinator.config import ModelSettings, RenderSettings
from coordinator.pipeline.catalog import ModelCatalog
from coordinator.pipeline.context import RequestContext
from coordinator.pipeline.errors import (
    BadRequest,
    PipelineError,
    UpstreamClientError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from coordinator.pipeline.local_tokenizer import LocalTokenizers, LocalTokenizerUnavailable, _message
from coordinator.pipeline.native_route import NativeRouteRefused
from coordinator.pipeline.render import RenderStage
from coordinator.pipeline.sidecar import SidecarClient
from tests.conftest import MAX_MODEL_LEN, SERVED

ROOT = Path(__file__).resolve().parents[2]

CHATS: dict[str, list[dict[str, Any]]] = {
    "user_only": [{"role": "user", "content": "What is the capital of France?"}],
    "with_system": [{"role": "system", "content": "You answer in one word."},
                    {"role": "user", "content": "What is the capital of France?"}],
    "multi_turn": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                   {"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a joke"}]}],
    "non_ascii": [{"role": "user", "content": "你好，请用中文介绍一下北京。😀"}],
}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ---- pure helpers -------------------------------------------------------------------------------

def test_text_parts_are_joined_and_tool_arguments_parsed() -> None:
    msg = _message({"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    "tool_calls": [{"id": "1", "type": "function",
                                    "function": {"name": "f", "arguments": "{\"x\": 1}"}}]})
    assert msg["content"] == "a\nb"
    assert msg["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert "tool_calls" not in _message({"role": "assistant", "content": "x", "tool_calls": []})
    with pytest.raises(UpstreamUnavailable, match="text only"):
        _message({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})


def test_no_tokenizer_path_is_a_clear_error() -> None:
    with pytest.raises(LocalTokenizerUnavailable, match="tokenizer_path"):
        run(LocalTokenizers({SERVED: None}).tokenize("chat", {"messages": CHATS["user_only"]}, SERVED))
    with pytest.raises(LocalTokenizerUnavailable, match="could not be loaded"):
        run(LocalTokenizers({SERVED: "/nonexistent/tokenizer"}).tokenize(
            "chat", {"messages": CHATS["user_only"]}, SERVED))


def test_the_coordinator_imports_without_loading_transformers() -> None:
    code = "import coordinator.app, sys; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_completion_prompts_strings_lists_and_ids(model_dir: Path) -> None:
    tok = LocalTokenizers({SERVED: str(model_dir)})
    one = run(tok.tokenize("completion", {"prompt": "The capital of France is"}, SERVED))
    two = run(tok.tokenize("completion", {"prompt": ["The capital of France is", "Hello"]}, SERVED))
    ids = run(tok.tokenize("completion", {"prompt": [1, 2, 3]}, SERVED))
    many = run(tok.tokenize("completion", {"prompt": [[1, 2], [3]]}, SERVED))
    assert len(one) == 1 and two[0] == one[0] and len(two) == 2
    assert ids == [[1, 2, 3]] and many == [[1, 2], [3]]


# ---- ids equal the real render sidecar's ----------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("name", list(CHATS))
def test_chat_ids_equal_render(render_sidecar: Any, model_dir: Path, name: str) -> None:
    body = {"model": SERVED, "messages": CHATS[name]}
    rendered = httpx.post(f"{render_sidecar.url}/v1/chat/completions/render", json=body, timeout=60).json()
    local = run(LocalTokenizers({SERVED: str(model_dir)}).tokenize("chat", body, SERVED))
    assert local == [rendered["token_ids"]]


@pytest.mark.e2e
def test_chat_template_options_equal_render(render_sidecar: Any, model_dir: Path) -> None:
    body = {"model": SERVED, "messages": [*CHATS["with_system"], {"role": "assistant", "content": "The cap"}],
            "add_generation_prompt": False, "continue_final_message": True}
    rendered = httpx.post(f"{render_sidecar.url}/v1/chat/completions/render", json=body, timeout=60).json()
    local = run(LocalTokenizers({SERVED: str(model_dir)}).tokenize("chat", body, SERVED))
    assert local == [rendered["token_ids"]]


@pytest.mark.e2e
@pytest.mark.parametrize("prompt", ["The capital of France is", ["Once upon a time", "你好 😀"]])
def test_completion_ids_equal_render(render_sidecar: Any, model_dir: Path, prompt: Any) -> None:
    body = {"model": SERVED, "prompt": prompt}
    rendered = httpx.post(f"{render_sidecar.url}/v1/completions/render", json=body, timeout=60).json()
    rendered = rendered if isinstance(rendered, list) else [rendered]
    local = run(LocalTokenizers({SERVED: str(model_dir)}).tokenize("completion", body, SERVED))
    assert local == [g["token_ids"] for g in rendered]


# ---- when the render stage falls back ------------------------------------------------------------

class StubNative:
    """What RenderStage asks of the native route."""

    def __init__(self, refusal: PipelineError | None = None) -> None:
        self._refusal = refusal

    def refusal(self, model: str, why: str) -> PipelineError | None:
        return self._refusal

    async def context_length(self, entry: Any) -> int:
        return MAX_MODEL_LEN


def render_stage(model_dir: Path, answer: Any, native: StubNative | None = None,
                 clock: Any = None, max_model_len: int | None = None, **render: Any) -> RenderStage:
    """``answer(request)`` plays the sidecar's render route; /v1/models knows nothing (render never
    answered it), so the context length comes from the native route."""
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/render"):
            result = answer(request)
            if isinstance(result, Exception):
                raise result
            return result
        return httpx.Response(503)

    sidecar = SidecarClient(RenderSettings(url="http://render.test", timeout_s=0.5, **render),
                            transport=httpx.MockTransport(handler))
    catalog = ModelCatalog([ModelSettings(name=SERVED, path=str(model_dir), max_model_len=max_model_len)],
                           sidecar)
    return RenderStage(sidecar, catalog, local=LocalTokenizers({SERVED: str(model_dir)}),
                       native_route=native or StubNative(),  # type: ignore[arg-type]
                       **({"clock": clock} if clock is not None else {}))


def attempt(stage: RenderStage, body: dict[str, Any] | None = None) -> RequestContext:
    body = body or {"model": SERVED, "messages": CHATS["user_only"], "max_tokens": 5}
    ctx = RequestContext(kind="chat", request_id="r1", body=body, model=SERVED, stream=False,
                         include_usage=False)

    async def go() -> None:
        entry = stage._catalog.resolve(SERVED)
        await stage(ctx, entry)

    run(go())
    return ctx


FALLBACKS = {
    "connect_error": lambda r: httpx.ConnectError("refused"),
    "timeout": lambda r: httpx.ReadTimeout("slow"),
    "5xx": lambda r: httpx.Response(500, text="boom"),
    "bare_404": lambda r: httpx.Response(404, json={"detail": "Not Found"}),
    "bare_405": lambda r: httpx.Response(405, text="Method Not Allowed"),
    "501": lambda r: httpx.Response(501, json={"error": {"message": "x", "type": "NotImplementedError"}}),
    "no_token_ids": lambda r: httpx.Response(200, json={"sampling_params": {}}),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_render_unavailable_falls_back_to_the_local_tokenizer(model_dir: Path, case: str) -> None:
    ctx = attempt(render_stage(model_dir, FALLBACKS[case]))
    assert ctx.tokenizer_source == "local" and ctx.route == "native"
    assert len(ctx.prompts) == 1 and ctx.prompts[0].max_tokens == 5 and ctx.prompts[0].prompt_tokens > 10


@pytest.mark.parametrize("status", [400, 422, 404])
def test_render_client_errors_are_returned_not_retried_locally(model_dir: Path, status: int) -> None:
    calls: list[int] = []

    def answer(r: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(status, json={"error": {"message": "bad role", "type": "BadRequestError",
                                                      "param": "messages", "code": status}})

    with pytest.raises(UpstreamClientError) as err:
        attempt(render_stage(model_dir, answer))
    assert err.value.status == status and len(calls) == 1


def test_context_overflow_is_a_400_on_the_fallback_too(model_dir: Path) -> None:
    body = {"model": SERVED, "messages": [{"role": "user", "content": "word " * 3000}]}
    with pytest.raises(BadRequest, match="maximum context length"):
        attempt(render_stage(model_dir, FALLBACKS["connect_error"]), body)


def test_no_native_engine_keeps_the_render_error_and_says_why(model_dir: Path) -> None:
    refusal = UpstreamUnavailable("render is unavailable (x), and no engine serves the OpenAI API")
    with pytest.raises(UpstreamUnavailable, match="no engine serves the OpenAI API") as err:
        attempt(render_stage(model_dir, FALLBACKS["connect_error"], StubNative(refusal)))
    assert err.value.status == 502
    with pytest.raises(UpstreamTimeout, match="no engine serves the OpenAI API"):
        attempt(render_stage(model_dir, FALLBACKS["timeout"], StubNative(refusal)))


def test_obfuscation_refuses_the_fallback(model_dir: Path) -> None:
    with pytest.raises(NativeRouteRefused) as err:
        attempt(render_stage(model_dir, FALLBACKS["connect_error"],
                             StubNative(NativeRouteRefused("obfuscation forbids it"))))
    assert err.value.status == 503


def test_render_circuit_skips_a_failing_render_then_probes_it_once(model_dir: Path) -> None:
    """After three failed render calls in a row requests fall back at once (no render call, no
    timeout to sit out); after the cooldown one request probes render and its success closes it."""
    now = [0.0]
    calls: list[int] = []
    healthy = [False]

    def answer(r: httpx.Request) -> httpx.Response:
        calls.append(1)
        if not healthy[0]:
            return httpx.Response(500, text="boom")
        return httpx.Response(200, json={"request_id": "r1", "token_ids": [1, 2, 3],
                                         "sampling_params": {"max_tokens": 5}})

    stage = render_stage(model_dir, answer, clock=lambda: now[0], max_model_len=MAX_MODEL_LEN,
                         circuit_failures=3, circuit_cooldown_s=5.0)
    for _ in range(3):
        assert attempt(stage).tokenizer_source == "local"
    assert len(calls) == 3 and stage.circuit.state == "open"
    for _ in range(4):                       # open: fallback without asking render
        assert attempt(stage).tokenizer_source == "local"
    assert len(calls) == 3
    now[0] = 5.0                             # cooldown over: one probe, still failing, re-opens
    assert attempt(stage).tokenizer_source == "local" and len(calls) == 4
    assert attempt(stage).tokenizer_source == "local" and len(calls) == 4
    now[0] = 10.0
    healthy[0] = True                        # render is back: the probe closes the circuit
    assert attempt(stage).tokenizer_source == "render" and len(calls) == 5
    assert stage.circuit.state == "closed"
    assert attempt(stage).tokenizer_source == "render" and len(calls) == 6


def test_render_client_errors_keep_the_render_circuit_closed(model_dir: Path) -> None:
    def answer(r: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "bad role", "type": "BadRequestError",
                                                   "param": "messages", "code": 400}})

    stage = render_stage(model_dir, answer, circuit_failures=1)
    for _ in range(3):
        with pytest.raises(UpstreamClientError):
            attempt(stage)
    assert stage.circuit.state == "closed"
