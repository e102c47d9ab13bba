"""The NNRP door end to end: real render sidecar, simulated engines, the client library on a socket.

The simulators run in "context" mode (each token a function of the whole context, as with a greedy
model), so an operation's text can be compared with the HTTP door's text for the same request.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from coordinator.nnrp import frames as F
from coordinator.nnrp.client import NnrpClient, NnrpError
from tests.conftest import CoordinatorFactory
from tests.support import CoordinatorServer, sse_events, streamed_text, wait_until
from token_engine.simulator import SimConfig, SimulatedEngine

SERVED = "smollm2-135m-instruct"
KEY = "sk-nnrp"


@pytest.fixture
def sims() -> Iterator[tuple[SimulatedEngine, SimulatedEngine]]:
    cfg = SimConfig(model=SERVED, mode="context", decode_s_per_token=0.02)
    with SimulatedEngine(cfg) as a, SimulatedEngine(cfg) as b:
        yield a, b


@pytest.fixture
def coord(render_sidecar: Any, sims: tuple[SimulatedEngine, SimulatedEngine],
          coordinator_factory: CoordinatorFactory) -> CoordinatorServer:
    return coordinator_factory(render_sidecar.url, [s.url for s in sims], server={"api_keys": [KEY]},
                               nnrp={"max_frame_bytes": 4096})


def ws_url(coord: CoordinatorServer) -> str:
    return coord.url.replace("http://", "ws://") + "/nnrp/v1"


def body(i: int, max_tokens: int = 50) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"Story number {i}, please."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


def held(coord: CoordinatorServer) -> int:
    r = httpx.get(f"{coord.url}/admin/accounting", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    return int(r.json()["held"])


def http_text(coord: CoordinatorServer, b: dict[str, Any]) -> str:
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=b, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=60)
    return streamed_text(sse_events(r))[0]


def test_capabilities_endpoint(coord: CoordinatorServer) -> None:
    assert httpx.get(f"{coord.url}/nnrp/v1/capabilities", timeout=10).status_code == 401
    doc = httpx.get(f"{coord.url}/nnrp/v1/capabilities", headers={"Authorization": f"Bearer {KEY}"},
                    timeout=10).json()
    assert doc["adapter"] == "llm-coordinator" and doc["compatibility_levels"] == [1, 2, 3]
    assert [op["name"] for op in doc["operations"]] == ["chat.completions.create", "responses.create",
                                                        "models.list"]
    assert not any(op["tool_calls"] for op in doc["operations"])  # no parsers configured


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
async def test_eight_operations_three_cancelled(coord: CoordinatorServer,
                                                sims: tuple[SimulatedEngine, SimulatedEngine],
                                                encoding: str) -> None:
    cancel = {1, 4, 6}
    async with await NnrpClient.connect(ws_url(coord), api_key=KEY, encodings=(encoding,)) as client:
        assert client.encoding == encoding
        assert client.manifest["operations"][0]["name"] == "chat.completions.create"
        ops = [await client.chat(body(i), op_id=f"op-{i}") for i in range(8)]

        async def drive(i: int) -> list[dict[str, Any]]:
            events = []
            async for ev in ops[i]:
                events.append(ev)
                if i in cancel and len(events) == 4:
                    await ops[i].cancel(f"test cancels {i}")
            return events

        results = await asyncio.gather(*(drive(i) for i in range(8)))
        await asyncio.sleep(0.3)  # anything late would arrive now
        for i, op in enumerate(ops):
            seqs = [f["seq"] for f in op.results]
            assert seqs == list(range(len(seqs))), (i, seqs)
            last = op.results[-1]["event"]
            if i in cancel:
                assert last["type"] == "response.cancelled", last
                assert last["diagnostics"]["source"] == "client"
                assert last["diagnostics"]["reason"] == f"test cancels {i}"
                assert last["diagnostics"]["operation_id"] == f"op-{i}"
                assert sum(1 for f in op.results if f["event"]["type"].startswith("response.c")) == 1
            else:
                assert last["type"] == "response.completed" and last["finish_reason"] == "length"
                assert results[i][-2]["type"] == "response.usage"
    aborted = [a for s in sims for a in s.state()["aborted"]]
    assert wait_until(lambda: len([a for s in sims for a in s.state()["aborted"]]) >= 3, 5), aborted
    # The five that finished stream exactly the HTTP door's text for the same request.
    for i in sorted(set(range(8)) - cancel):
        nnrp_text = "".join(e.get("delta", "") for e in results[i] if e["type"] == "response.output_text.delta")
        assert nnrp_text == await asyncio.to_thread(http_text, coord, body(i)), i
    assert await asyncio.to_thread(coord.wait_idle) == 0
    assert wait_until(lambda: held(coord) == 0, 5)


async def test_timeout_policy_and_non_streaming(coord: CoordinatorServer) -> None:
    async with await NnrpClient.connect(ws_url(coord), api_key=KEY, encodings=("msgpack", "json")) as client:
        slow = await client.chat(body(1, max_tokens=200), policy={"timeout_ms": 300, "diagnostics": "summary"})
        events = await slow.collect()
        assert events[-1]["type"] == "response.cancelled" and events[-1]["diagnostics"]["source"] == "timeout"
        plain = {k: v for k, v in body(2, 8).items() if k != "stream_options"}
        whole = await client.chat({**plain, "stream": False})
        events = await whole.collect()
        assert [e["type"] for e in events] == ["response.usage", "response.completed"]
        assert events[1]["response"]["choices"][0]["message"]["content"]
        assert wait_until(lambda: bool(slow.diagnostics), 5)
        assert slow.diagnostics[0]["record"]["released"] is True
    assert wait_until(lambda: held(coord) == 0, 5)


async def test_unauthorized_session_is_closed(coord: CoordinatorServer) -> None:
    with pytest.raises(NnrpError) as info:
        await NnrpClient.connect(ws_url(coord), api_key="wrong")
    assert info.value.code == F.UNAUTHORIZED


async def test_socket_close_cancels_open_operations(coord: CoordinatorServer,
                                                    sims: tuple[SimulatedEngine, SimulatedEngine]) -> None:
    client = await NnrpClient.connect(ws_url(coord), api_key=KEY)
    ops = [await client.chat(body(i, 200)) for i in range(3)]
    for op in ops:
        async for _ in op:
            break
    await client.ws.close()  # no close frame: the connection just goes
    assert wait_until(lambda: len([a for s in sims for a in s.state()["aborted"]]) >= 3, 5)
    assert await asyncio.to_thread(coord.wait_idle) == 0
    assert wait_until(lambda: held(coord) == 0, 5)


def fuzz_frames(rng: random.Random, n: int) -> list[str | bytes]:
    good: list[dict[str, Any]] = [
        {"type": "submit", "op": "f", "envelope": {"schema_version": "openai-compatible/1",
                                                   "operation": "chat.completions.create",
                                                   "body": {"model": "gpt-4o-mini", "stream": True,
                                                            "messages": [{"role": "user", "content": "x"}],
                                                            "max_tokens": 2}}},
        {"type": "credit", "op": "f", "credits": 3}, {"type": "cancel", "op": "f", "reason": "r"},
        {"type": "diagnostics"}, {"type": "ping", "nonce": 1}, {"type": "hello"},
        {"type": "open", "schema_version": "openai-compatible/1"},
    ]
    out: list[str | bytes] = []
    for _ in range(n):
        pick = rng.random()
        g = rng.choice(good)
        if pick < 0.2:
            out.append(bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200))))
        elif pick < 0.4:
            text = json.dumps(g)
            out.append(text[: rng.randint(0, len(text) - 1)])
        elif pick < 0.6:
            obj = json.loads(json.dumps(g))
            obj[rng.choice(list(obj))] = rng.choice([None, True, -5, 2**63, "", [], {"a": [1]}, 3.5])
            if rng.random() < 0.3:
                obj["op"] = f"f{rng.randint(0, 3)}"
            out.append(msgspec.msgpack.encode(obj) if rng.random() < 0.5 else json.dumps(obj))
        elif pick < 0.7:
            out.append("x" * rng.randint(4097, 9000))  # oversize
        elif pick < 0.8:
            out.append(json.dumps({"type": rng.choice(["warp", "", "RESULT", "welcome"]), "op": "f"}))
        else:
            obj = json.loads(json.dumps(g))
            if obj["type"] == "submit":
                obj["op"] = f"f{rng.randint(0, 3)}"
            out.append(json.dumps(obj))
    return out


async def test_frame_fuzz_never_ends_the_server_or_other_sessions(coord: CoordinatorServer) -> None:
    rng = random.Random(10)
    async with await NnrpClient.connect(ws_url(coord), api_key=KEY) as bystander:
        steady = await bystander.chat(body(3, 60))
        async with await NnrpClient.connect(ws_url(coord), api_key=KEY) as fuzzer:
            frames = fuzz_frames(rng, 3000)
            for data in frames:
                await fuzzer.send_raw(data)
            pong = await fuzzer.ping(42)  # the fuzzed session still answers
            assert pong["nonce"] == 42
            assert len(fuzzer.errors) > 1000
            assert {e["code"] for e in fuzzer.errors} >= {F.MALFORMED_FRAME, F.UNKNOWN_TYPE, F.FRAME_TOO_LARGE}
        events = await steady.collect()
        assert events[-1]["type"] == "response.completed"
        fresh = await (await bystander.chat(body(4, 5))).collect()
        assert fresh[-1]["type"] == "response.completed"
    health = await asyncio.to_thread(httpx.get, f"{coord.url}/health", timeout=10)
    assert health.status_code == 200
    assert await asyncio.to_thread(coord.wait_idle, 10) == 0
    assert wait_until(lambda: held(coord) == 0, 10)


async def test_frame_fuzz_memory_stays_flat(coord: CoordinatorServer) -> None:
    """Thousands of bad frames on one long session leave nothing behind: traced memory after four
    more rounds of 2,000 fuzz frames stays within 1 MB of the first (a leak of even ~100 bytes per
    frame would exceed it)."""
    import gc
    import tracemalloc

    frames = fuzz_frames(random.Random(11), 2000)
    async with await NnrpClient.connect(ws_url(coord), api_key=KEY) as fuzzer:
        async def one_round() -> int:
            for data in frames:
                await fuzzer.send_raw(data)
            assert (await fuzzer.ping(1))["nonce"] == 1  # every frame before it was handled
            assert await asyncio.to_thread(wait_until, lambda: held(coord) == 0, 10)
            fuzzer.errors.clear()  # the client's own record of the error frames
            gc.collect()
            return tracemalloc.get_traced_memory()[0]

        tracemalloc.start()
        try:
            await one_round()  # warm-up: caches, lazily built objects
            first = await one_round()
            last = first
            for _ in range(3):
                last = await one_round()
        finally:
            tracemalloc.stop()
    assert last - first < 1_000_000, f"traced memory grew by {last - first} bytes over 6,000 fuzz frames"
