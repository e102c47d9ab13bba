"""P/D handoff between two real CPU vLLM engines (ExampleConnector over a shared directory).

The prefill engine computes the prompt's KV and stops after one token; the decode engine loads that
KV (its ``vllm:external_prefix_cache_hits`` counter shows it) and generates. The answer must be the
same, token for token, as a single union engine's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MAX_MODEL_LEN, SERVED, VllmStack, _echo, make_settings
from tests.support import CoordinatorServer, free_port, sse_events, streamed_text

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pd_pair(model_dir: Path, logs_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from token_engine.launch import VllmEngine

    shared = tmp_path_factory.mktemp("kv-shared")
    connector = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"shared_storage_path": str(shared)}}
    pair = [VllmEngine(model_dir, port=free_port(), served_model_name=SERVED, mode="tokens-only",
                       max_model_len=MAX_MODEL_LEN, log_path=logs_dir / f"{name}.log", echo=_echo(),
                       kv_transfer_config=connector, name=name) for name in ("prefill", "decode")]
    try:
        for e in pair:
            e.start()
        for e in pair:
            e.wait_ready(timeout=600)
        yield pair
    finally:
        for e in pair:
            e.stop()


def counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) if fam.name == name
               for s in fam.samples if s.name.endswith("_total"))


def long_chat(topic: str, **extra: Any) -> dict[str, Any]:
    context = " ".join(f"Note {i}: {topic} item {i} weighs {i * 37 % 101} grams." for i in range(40))
    return {"model": SERVED, "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "system", "content": context},
                         {"role": "user", "content": f"Summarise the {topic} notes in one sentence."}], **extra}


def storable(render_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """ExampleConnector stores a prompt's first ``(L-1)//128*128`` tokens but looks up
    ``(L-2)//128*128``: when ``L-1`` is a multiple of the block size the two keys differ and the decode
    engine never finds the stored KV (a quirk of that debug connector, not of the handoff). Nudge the
    prompt out of that case."""
    while True:
        ids = httpx.post(f"{render_url}/v1/chat/completions/render", json=body, timeout=30).json()["token_ids"]
        if (len(ids) - 1) % 128:
            return body
        body["messages"][-1]["content"] += " Thanks."


def test_handoff_output_equals_union(vllm_stack: VllmStack, pd_pair: Any) -> None:
    prefill, decode = pd_pair
    engines = [{"url": prefill.url, "role": "prefill"}, {"url": decode.url, "role": "decode"}]
    pd_settings = make_settings(vllm_stack.render_url, [], engines=engines,
                                topology={"mode": "handoff", "pd_min_uncached_tokens": 0})
    union_settings = make_settings(vllm_stack.render_url, [vllm_stack.engine.url])
    loaded_before = counter(decode.url, "vllm:external_prefix_cache_hits")
    with CoordinatorServer(pd_settings) as pd, CoordinatorServer(union_settings) as union:
        for body in (long_chat("apple"), long_chat("pear", stream=True, stream_options={"include_usage": True})):
            body = storable(vllm_stack.render_url, body)
            got = httpx.post(f"{pd.url}/v1/chat/completions", json=body, timeout=180)
            want = httpx.post(f"{union.url}/v1/chat/completions", json=body, timeout=180)
            assert got.status_code == want.status_code == 200, got.text
            if body.get("stream"):
                g, w = sse_events(got), sse_events(want)
                assert streamed_text(g) == streamed_text(w) and streamed_text(g)[0]
                assert g[-2]["usage"] == w[-2]["usage"]
            else:
                g, w = got.json(), want.json()
                assert g["choices"][0]["message"] == w["choices"][0]["message"]
                assert g["choices"][0]["finish_reason"] == w["choices"][0]["finish_reason"]
                assert g["usage"] == w["usage"]
        paths = {s.labels["path"]: s.value for fam in pd.components.metrics.registry.collect()
                 if fam.name == "coordinator_pd_decisions" for s in fam.samples if s.name.endswith("_total")}
        assert paths.get("handoff") == 2
    # The decode engine loaded the prompt KV the prefill engine stored (not a local prefill).
    assert counter(decode.url, "vllm:external_prefix_cache_hits") - loaded_before >= 2 * 128
    # The prefill engine generated one token per request (the prefill leg's max_tokens=1).
    assert counter(prefill.url, "vllm:generation_tokens") == 2


def test_short_prompt_skips_remote_prefill(vllm_stack: VllmStack, pd_pair: Any) -> None:
    """Conditional P/D: below the threshold of uncached tokens the decode engine prefills itself."""
    prefill, decode = pd_pair
    engines = [{"url": prefill.url, "role": "prefill"}, {"url": decode.url, "role": "decode"}]
    settings = make_settings(vllm_stack.render_url, [], engines=engines,
                             topology={"mode": "handoff", "pd_min_uncached_tokens": 512})
    prefill_requests = counter(prefill.url, "vllm:request_success")
    with CoordinatorServer(settings) as pd:
        r = httpx.post(f"{pd.url}/v1/chat/completions", timeout=120,
                       json={"model": SERVED, "messages": [{"role": "user", "content": "Hi!"}],
                             "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert counter(prefill.url, "vllm:request_success") == prefill_requests


def scored(r: httpx.Response, stream: bool) -> tuple[str, list[str], list[float | None]]:
    """Text, logprob tokens and token logprobs of a one-choice completion, JSON or SSE."""
    chunks = [e for e in sse_events(r) if isinstance(e, dict)] if stream else [r.json()]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    return text, [t for lp in lps for t in lp["tokens"]], [v for lp in lps for v in lp["token_logprobs"]]


def test_prompt_scoring_in_a_pd_fleet_equals_union(vllm_stack: VllmStack, pd_pair: Any) -> None:
    """Prompt logprobs need one engine to compute the whole prompt (a decode engine handed the KV
    never does): echo with logprobs, JSON and streamed, is scored decode-only (no prefill leg) and
    equals a union engine's."""
    prefill, decode = pd_pair
    engines = [{"url": prefill.url, "role": "prefill"}, {"url": decode.url, "role": "decode"}]
    pd_settings = make_settings(vllm_stack.render_url, [], engines=engines,
                                topology={"mode": "handoff", "pd_min_uncached_tokens": 0})
    union_settings = make_settings(vllm_stack.render_url, [vllm_stack.engine.url])
    prompt = " ".join(f"Fact {i}: the lighthouse keeper counted {i * 7} ships." for i in range(30))
    prefill_requests = counter(prefill.url, "vllm:request_success")
    with CoordinatorServer(pd_settings) as pd, CoordinatorServer(union_settings) as union:
        for extra in ({}, {"stream": True}):
            body = {"model": SERVED, "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True,
                    "logprobs": 1, **extra}
            got = httpx.post(f"{pd.url}/v1/completions", json=body, timeout=180)
            want = httpx.post(f"{union.url}/v1/completions", json=body, timeout=180)
            assert got.status_code == want.status_code == 200, got.text

            g, w = scored(got, bool(extra)), scored(want, bool(extra))
            assert g[0] == w[0] and g[0].startswith(prompt)
            assert g[1] == w[1] and len(g[1]) > 100 and g[2][0] is None
            assert g[2][1:] == pytest.approx(w[2][1:], abs=0.02)
            if not extra:  # the scoring request itself never had a prefill leg (the stream's rest may)
                assert counter(prefill.url, "vllm:request_success") == prefill_requests
