"""Token obfuscation through the whole coordinator (real render sidecar, simulated engines).

Two simulated engines stand for the same model: a plain one, and one configured as the key-permuted
copy (its EOS and special ids are the physical ones, as ``write_obfuscated_copy`` writes them into a
real model's config). Echo mode repeats the prompt, so the permuted engine echoes physical ids. With
obfuscation on, the engine must receive physical ids while the client gets exactly what a coordinator
without obfuscation returns from the plain engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from coordinator.config import EngineSettings, ModelSettings
from coordinator.contracts.permutation import KeyedPermutation
from tests.conftest import SERVED, CoordinatorFactory
from tests.support import CoordinatorServer, sse_events, streamed_text
from token_engine.simulator import SimConfig, SimulatedEngine

KEY = bytes(range(32))
VOCAB = 49152  # SmolLM2's config.json vocab_size (the permutation covers the embedding rows)
SPECIAL = list(range(17))


@pytest.fixture(scope="module")
def perm() -> KeyedPermutation:
    return KeyedPermutation(VOCAB, KEY)


@pytest.fixture
def engines(perm: KeyedPermutation) -> Iterator[tuple[SimulatedEngine, SimulatedEngine]]:
    t = perm.physical_table()
    plain = SimConfig(model=SERVED)
    permuted = SimConfig(model=SERVED, eos_token_id=t[2], echo_skip_ids=[t[s] for s in SPECIAL],
                         echo_fallback_token_id=t[plain.echo_fallback_token_id])
    with SimulatedEngine(plain) as a, SimulatedEngine(permuted) as b:
        yield a, b


@pytest.fixture
def coords(render_sidecar: Any, model_dir: Path, engines: tuple[SimulatedEngine, SimulatedEngine],
           coordinator_factory: CoordinatorFactory, tmp_path: Path) -> tuple[CoordinatorServer, CoordinatorServer]:
    key = tmp_path / "token.key"
    key.write_bytes(KEY)
    plain, permuted = engines
    off = coordinator_factory(render_sidecar.url, [plain.url])
    # models[].path: the permutation's size is read from the model folder's config.json.
    on = coordinator_factory(render_sidecar.url, [permuted.url],
                             models=[ModelSettings(name=SERVED, aliases=["gpt-4o-mini"], path=str(model_dir))],
                             obfuscation={"enabled": True, "key_file": str(key)})
    return off, on


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "temperature": 0, "max_tokens": 12,
            "messages": [{"role": "user", "content": "Paris is the capital of France, said the guide."}], **extra}


def post(coord: CoordinatorServer, path: str, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(f"{coord.url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_engine_sees_physical_ids_and_client_sees_the_same_answer(
        render_sidecar: Any, coords: tuple[CoordinatorServer, CoordinatorServer],
        engines: tuple[SimulatedEngine, SimulatedEngine], perm: KeyedPermutation) -> None:
    off, on = coords
    plain, permuted = engines
    semantic = httpx.post(f"{render_sidecar.url}/v1/chat/completions/render", timeout=30,
                          json=chat(model=SERVED)).json()["token_ids"]

    want = post(off, "/v1/chat/completions", chat()).json()
    got = post(on, "/v1/chat/completions", chat()).json()
    assert plain.state()["last_ids"]["token_ids"] == semantic
    sent = permuted.state()["last_ids"]["token_ids"]
    assert sent == perm.to_physical(semantic) and sent != semantic
    assert sum(a == b for a, b in zip(sent, semantic, strict=True)) < 3
    assert got["choices"] == want["choices"] and got["usage"] == want["usage"]
    assert got["choices"][0]["message"]["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_ids_and_logprobs(coords: tuple[CoordinatorServer, CoordinatorServer],
                                     render_sidecar: Any, engines: tuple[SimulatedEngine, SimulatedEngine],
                                     perm: KeyedPermutation, stream: bool) -> None:
    off, on = coords
    _, permuted = engines
    prompt = "one two three four five six seven"
    ids = httpx.post(f"{render_sidecar.url}/v1/completions/render", timeout=30,
                     json={"model": SERVED, "prompt": prompt}).json()[0]["token_ids"]
    stop_id = ids[3]  # the echo reaches it after three tokens
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 10, "temperature": 0, "stop_token_ids": [stop_id],
            "logprobs": 1, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    want, got = post(off, "/v1/completions", body), post(on, "/v1/completions", body)
    assert permuted.state()["last_ids"]["stop_token_ids"] == perm.to_physical([stop_id])
    if stream:
        w, g = sse_events(want), sse_events(got)
        assert streamed_text(g, "completion") == streamed_text(w, "completion")
        assert [c["finish_reason"] for e in g[:-1] for c in e["choices"] if c.get("finish_reason")] == ["stop"]
        assert g[-2]["usage"] == w[-2]["usage"]
        tokens = [t for e in g[:-1] for c in e["choices"] for t in (c.get("logprobs") or {}).get("tokens", [])]
        assert tokens == [t for e in w[:-1] for c in e["choices"]
                          for t in (c.get("logprobs") or {}).get("tokens", [])]
        text = streamed_text(g, "completion")[0]
    else:
        w, g = want.json(), got.json()
        assert g["choices"][0]["text"] == w["choices"][0]["text"] and g["usage"] == w["usage"]
        assert g["choices"][0]["finish_reason"] == "stop" == w["choices"][0]["finish_reason"]
        tokens, text = g["choices"][0]["logprobs"]["tokens"], g["choices"][0]["text"]
        assert tokens == w["choices"][0]["logprobs"]["tokens"]
    # The sampled token of every logprob entry came back as its semantic id: its strings spell the text
    # (then the stop token, which the text leaves out).
    assert text and "".join(tokens) == text + " four"
    assert on.wait_idle() == 0



@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_with_obfuscation_on_is_a_400_even_on_an_engine_said_to_run_grammars(
        render_sidecar: Any, model_dir: Path, engines: tuple[SimulatedEngine, SimulatedEngine],
        coordinator_factory: CoordinatorFactory, tmp_path: Path, stream: bool) -> None:
    """A grammar is compiled against the real vocabulary and the engine would apply it to permuted
    ids: refused with a 400 naming the field before anything is sent, never a silently wrong output."""
    key = tmp_path / "token.key"
    key.write_bytes(KEY)
    _plain, permuted = engines
    on = coordinator_factory(render_sidecar.url, [],
                             engines=[EngineSettings(url=permuted.url, tokenizer=True)],
                             models=[ModelSettings(name=SERVED, aliases=["gpt-4o-mini"], path=str(model_dir))],
                             obfuscation={"enabled": True, "key_file": str(key)})
    calls = permuted.state()["generate_calls"]
    r = httpx.post(f"{on.url}/v1/chat/completions", timeout=60,
                   json=chat(stream=stream, structured_outputs={"choice": ["yes", "no"]}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    assert "obfuscation" in r.json()["error"]["message"]
    assert permuted.state()["generate_calls"] == calls
    assert post(on, "/v1/chat/completions", chat()).json()["choices"][0]["message"]["content"]
