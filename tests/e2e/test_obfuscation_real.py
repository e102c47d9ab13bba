"""Token obfuscation on a real vLLM engine serving the key-permuted copy of SmolLM2.

``write_obfuscated_copy`` permutes the embedding rows (the LM head is tied) and maps EOS/BOS/pad in the
copy's configs; a ``--tokens-only`` engine serves it. The engine then works in physical ids only:
semantic ids sent to it directly give another answer. Through a coordinator with obfuscation on,
greedy answers (text, finish reason, usage, logprobs) equal those of a coordinator without
obfuscation in front of the session's plain engine, and what went on the wire were physical ids.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from coordinator.config import ModelSettings
from coordinator.contracts.permutation import KeyedPermutation
from coordinator.pipeline.engines.client import EngineClient
from coordinator.pipeline.obfuscation import request_to_physical
from tests.conftest import MAX_MODEL_LEN, SERVED, VllmStack, _echo, make_settings
from tests.support import CoordinatorServer, free_port, sse_events, streamed_text

pytestmark = pytest.mark.e2e

KEY = bytes(range(100, 132))


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("obfuscation") / "token.key"
    path.write_bytes(KEY)
    return path


@pytest.fixture(scope="module")
def perm(key_file: Path, model_dir: Path) -> KeyedPermutation:
    from coordinator.contracts.permutation import config_vocab_size

    size = config_vocab_size(model_dir)
    assert size is not None
    return KeyedPermutation.from_key_file(size, key_file)


@pytest.fixture(scope="module")
def obfuscated_engine(request: pytest.FixtureRequest, model_dir: Path, logs_dir: Path, key_file: Path,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The permuted copy, served by its own --tokens-only engine (booting next to the session stack)."""
    from token_engine.launch import VllmEngine
    from token_engine.model_prep import write_obfuscated_copy

    copy = write_obfuscated_copy(model_dir, tmp_path_factory.mktemp("obfuscated") / "model", key_file)
    engine = VllmEngine(copy, port=free_port(), served_model_name=SERVED, mode="tokens-only",
                        max_model_len=MAX_MODEL_LEN, log_path=logs_dir / "obfuscated.log", echo=_echo(),
                        name="obfuscated")
    try:
        engine.start()
        request.getfixturevalue("vllm_stack")  # boots in parallel with this engine
        engine.wait_ready(timeout=600)
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def coords(vllm_stack: VllmStack, obfuscated_engine: Any, model_dir: Path,
           key_file: Path) -> Iterator[tuple[CoordinatorServer, CoordinatorServer]]:
    off = make_settings(vllm_stack.render_url, [vllm_stack.engine.url])
    on = make_settings(vllm_stack.render_url, [obfuscated_engine.url],
                       models=[ModelSettings(name=SERVED, aliases=["gpt-4o-mini"], path=str(model_dir))],
                       obfuscation={"enabled": True, "key_file": str(key_file)})
    with CoordinatorServer(off) as a, CoordinatorServer(on) as b:
        yield a, b


def render(vllm_stack: VllmStack, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{vllm_stack.render_url}/v1/chat/completions/render", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def generate(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}/inference/v1/generate", json={**body, "stream": False}, timeout=180)
    assert r.status_code == 200, r.text
    return dict(r.json()["choices"][0])


def question(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "temperature": 0, "max_tokens": 24, "messages": [{"role": "user", "content": text}],
            **extra}


def test_the_copy_computes_in_physical_ids(vllm_stack: VllmStack, obfuscated_engine: Any,
                                           perm: KeyedPermutation) -> None:
    """Engine level: physical ids in give the plain engine's answer, permuted; semantic ids do not."""
    semantic = render(vllm_stack, question("What is the capital of France?", max_tokens=12))
    plain = generate(vllm_stack.engine.url, semantic)
    physical = generate(obfuscated_engine.url, request_to_physical(semantic, perm))
    assert physical["token_ids"] == perm.to_physical(plain["token_ids"]) != plain["token_ids"]
    assert physical["finish_reason"] == plain["finish_reason"]
    unmapped = generate(obfuscated_engine.url, semantic)
    assert unmapped["token_ids"] != perm.to_physical(plain["token_ids"])


CASES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", question("What is the capital of France?")),
    ("/v1/chat/completions", question("Name three colours.", stream=True, stream_options={"include_usage": True})),
    ("/v1/chat/completions", question("What is the capital of France?", stop_token_ids=[30])),  # ".": stops
    ("/v1/chat/completions", question("Count from one to five.", logprobs=True, top_logprobs=3, max_tokens=12)),
    ("/v1/chat/completions", question("Say hello.", stream=True, logprobs=True, top_logprobs=2, max_tokens=8)),
    ("/v1/completions", {"model": SERVED, "prompt": "The three primary colours are", "max_tokens": 16,
                         "temperature": 0}),
    ("/v1/completions", {"model": SERVED, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0,
                         "stream": True, "stream_options": {"include_usage": True}, "stop_token_ids": [30]}),
]


def _logprobs(choices: list[dict[str, Any]], chat: bool) -> list[tuple[str, float, list[str]]]:
    out: list[tuple[str, float, list[str]]] = []
    for c in choices:
        lp = c.get("logprobs")
        if not lp:
            continue
        if chat:
            out += [(e["token"], e["logprob"], [t["token"] for t in e["top_logprobs"]]) for e in lp["content"]]
        else:
            out += [(t, v, []) for t, v in zip(lp["tokens"], lp["token_logprobs"], strict=True)]
    return out


def _same_logprobs(got: list[tuple[str, float, list[str]]], want: list[tuple[str, float, list[str]]]) -> None:
    assert [(t, top) for t, _, top in got] == [(t, top) for t, _, top in want]
    # Same logits in another order: only the softmax's summation order differs.
    assert all(abs(g - w) < 1e-3 for (_, g, _), (_, w, _) in zip(got, want, strict=True))


@pytest.mark.parametrize(("path", "body"), CASES, ids=[f"{'chat' if 'chat' in p else 'completions'}-{i}" for i, (p, _) in enumerate(CASES)])
def test_greedy_outputs_equal_obfuscation_off(coords: tuple[CoordinatorServer, CoordinatorServer],
                                              path: str, body: dict[str, Any]) -> None:
    off, on = coords
    chat = path.endswith("chat/completions")
    want = httpx.post(f"{off.url}{path}", json=body, timeout=180)
    got = httpx.post(f"{on.url}{path}", json=body, timeout=180)
    assert want.status_code == got.status_code == 200, got.text
    if body.get("stream"):
        w, g = sse_events(want), sse_events(got)
        assert g[-1] == "[DONE]" and streamed_text(g, "chat" if chat else "completion")[0]
        assert streamed_text(g, "chat" if chat else "completion") == streamed_text(w, "chat" if chat else "completion")
        finishes = [[c["finish_reason"] for e in x[:-1] for c in e.get("choices", []) if c.get("finish_reason")]
                    for x in (g, w)]
        assert finishes[0] == finishes[1] and len(finishes[0]) == 1
        if body.get("stream_options"):
            assert g[-2]["usage"] == w[-2]["usage"]
        gl = _logprobs([c for e in g[:-1] for c in e.get("choices", [])], chat)
        wl = _logprobs([c for e in w[:-1] for c in e.get("choices", [])], chat)
    else:
        gj, wj = got.json(), want.json()
        key = "message" if chat else "text"
        assert [c[key] for c in gj["choices"]] == [c[key] for c in wj["choices"]]
        assert [c["finish_reason"] for c in gj["choices"]] == [c["finish_reason"] for c in wj["choices"]]
        assert gj["usage"] == wj["usage"]
        gl, wl = _logprobs(gj["choices"], chat), _logprobs(wj["choices"], chat)
    _same_logprobs(gl, wl)
    assert bool(gl) == bool(body.get("logprobs"))
    if body.get("stop_token_ids") and not body.get("stream"):
        assert got.json()["choices"][0]["finish_reason"] == "stop"
    assert on.wait_idle() == 0


def test_ids_on_the_wire_are_physical(coords: tuple[CoordinatorServer, CoordinatorServer],
                                      vllm_stack: VllmStack, obfuscated_engine: Any, perm: KeyedPermutation,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """What the coordinator handed to HTTP for the obfuscated engine, and what that engine logged."""
    _, on = coords
    sent: list[dict[str, Any]] = []
    original = EngineClient.stream

    @contextlib.asynccontextmanager
    async def spy(self: EngineClient, engine: Any, body: dict[str, Any], request_id: str,
                  include_usage: bool) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        sent.append(body)
        async with original(self, engine, body, request_id, include_usage) as chunks:
            yield chunks

    monkeypatch.setattr(EngineClient, "stream", spy)
    body = question("What is the capital of Italy?", stream=True, stop_token_ids=[30], max_tokens=8)
    r = httpx.post(f"{on.url}/v1/chat/completions", json=body, timeout=180)
    assert r.status_code == 200 and streamed_text(sse_events(r))[0]
    semantic = render(vllm_stack, body)["token_ids"]
    assert len(sent) == 1
    assert sent[0]["token_ids"] == perm.to_physical(semantic)
    assert sum(a == b for a, b in zip(sent[0]["token_ids"], semantic, strict=True)) < 3
    stop = perm.to_physical([30])[0]
    assert sent[0]["sampling_params"]["stop_token_ids"] == [stop]
    log = Path(obfuscated_engine.log_path).read_text(errors="replace")
    assert f"stop_token_ids=[{stop}]" in log and "stop_token_ids=[30]" not in log
