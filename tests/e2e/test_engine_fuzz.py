"""Fuzzing the fields that reach a real token-only engine: the engine must survive all of it.

A ``--tokens-only`` vLLM engine has no tokenizer, so it does not check token ids; one bad id used to
kill it (``OverflowError`` / ``IndexError`` in the worker → EngineDeadError). Every request below goes
through the coordinator to the real engine the e2e session started; each must be answered with a
200 or an OpenAI 4xx (never a 5xx or a dropped connection), and afterwards the engine still answers.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import SERVED, VllmStack, make_settings
from tests.support import CoordinatorServer

pytestmark = pytest.mark.e2e

VOCAB = 49152  # SmolLM2-135M-Instruct (config.json); the coordinator learns it from the model folder
HOSTILE_IDS: list[Any] = [VOCAB, VOCAB + 1, 2**31 - 1, 2**31, 70368744177663, 2**63, 2**70, -1, -(2**63),
                          1.5, True, "7", None, [3]]


@pytest.fixture(scope="module")
def coord(vllm_stack: VllmStack) -> Iterator[CoordinatorServer]:
    with CoordinatorServer(make_settings(vllm_stack.render_url, [vllm_stack.engine.url],
                                         resilience={"retries": 0})) as server:
        yield server


def fuzz_cases(seed: int = 7) -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(seed)
    cases: list[tuple[str, dict[str, Any]]] = []
    comp = {"model": SERVED, "max_tokens": 2}
    chat = {"model": SERVED, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    for bad in HOSTILE_IDS:
        cases.append(("completions", {**comp, "prompt": [1, bad]}))
        cases.append(("completions", {**comp, "prompt": [[5, 6], [bad]]}))
        for field in ("stop_token_ids", "allowed_token_ids"):
            cases.append(("completions", {**comp, "prompt": "Hi", field: [bad]}))
            cases.append(("chat", {**chat, field: [bad]}))
        cases.append(("chat", {**chat, "logit_bias": {str(bad): 1}}))
    for _ in range(12):  # random in-vocabulary prompts, special tokens included: these are served
        cases.append(("completions", {**comp, "prompt": [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]}))
    extremes: list[dict[str, Any]] = [
        {"temperature": 0}, {"temperature": 2}, {"temperature": 1e-12}, {"top_p": 1e-12}, {"top_k": 2**31 - 1},
        {"top_k": 2**31}, {"top_k": -2}, {"min_p": 1}, {"repetition_penalty": 1e-9}, {"repetition_penalty": 2},
        {"presence_penalty": 2, "frequency_penalty": -2}, {"seed": 2**63 - 1}, {"seed": -(2**63)}, {"seed": 2**64},
        {"n": 128, "max_tokens": 1}, {"n": 129}, {"max_tokens": 2**31 - 1}, {"max_tokens": 2**63}, {"min_tokens": 2**31 - 1},
        {"logprobs": 20}, {"logprobs": 21}, {"logprobs": -1}, {"priority": 2**63 - 1}, {"priority": 2**64},
        {"logit_bias": {"5": 100, "6": -100}}, {"logit_bias": {"5": 1e308}}, {"logit_bias": {"5": float("nan")}},
        {"allowed_token_ids": []}, {"allowed_token_ids": [0]}, {"stop_token_ids": [0, VOCAB - 1]},
        {"cache_salt": "a" * 5000}, {"cache_salt": "x\u0000y"}, {"stop": ["l"] * 64}, {"ignore_eos": True, "min_tokens": 2},
        {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        {"skip_special_tokens": False}, {"return_token_ids": True}, {"add_special_tokens": True},
    ]
    for extra in extremes:
        cases.append(("completions", {**comp, "prompt": "Hello", **extra}))
        if "logprobs" not in extra:
            cases.append(("chat", {**chat, **extra}))
    return cases


def test_hostile_requests_never_break_the_engine(coord: CoordinatorServer, vllm_stack: VllmStack) -> None:
    outcomes: dict[int, int] = {}
    with httpx.Client(base_url=coord.url, timeout=120) as client:
        for kind, body in fuzz_cases():
            path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
            try:
                content = httpx.Request("POST", "/", json=body).content
            except ValueError:  # NaN: send it the way a sloppy JSON encoder would
                content = repr(body).replace("'", '"').replace("nan", "NaN").encode()
            r = client.post(path, content=content, headers={"content-type": "application/json"})
            outcomes[r.status_code] = outcomes.get(r.status_code, 0) + 1
            assert r.status_code in (200, 400), (body, r.status_code, r.text[:300])
            if r.status_code == 400:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}, err
            assert httpx.get(f"{vllm_stack.engine.url}/health", timeout=10).status_code == 200, body
    assert outcomes.get(200, 0) > 20 and outcomes.get(400, 0) > 50, outcomes
    # Afterwards the engine serves a plain request, and nothing is left in flight.
    r = httpx.post(f"{coord.url}/v1/completions", timeout=120,
                   json={"model": SERVED, "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    assert coord.wait_idle() == 0


def test_the_request_that_killed_engines_is_a_400(coord: CoordinatorServer, vllm_stack: VllmStack) -> None:
    r = httpx.post(f"{coord.url}/v1/completions", timeout=60,
                   json={"model": "smollm2-135m-instruct", "prompt": [70368744177663], "max_tokens": 16})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "out of vocabulary" in r.json()["error"]["message"]
    ok = httpx.post(f"{vllm_stack.engine.url}/inference/v1/generate", timeout=60,
                    json={"model": SERVED, "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}})
    assert ok.status_code == 200
