"""Logprobs on real vLLM, side by side with native ``vllm serve``: ``logprob_token_ids`` and the
streamed chat logprobs of a render sidecar that runs a parser.

* ``logprob_token_ids``: the generate route would cut each position to ``sampling_params.logprobs``
  entries (none, as render leaves it unset), so the coordinator asks the engine for one entry more
  (derender/fixups.py); every id named comes back at every position, streamed or not, as natively.
* A tool parser on the sidecar: vLLM 0.32's parsed derender drops the chunk's logprobs; our sidecar
  resolves them (render_sidecar/stream_cache.py), so a streamed chat answer carries them as
  ``vllm serve --tool-call-parser hermes`` does, and hides them where native does
  (``include_reasoning: false``).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import SERVED, CoordinatorFactory, ToolStack, VllmStack
from tests.support import CoordinatorServer, sse_events

pytestmark = pytest.mark.e2e

IDS = [504, 260, 6253, 5, 17, 2]  # a few words, punctuation and EOS: mostly not what is sampled


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": "Is Paris in France? Answer yes or no."}],
            "temperature": 0, "max_tokens": 6, "logprobs": True, **extra}


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 6,
            "logprobs": 0, **extra}


def positions(resp: httpx.Response, stream: bool, kind: str) -> list[Any]:
    """Every position's logprobs, in order, one shape for JSON and SSE answers."""
    assert resp.status_code == 200, resp.text
    if stream:
        events = sse_events(resp)
        assert events[-1] == "[DONE]", events
        parts = [c.get("logprobs") for e in events[:-1] if isinstance(e, dict) for c in e.get("choices") or []]
    else:
        parts = [c.get("logprobs") for c in resp.json()["choices"]]
    parts = [p for p in parts if p]
    if kind == "chat":
        return [entry for p in parts for entry in p["content"] or []]
    return [(tok, lp, top) for p in parts
            for tok, lp, top in zip(p["tokens"], p["token_logprobs"], p["top_logprobs"], strict=True)]


@pytest.fixture
def coord(vllm_stack: VllmStack, coordinator_factory: CoordinatorFactory) -> CoordinatorServer:
    return coordinator_factory(vllm_stack.render_url, [vllm_stack.engine.url])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_logprob_token_ids_equal_native(vllm_stack: VllmStack, coord: CoordinatorServer, kind: str,
                                        stream: bool) -> None:
    path, make = ("/v1/chat/completions", chat) if kind == "chat" else ("/v1/completions", completion)
    body = make(logprob_token_ids=IDS, stream=stream)
    ours = positions(httpx.post(f"{coord.url}{path}", json=body, timeout=120), stream, kind)
    native = positions(httpx.post(f"{vllm_stack.native.url}{path}", json=body, timeout=120), stream, kind)
    assert ours == native and len(ours) == 6
    # Every id named, at every position (plus the sampled token where it is not one of them).
    tops = [e["top_logprobs"] for e in ours] if kind == "chat" else [list(t) for _, _, t in ours]
    assert all(len(t) >= len(IDS) for t in tops), tops
    assert coord.wait_idle() == 0


def test_logprob_token_ids_beyond_what_the_token_route_returns_are_a_400(coord: CoordinatorServer) -> None:
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(logprob_token_ids=list(range(100, 120))),
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_token_ids", r.text
    ok = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(logprob_token_ids=list(range(100, 119))),
                    timeout=60)
    assert ok.status_code == 200, ok.text
    assert all(len(e["top_logprobs"]) == 20 for e in ok.json()["choices"][0]["logprobs"]["content"])


@pytest.mark.parametrize("extra", [{"top_logprobs": 2}, {"logprob_token_ids": IDS},
                                   {"top_logprobs": 2, "include_reasoning": False}],
                         ids=["top_logprobs", "logprob_token_ids", "include_reasoning_false"])
def test_streamed_chat_logprobs_through_a_tool_parser_equal_native(
        vllm_stack: VllmStack, tool_stack: ToolStack, coordinator_factory: CoordinatorFactory,
        extra: dict[str, Any]) -> None:
    url = str(tool_stack.render.url)
    coord = coordinator_factory(url, [vllm_stack.engine.url], render={"url": url, "parsers": True})
    body = chat(stream=True, max_tokens=12, **extra)
    ours = positions(httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=120), True, "chat")
    native = positions(httpx.post(f"{tool_stack.native.url}/v1/chat/completions", json=body, timeout=120),
                       True, "chat")
    assert ours == native
    assert len(ours) == (0 if extra.get("include_reasoning") is False else 12)
    assert coord.wait_idle() == 0
