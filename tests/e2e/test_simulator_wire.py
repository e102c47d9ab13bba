"""The simulated engine must speak the real engine's wire format, field by field."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import SERVED, VllmStack
from token_engine.simulator import SimConfig, SimulatedEngine
from token_engine.simulator.wire import sse_payloads, wire_diff

pytestmark = pytest.mark.e2e

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
          19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="module")
def sim() -> Iterator[SimulatedEngine]:
    with SimulatedEngine(SimConfig(model=SERVED, mode="random", seed=3)) as eng:
        yield eng


def both(stack: VllmStack, sim: SimulatedEngine, body: dict) -> tuple[httpx.Response, httpx.Response]:
    real = httpx.post(f"{stack.engine.url}/inference/v1/generate", json=body, timeout=120)
    fake = httpx.post(f"{sim.url}/inference/v1/generate", json=body, timeout=120)
    return real, fake


@pytest.mark.parametrize("logprobs", [None, 2])
def test_non_streaming_response_has_the_same_fields(vllm_stack: VllmStack, sim: SimulatedEngine,
                                                    logprobs: int | None) -> None:
    sp = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, **({"logprobs": logprobs} if logprobs else {})}
    real, fake = both(vllm_stack, sim, {"request_id": "wire-1", "token_ids": PROMPT, "sampling_params": sp,
                                        "model": SERVED, "return_token_ids": True})
    assert real.status_code == fake.status_code == 200
    assert list(real.json()) == list(fake.json()), "top-level key order differs"
    assert wire_diff(real.json(), fake.json(), numbers_match=True) == []


@pytest.mark.parametrize("options", [{"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True},
                                     None])
def test_stream_frames_have_the_same_fields(vllm_stack: VllmStack, sim: SimulatedEngine,
                                            options: dict | None) -> None:
    body = {"request_id": "wire-2", "token_ids": PROMPT, "stream": True, "stream_options": options,
            "sampling_params": {"max_tokens": 4, "temperature": 0, "ignore_eos": True}}
    real, fake = both(vllm_stack, sim, body)
    assert real.headers["content-type"] == fake.headers["content-type"]
    r_frames, f_frames = sse_payloads(real.content), sse_payloads(fake.content)
    assert len(r_frames) == len(f_frames) and r_frames[-1] == f_frames[-1] == "[DONE]"
    for r, f in zip(r_frames[:-1], f_frames[:-1], strict=True):
        assert wire_diff(r, f, numbers_match=True) == [], (r, f)


@pytest.mark.parametrize("body", [
    {"token_ids": [], "sampling_params": {}},
    {"token_ids": [1, 2], "sampling_params": {"stop": ["x"]}},
    {"token_ids": [1, 2], "sampling_params": {}, "model": "nope"},
    {"token_ids": [1, 2], "sampling_params": {}, "output_mode": "text"},
])
def test_rejections_match(vllm_stack: VllmStack, sim: SimulatedEngine, body: dict) -> None:
    real, fake = both(vllm_stack, sim, body)
    assert real.status_code == fake.status_code
    assert real.json() == fake.json()


def test_abort_matches_only_the_full_engine_id(vllm_stack: VllmStack, sim: SimulatedEngine) -> None:
    for url in (vllm_stack.engine.url, sim.url):
        bad = httpx.post(f"{url}/inference/v1/abort_requests", json={}, timeout=10)
        ok = httpx.post(f"{url}/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-x"]},
                        timeout=10)
        assert (bad.status_code, ok.status_code, ok.content) == (400, 200, b"")
