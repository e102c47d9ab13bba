"""Simulator mode "context": a replay request `prompt + first k outputs` continues the original output.

That is the property a greedy real model has and the one a mid-stream relay depends on, so relay tests
on simulators can compare a faulted stream with the unfaulted one token for token.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from token_engine.simulator import SimConfig, build_app
from token_engine.simulator.config import _SMOLLM2_WORD_IDS
from token_engine.simulator.output_model import make_source
from token_engine.simulator.wire import sse_payloads

GEN = "/inference/v1/generate"
# SmolLM2 chat prompt: <|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n
CHAT_PROMPT = [1, 4093, 198, 19556, 905, 2, 198, 1, 520, 9531, 198]


def _client(config: SimConfig) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(config)), base_url="http://sim")


async def _generate(c: httpx.AsyncClient, prompt: list[int], **sp: Any) -> tuple[list[int], str, Any]:
    """(output ids, finish_reason, stop_reason) of a streamed request, as a coordinator reads them."""
    body = {"token_ids": prompt, "sampling_params": sp, "stream": True}
    r = await c.post(GEN, json=body)
    assert r.status_code == 200, r.text
    ids: list[int] = []
    finish, stop = "", None
    for payload in sse_payloads(r.text):
        if payload == "[DONE]":
            continue
        choice = json.loads(payload)["choices"][0]
        ids.extend(choice["token_ids"])
        if choice["finish_reason"] is not None:
            finish, stop = choice["finish_reason"], choice["stop_reason"]
    return ids, finish, stop


@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_replay_of_any_prefix_continues_the_original(temperature: float) -> None:
    async with _client(SimConfig(mode="context")) as c:
        sp = {"max_tokens": 24, "temperature": temperature, "seed": 7}
        full, finish, _ = await _generate(c, CHAT_PROMPT, **sp)
        assert len(full) == 24 and finish == "length"
        assert set(full) <= set(_SMOLLM2_WORD_IDS)
        assert len(set(full)) > 5  # not a constant stream: a lost or repeated token would show
        for k in range(1, 24):
            rest, finish, _ = await _generate(c, CHAT_PROMPT + full[:k], **{**sp, "max_tokens": 24 - k})
            assert rest == full[k:], k
            assert finish == "length"


async def test_eos_after_configured_length_is_a_function_of_context() -> None:
    async with _client(SimConfig(mode="context", context_eos_after=10)) as c:
        full, finish, stop = await _generate(c, CHAT_PROMPT, max_tokens=100, temperature=0)
        # The tail after the last special id is `assistant\n` (3 tokens) + the output; EOS is kept.
        assert len(full) == 10 - 3 + 1 and full[-1] == 2
        assert (finish, stop) == ("stop", 2)
        for k in (1, 4, 7):
            rest, finish, stop = await _generate(c, CHAT_PROMPT + full[:k], max_tokens=100 - k, temperature=0)
            assert rest == full[k:] and (finish, stop) == ("stop", 2)


async def test_min_tokens_reduced_by_the_replayed_prefix_gives_the_same_tail() -> None:
    async with _client(SimConfig(mode="context", context_eos_after=5)) as c:
        full, finish, _ = await _generate(c, CHAT_PROMPT, max_tokens=50, min_tokens=6, temperature=0)
        assert finish == "stop" and len(full) > 6
        rest, _, _ = await _generate(c, CHAT_PROMPT + full[:4], max_tokens=46, min_tokens=2, temperature=0)
        assert rest == full[4:]


def test_sampled_choices_differ_and_greedy_ignores_the_seed() -> None:
    cfg = SimConfig(mode="context")

    def run(**kw: Any) -> list[int]:
        src = make_source(cfg, CHAT_PROMPT, **kw)
        return [src.next_token(frozenset()) for _ in range(12)]

    assert run(seed=1, index=0, temperature=0.0) == run(seed=2, index=1, temperature=0.0)
    assert run(seed=1, index=0, temperature=1.0) != run(seed=1, index=1, temperature=1.0)
    assert run(seed=1, index=0, temperature=1.0) == run(seed=1, index=0, temperature=1.0)
