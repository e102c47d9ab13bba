"""LoRA adapters on real vLLM engines, side by side with native ``vllm serve --enable-lora``.

Two adapters for SmolLM2 are written locally (``token_engine.adapter_prep``: PEFT's format, seeded
weights that change greedy output), plus one whose rank exceeds the engines' ``--max-lora-rank``.
A token-only engine runs with ``--enable-lora --max-loras 1 --max-cpu-loras 2`` and runtime loading
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), holding no adapter at start; the reference is a scale-out
``vllm serve`` with the same flags started with ``--lora-modules`` naming both. Through the coordinator
(real render sidecar, base model's template) every answer equals native's, stream and not, for both
adapters and the base, on one engine (loading on demand and evicting: one adapter at a time) and across
two (the scale-out engine serves ``/inference/v1/generate`` too, so it is the second engine there: two
more engines beside the session's would not fit this machine's memory).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import MAX_MODEL_LEN, SERVED, CoordinatorFactory, _echo, _ready
from tests.support import CoordinatorServer, free_port, sse_events, streamed_text
from token_engine.adapter_prep import make_adapter

pytestmark = pytest.mark.e2e

LORA_FLAGS = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1", "--max-cpu-loras", "2"]
PROMPTS = ["Tell me about cats.", "What is the capital of France?"]


@dataclass
class LoraStack:
    adapters: dict[str, Path]   # name → folder (a1, a2 change output; wide has rank 16)
    engine: Any                 # token-only, runtime loading, no adapter at start
    native: Any                 # vllm serve --enable-lora --lora-modules a1=... a2=... (runtime loading too)


@pytest.fixture(scope="module")
def lora_stack(model_dir: Path, logs_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoraStack]:
    from token_engine.launch import VllmEngine

    root = tmp_path_factory.mktemp("adapters")
    adapters = {"a1": make_adapter(model_dir, root / "a1", seed=1), "a2": make_adapter(model_dir, root / "a2", seed=2),
                "wide": make_adapter(model_dir, root / "wide", seed=3, rank=16)}
    runtime = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    engine = VllmEngine(model_dir, port=free_port(), served_model_name=SERVED, mode="tokens-only",
                        max_model_len=MAX_MODEL_LEN, log_path=logs_dir / "lora-engine.log", echo=_echo(),
                        extra_args=LORA_FLAGS, env_overrides=runtime, name="lora-engine")
    modules = [f"{name}={adapters[name]}" for name in ("a1", "a2")]
    native = VllmEngine(model_dir, port=free_port(), served_model_name=SERVED, mode="scale-out",
                        max_model_len=MAX_MODEL_LEN, log_path=logs_dir / "lora-native.log", echo=_echo(),
                        extra_args=[*LORA_FLAGS, "--lora-modules", *modules], env_overrides=runtime,
                        name="lora-native")
    started = [engine, native]
    try:
        for e in started:
            e.start()
        for e in started:
            _ready(e)
        yield LoraStack(adapters, engine, native)
    finally:
        for e in started:
            e.stop()


def start(factory: CoordinatorFactory, render: Any, stack: LoraStack, engines: list[Any],
          **overrides: Any) -> CoordinatorServer:
    adapters = [{"name": n, "path": str(p)} for n, p in stack.adapters.items()]
    return factory(str(render.url), [e.url for e in engines], engine_client={"health_interval_s": 0.5},
                   models=[{"name": SERVED, "adapters": adapters}], **overrides)


def chat(model: str, prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
            "temperature": 0, **extra}


def answer(url: str, body: dict[str, Any]) -> str:
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == body["model"]
    return str(r.json()["choices"][0]["message"]["content"])


def streamed(url: str, body: dict[str, Any]) -> str:
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120)
    assert r.status_code == 200, r.text
    events = sse_events(r)
    assert {e["model"] for e in events if isinstance(e, dict)} == {body["model"]}
    return streamed_text(events)[0]


def registered(engine: Any) -> set[str]:
    cards = httpx.get(f"{engine.url}/v1/models", timeout=10).json()["data"]
    return {c["id"] for c in cards if c.get("parent")}


def test_adapters_answer_as_native_serve_does(lora_stack: LoraStack, render_sidecar: Any,
                                              coordinator_factory: CoordinatorFactory) -> None:
    """One engine that may run one adapter at a time: each request for the other adapter unloads the
    idle one and loads its own, and every answer (greedy) equals native's, stream and not; the
    adapters' answers differ from the base model's, so the adapter really ran."""
    engine = lora_stack.engine
    coord = start(coordinator_factory, render_sidecar, lora_stack, [engine])
    native = lora_stack.native.url
    for prompt in PROMPTS:
        texts = {}
        for model in ("a1", SERVED, "a2", "a1"):
            body = chat(model, prompt)
            expected = answer(native, body)
            assert answer(coord.url, body) == expected, (model, prompt)
            assert streamed(coord.url, body) == expected, (model, prompt)
            texts[model] = expected
        assert texts["a1"] != texts[SERVED] or texts["a2"] != texts[SERVED], "no adapter changed the answer"
    assert registered(engine) <= {"a1", "a2"} and len(registered(engine)) == 1, "one adapter kept at a time"
    evictions = coord.components.metrics.registry.get_sample_value(
        "coordinator_lora_evictions_total", {"engine": engine.url})
    assert evictions is not None and evictions >= 3
    completion = httpx.post(f"{coord.url}/v1/completions", timeout=120,
                            json={"model": "a2", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0})
    reference = httpx.post(f"{native}/v1/completions", timeout=120,
                           json={"model": "a2", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0})
    assert completion.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]


def test_an_adapter_the_engine_cannot_take_is_a_400_and_the_engine_lives_on(
        lora_stack: LoraStack, render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """Rank 16 on engines started with --max-lora-rank 8: vLLM answers the load 500; the client gets a
    400 naming the adapter (from each engine tried), the engines stay healthy and serve the base."""
    engines = [lora_stack.engine, lora_stack.native]
    coord = start(coordinator_factory, render_sidecar, lora_stack, engines)
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat("wide", PROMPTS[0]), timeout=120)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "wide" in message and "rank" in message.lower()
    for e in engines:
        assert httpx.get(f"{e.url}/health", timeout=10).status_code == 200
        assert "wide" not in registered(e)
    assert answer(coord.url, chat(SERVED, PROMPTS[1])) == answer(lora_stack.native.url, chat(SERVED, PROMPTS[1]))


def test_across_two_engines_each_adapter_stays_where_it_was_loaded(
        lora_stack: LoraStack, render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """Alternating requests for two adapters over two engines that may each run one, both holding
    none at first: after the first two loads every request finds its adapter where it is (no further
    load), and the answers stay native's. Last in this module: it unloads the reference's adapters."""
    expected = {m: answer(lora_stack.native.url, chat(m, PROMPTS[0])) for m in ("a1", "a2")}
    engines = [lora_stack.engine, lora_stack.native]
    for e in engines:
        for name in registered(e):
            assert httpx.post(f"{e.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30).is_success
    coord = start(coordinator_factory, render_sidecar, lora_stack, engines)
    for _ in range(3):
        for m in ("a1", "a2"):
            assert answer(coord.url, chat(m, PROMPTS[0])) == expected[m]
    sample = coord.components.metrics.registry.get_sample_value
    assert sample("coordinator_lora_placements_total", {"residency": "loaded"}) == 2
    assert sample("coordinator_lora_placements_total", {"residency": "held"}) == 4
    holders = [registered(e) for e in engines]
    assert sorted(map(sorted, holders)) == [["a1"], ["a2"]], holders
