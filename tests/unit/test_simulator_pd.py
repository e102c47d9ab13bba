"""P/D transfer lifetime: a finished prefill pins its blocks until the decode side pulls them or the lease
ends, and aborting the finished prefill frees nothing (as in vLLM 0.32's NixlConnector + scheduler)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from token_engine.simulator import SimConfig, SimulatedEngine, build_app
from token_engine.simulator.__main__ import parse_args

GEN = "/inference/v1/generate"
P_LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
         "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
PROMPT = list(range(100, 110))  # 10 tokens: ceil(10/4) = 3 blocks with block_size 4
LABELS = '{engine="0",model_name="smollm2-135m-instruct"}'


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name + LABELS)} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def _client(config: SimConfig) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(config)), base_url="http://sim")


@pytest.fixture
async def prefill() -> AsyncIterator[httpx.AsyncClient]:
    async with _client(SimConfig(kv_role="prefill", block_size=4, kv_lease_s=30)) as c:
        yield c


async def prefill_leg(c: httpx.AsyncClient, rid: str = "p1", **sp: Any) -> dict[str, Any]:
    r = await c.post(
        GEN,
        json={"request_id": rid, "token_ids": PROMPT, "sampling_params": {"max_tokens": 1, **sp},
              "kv_transfer_params": P_LEG},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    params: dict[str, Any] = r.json()["kv_transfer_params"]
    return params


async def state(c: httpx.AsyncClient) -> dict[str, Any]:
    data: dict[str, Any] = (await c.get("/sim/state")).json()
    return data


async def test_finished_prefill_pins_its_blocks(prefill: httpx.AsyncClient) -> None:
    params = await prefill_leg(prefill)
    assert "sim_peer_url" not in params  # the wire stays vLLM's unless advertise_peer_url
    s = await state(prefill)
    [pin] = s["pinned_transfers"]
    assert pin["remote_request_id"] == params["remote_request_id"]
    assert (pin["request_id"], pin["blocks"]) == ("generate-tokens-p1", 3)
    assert 29 < pin["expires_in_s"] <= 30
    assert s["kv_transfer_pinned_blocks"] == 3 and s["running"] == []
    text = (await prefill.get("/metrics")).text
    assert metric(text, "sim:kv_transfer_pinned_blocks") == 3
    assert metric(text, "sim:kv_transfer_pinned_requests") == 1
    assert metric(text, "vllm:kv_cache_usage_perc") == 3 / 4096  # pinned blocks are not free
    assert metric(text, "vllm:num_requests_running") == 0


async def test_consume_releases_once(prefill: httpx.AsyncClient) -> None:
    rid = (await prefill_leg(prefill))["remote_request_id"]
    await prefill_leg(prefill, "p2")
    r = await prefill.post("/sim/kv_transfer/consume", json={"remote_request_id": rid})
    assert r.json() == {"released": True, "blocks": 3}
    r = await prefill.post("/sim/kv_transfer/consume", json={"remote_request_id": rid})
    assert r.json() == {"released": False, "blocks": 0}
    s = await state(prefill)
    assert [p["request_id"] for p in s["pinned_transfers"]] == ["generate-tokens-p2"]
    assert s["kv_transfer_released"] == {"consumed": 1, "expired": 0}
    assert (await prefill.post("/sim/kv_transfer/consume", json={})).status_code == 400


async def test_lease_expiry_releases() -> None:
    async with _client(SimConfig(kv_role="prefill", block_size=4, kv_lease_s=0.2)) as c:
        rid = (await prefill_leg(c))["remote_request_id"]
        assert (await state(c))["kv_transfer_pinned_blocks"] == 3
        await asyncio.sleep(0.3)
        assert metric((await c.get("/metrics")).text, "sim:kv_transfer_pinned_blocks") == 0
        s = await state(c)
        assert s["pinned_transfers"] == [] and s["kv_transfer_released"] == {"consumed": 0, "expired": 1}
        # A decode engine that comes too late finds nothing to release.
        r = await c.post("/sim/kv_transfer/consume", json={"remote_request_id": rid})
        assert r.json()["released"] is False


async def test_abort_of_a_finished_prefill_frees_nothing(prefill: httpx.AsyncClient) -> None:
    """vLLM: the API server forgot the finished request and Scheduler.finish_requests skips finished
    requests, so neither the engine id nor the remote_request_id releases the blocks; only the lease does."""
    rid = (await prefill_leg(prefill))["remote_request_id"]
    for ids in (["generate-tokens-p1"], [rid], ["p1"]):
        for route in ("/inference/v1/abort_requests", "/abort_requests"):
            assert (await prefill.post(route, json={"request_ids": ids})).status_code == 200
    assert (await state(prefill))["kv_transfer_pinned_blocks"] == 3


async def test_abort_while_prefilling_pins_nothing() -> None:
    async with _client(SimConfig(kv_role="prefill", block_size=4, decode_s_per_token=0.02)) as c:
        task = asyncio.ensure_future(prefill_leg(c, "slow", max_tokens=200))
        deadline = time.monotonic() + 3
        while not (await state(c))["running"]:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await c.post("/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-slow"]})
        assert await task is None  # aborted legs return no kv_transfer_params...
        assert (await state(c))["pinned_transfers"] == []  # ...and hold nothing


async def wait_for(eng: SimulatedEngine, pred: Any, within: float = 3.0) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while True:
        s = eng.state()
        if pred(s) or time.monotonic() > deadline:
            return s
        await asyncio.sleep(0.02)


async def test_decode_simulator_consumes_via_sim_peer_url() -> None:
    p_cfg = SimConfig(kv_role="prefill", block_size=4, advertise_peer_url=True)
    d_cfg = SimConfig(kv_role="decode", block_size=4, prefill_s_per_token=0.05, enable_prompt_tokens_details=True)
    with SimulatedEngine(p_cfg) as p_eng, SimulatedEngine(d_cfg) as d_eng:
        async with httpx.AsyncClient(timeout=10) as http:
            # Warm P's cache so the leg has prefix hits to hand over (8 of 10 tokens).
            await http.post(f"{p_eng.url}{GEN}", json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}})
            r = await http.post(
                f"{p_eng.url}{GEN}",
                json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}, "kv_transfer_params": P_LEG},
            )
            params = r.json()["kv_transfer_params"]
            assert list(params)[-2:] == ["remote_prefill_cached_tokens", "sim_peer_url"]
            assert params["sim_peer_url"] == p_eng.url and params["remote_prefill_cached_tokens"] == 8
            assert p_eng.state()["kv_transfer_pinned_blocks"] == 3

            t0 = time.monotonic()
            r = await http.post(
                f"{d_eng.url}{GEN}",
                json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}, "kv_transfer_params": params},
            )
            assert time.monotonic() - t0 < 0.3  # 10 local prefill tokens would cost 0.5 s
            # D reports the P side's hits (vLLM's OutputProcessor uses remote_prefill_cached_tokens).
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
            s = await wait_for(p_eng, lambda s: not s["pinned_transfers"])
            assert s["kv_transfer_released"] == {"consumed": 1, "expired": 0}

            # Without remote_prefill_cached_tokens, D counts the whole prompt as cached (local + external).
            params = {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}
            r = await http.post(
                f"{d_eng.url}{GEN}",
                json={"token_ids": [t + 1 for t in PROMPT], "sampling_params": {"max_tokens": 1},
                      "kv_transfer_params": params},
            )  # fmt: skip
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT)


async def test_decode_aborted_while_queued_still_releases_the_prefill() -> None:
    """NixlConnector request_finished on D with do_remote_prefill still set tells P to free its blocks."""
    p_cfg = SimConfig(kv_role="prefill", block_size=4, advertise_peer_url=True)
    d_cfg = SimConfig(kv_role="decode", block_size=4, max_concurrency=1, decode_s_per_token=0.02)
    with SimulatedEngine(p_cfg) as p_eng, SimulatedEngine(d_cfg) as d_eng:
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.post(
                f"{p_eng.url}{GEN}",
                json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}, "kv_transfer_params": P_LEG},
            )
            params = r.json()["kv_transfer_params"]
            busy = asyncio.ensure_future(
                http.post(f"{d_eng.url}{GEN}", json={"request_id": "busy", "token_ids": [5, 6],
                                                      "sampling_params": {"max_tokens": 500}})
            )  # fmt: skip
            await wait_for(d_eng, lambda s: s["running"])
            queued = asyncio.ensure_future(
                http.post(f"{d_eng.url}{GEN}", json={"request_id": "d1", "token_ids": PROMPT,
                                                      "sampling_params": {"max_tokens": 1}, "kv_transfer_params": params})
            )  # fmt: skip
            await wait_for(d_eng, lambda s: s["waiting"])
            assert p_eng.state()["kv_transfer_pinned_blocks"] == 3  # not pulled while D has no slot
            await http.post(f"{d_eng.url}/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-d1"]})
            s = await wait_for(p_eng, lambda s: not s["pinned_transfers"])
            assert s["kv_transfer_released"]["consumed"] == 1
            await http.post(f"{d_eng.url}/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-busy"]})
            await asyncio.gather(busy, queued)


def test_cli_flags_for_pd_lifetime() -> None:
    _, cfg = parse_args(["--kv-role", "prefill", "--kv-lease-s", "5", "--advertise-peer-url"])
    assert (cfg.kv_role, cfg.kv_lease_s, cfg.advertise_peer_url) == ("prefill", 5.0, True)
    _, cfg = parse_args([])
    assert (cfg.kv_lease_s, cfg.advertise_peer_url) == (30.0, False)
