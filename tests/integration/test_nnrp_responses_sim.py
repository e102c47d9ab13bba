"""``responses.create`` and ``models.list`` on the NNRP door, against the HTTP door's answers.

Real render sidecar (it converts Responses requests with vLLM's code), simulated token-only engines in
"context" mode (each token a function of the whole context, as with a greedy model), so the same
request over NNRP and over ``POST /v1/responses`` must give the same text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from coordinator.nnrp.client import NnrpClient
from coordinator.nnrp.conformance.recipes import load_recipes
from coordinator.nnrp.conformance.runner import PASS, run_all
from tests.conftest import SERVED, CoordinatorFactory
from tests.support import CoordinatorServer, wait_until
from token_engine.simulator import SimConfig, SimulatedEngine

KEY = "sk-nnrp-responses"
AUTH = {"Authorization": f"Bearer {KEY}"}
SCHEMA = "openai-compatible/1"


@pytest.fixture
def sims() -> Iterator[tuple[SimulatedEngine, SimulatedEngine]]:
    cfg = SimConfig(model=SERVED, mode="context", decode_s_per_token=0.01)
    with SimulatedEngine(cfg) as a, SimulatedEngine(cfg) as b:
        yield a, b


@pytest.fixture
def coord(render_sidecar: Any, sims: tuple[SimulatedEngine, SimulatedEngine],
          coordinator_factory: CoordinatorFactory) -> CoordinatorServer:
    return coordinator_factory(render_sidecar.url, [s.url for s in sims], server={"api_keys": [KEY]})


def ws_url(coord: CoordinatorServer) -> str:
    return coord.url.replace("http://", "ws://") + "/nnrp/v1"


def body(i: int, max_output_tokens: int = 24, **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "input": f"Tell me about the number {i}.", "temperature": 0,
            "max_output_tokens": max_output_tokens, **extra}


def envelope(operation: str, b: dict[str, Any]) -> dict[str, Any]:
    return {"schema_version": SCHEMA, "operation": operation, "body": b}


def message_text(response: dict[str, Any]) -> str:
    """The text of a Responses object's message items, as a client reads its answer."""
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")


def held(coord: CoordinatorServer) -> int:
    r = httpx.get(f"{coord.url}/admin/accounting", headers=AUTH, timeout=10)
    return int(r.json()["held"])


def released(coord: CoordinatorServer) -> bool:
    """Nothing in flight at the coordinator and no admission slot still held."""
    return coord.wait_idle(10) == 0 and wait_until(lambda: held(coord) == 0, 10)


async def http_post(coord: CoordinatorServer, path: str, b: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as http:
        return await http.post(f"{coord.url}{path}", json=b, headers=AUTH)


def test_manifest_declares_the_new_operations(coord: CoordinatorServer) -> None:
    doc = httpx.get(f"{coord.url}/nnrp/v1/capabilities", headers=AUTH, timeout=10).json()
    assert doc["compatibility_levels"] == [1, 2, 3]
    assert {op["name"]: (op["streaming"], op["non_streaming"]) for op in doc["operations"]} == {
        "chat.completions.create": (True, True), "responses.create": (True, True),
        "models.list": (False, True)}


async def test_models_list_is_get_v1_models(coord: CoordinatorServer) -> None:
    async with await NnrpClient.connect(ws_url(coord), api_key=KEY) as client:
        op = await client.submit(envelope("models.list", {}))
        events = await op.collect()
        listed = await client.models()
    http = (await asyncio.to_thread(httpx.get, f"{coord.url}/v1/models", headers=AUTH, timeout=10)).json()
    assert [f["seq"] for f in op.results] == [0]
    assert events == [{"type": "response.completed", "response": http}]
    assert listed == http
    assert {card["id"] for card in http["data"]} == {SERVED, "gpt-4o-mini"}


async def test_non_streaming_answer_equals_post_v1_responses(coord: CoordinatorServer) -> None:
    async with await NnrpClient.connect(ws_url(coord), api_key=KEY) as client:
        events = await (await client.responses(body(1))).collect()
    http = (await http_post(coord, "/v1/responses", body(1))).json()
    assert [e["type"] for e in events] == ["response.completed"]
    nnrp = events[0]["response"]
    assert message_text(nnrp) and message_text(nnrp) == message_text(http)
    for key in ("object", "model", "status", "max_output_tokens", "temperature", "usage"):
        assert nnrp[key] == http[key], key
    assert set(nnrp) == set(http)  # the same members: the object is built by the same code
    assert nnrp["id"].startswith("resp_nnrp-")
    assert await asyncio.to_thread(released, coord)


async def test_stream_is_numbered_and_its_deltas_are_the_completed_text(
        coord: CoordinatorServer) -> None:
    async with await NnrpClient.connect(ws_url(coord), api_key=KEY, encodings=("msgpack",)) as client:
        op = await client.responses(body(2, stream=True))
        events = await op.collect()
    types = [e["type"] for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [f["seq"] for f in op.results] == list(range(len(events)))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done = events[-1]["response"]
    assert deltas and deltas == message_text(done)
    assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 24  # the budget ran out
    # The same request streamed by the HTTP door says the same.
    http = (await http_post(coord, "/v1/responses", body(2))).json()
    assert deltas == message_text(http)
    assert await asyncio.to_thread(released, coord)


async def test_an_unknown_previous_response_id_is_a_404_naming_it(coord: CoordinatorServer) -> None:
    refused = body(3, previous_response_id="resp_earlier")
    async with await NnrpClient.connect(ws_url(coord), api_key=KEY) as client:
        events = await (await client.submit(envelope("responses.create", {**refused, "stream": True}))).collect()
    http = await http_post(coord, "/v1/responses", refused)
    assert [e["type"] for e in events] == ["response.error"]
    error = events[0]["error"]
    assert events[0]["status"] == http.status_code == 404
    assert error["param"] == "previous_response_id" and "resp_earlier" in error["message"]
    assert error == http.json()["error"]  # the HTTP door's error body, as is
    assert await asyncio.to_thread(released, coord)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_conversation_moves_between_the_doors(coord: CoordinatorServer, stream: bool) -> None:
    """A turn answered over NNRP is stored as over HTTP (before its ``response.completed`` goes out), so
    either door continues it; the follow-up's text is the same whichever door asks."""
    async with await NnrpClient.connect(ws_url(coord), api_key=KEY) as client:
        events = await (await client.submit(envelope("responses.create", body(1, 8, stream=stream)))).collect()
        first = events[-1]["response"]
        assert events[-1]["type"] == "response.completed"
        got = await asyncio.to_thread(httpx.get, f"{coord.url}/v1/responses/{first['id']}", headers=AUTH)
        assert got.status_code == 200 and got.json() == first
        follow = body(2, 8, previous_response_id=first["id"])
        over_nnrp = await (await client.submit(envelope("responses.create", follow))).collect()
    over_http = await http_post(coord, "/v1/responses", follow)
    assert over_http.status_code == 200, over_http.text
    nnrp_answer = over_nnrp[-1]["response"]
    assert nnrp_answer["previous_response_id"] == over_http.json()["previous_response_id"] == first["id"]
    assert message_text(nnrp_answer) == message_text(over_http.json()) != ""
    assert over_http.json()["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    assert await asyncio.to_thread(released, coord)


async def test_cancelled_stream_aborts_the_engine_and_releases(
        coord: CoordinatorServer, sims: tuple[SimulatedEngine, SimulatedEngine]) -> None:
    async with await NnrpClient.connect(ws_url(coord), api_key=KEY) as client:
        long = await client.submit(envelope("responses.create", body(4, 400, stream=True)))
        short = await client.submit(envelope("responses.create", body(5, 8, stream=True)))
        seen = []
        async for event in long:
            seen.append(event)
            if event["type"] == "response.output_text.delta" and len(seen) == 6:
                await long.cancel("enough")
        rest = await short.collect()
        await asyncio.sleep(0.3)  # anything late for the cancelled operation would arrive now
    assert seen[-1]["type"] == "response.cancelled" and seen[-1]["diagnostics"]["reason"] == "enough"
    assert [f["event"]["type"] for f in long.results].count("response.cancelled") == 1
    assert "response.completed" not in [f["event"]["type"] for f in long.results]
    assert rest[-1]["type"] == "response.completed"  # the other operation is untouched
    assert await asyncio.to_thread(wait_until, lambda: any(s.state()["aborted"] for s in sims), 5)
    assert await asyncio.to_thread(released, coord)


async def test_conformance_recipes_of_levels_2_and_3_pass(coord: CoordinatorServer) -> None:
    recipes = [r for r in load_recipes() if r.raw["level"] > 1]
    outcomes = await run_all(ws_url(coord), api_key=KEY, model=SERVED, recipes=recipes)
    assert [(o.recipe_id, o.status, o.detail) for o in outcomes] == [(r.id, PASS, "") for r in recipes]
    assert await asyncio.to_thread(released, coord)


async def test_a_background_run_is_refused_over_nnrp_naming_it(coord: CoordinatorServer) -> None:
    """An operation is the run: a background one (answered at once, run on) has no form in the profile."""
    async with await NnrpClient.connect(ws_url(coord), api_key=KEY) as client:
        events = await (await client.submit(envelope("responses.create", body(6, background=True)))).collect()
    assert [e["type"] for e in events] == ["response.error"]
    assert events[0]["status"] == 400 and events[0]["error"]["param"] == "background"
    assert await asyncio.to_thread(released, coord)
