"""Stored Responses on the real render sidecar and simulated token-only engines: ``store``,
``previous_response_id`` (the follow-up's prompt is the whole conversation, token for token),
retrieve, delete, ``input_items``, tenants that cannot see each other's responses, the OpenAI SDK's
own calls, two coordinators on one Redis, and a store that is down."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from coordinator.pipeline.responses.store import RedisStore, StoredResponse
from tests.conftest import SERVED, CoordinatorFactory
from tests.integration.test_messages_sim import released
from tests.support import RedisServer, wait_until
from token_engine.simulator import SimConfig, SimulatedEngine

BODY: dict[str, Any] = {"model": SERVED, "max_output_tokens": 8, "temperature": 0}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TENANTS = {"members": [{"name": "acme", "api_keys": ["k-acme"]}, {"name": "globex", "api_keys": ["k-globex"]}]}


@pytest.fixture
def sim() -> Iterator[SimulatedEngine]:
    with SimulatedEngine(SimConfig(model=SERVED, seed=5, decode_s_per_token=0.002)) as engine:
        yield engine


def create(url: str, key: str | None = None, **fields: Any) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(f"{url}/v1/responses", json={**BODY, **fields}, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def rendered(render_url: str, body: dict[str, Any]) -> list[int]:
    """vLLM's own ``/v1/responses/render`` of a stateless body: the prompt native vLLM would run."""
    r = httpx.post(f"{render_url}/v1/responses/render", json={**BODY, **body}, timeout=30)
    assert r.status_code == 200, r.text
    ids: list[int] = r.json()["token_ids"]
    return ids


def said(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def test_a_follow_up_runs_the_whole_conversation(render_sidecar: Any, sim: SimulatedEngine,
                                                 coordinator_factory: CoordinatorFactory) -> None:
    """Turn two names turn one; the engine runs the prompt a client sending the whole conversation
    would have run, without turn one's instructions (OpenAI's and vLLM's rule)."""
    coord = coordinator_factory(render_sidecar.url, [sim.url])
    first = create(coord.url, instructions="Answer in French.", input="My name is Ada.")
    assert first["previous_response_id"] is None and "store" not in first  # vLLM's object has no store
    second = create(coord.url, previous_response_id=first["id"], input="What is my name?")
    assert second["previous_response_id"] == first["id"]
    whole = [{"role": "user", "content": "My name is Ada."},
             {"type": "message", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": said(first), "annotations": []}]},
             {"role": "user", "content": "What is my name?"}]
    assert sim.state()["last_ids"]["token_ids"] == rendered(render_sidecar.url, {"input": whole})
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]

    # A third turn carries both earlier turns; its own instructions apply to it alone.
    third = create(coord.url, previous_response_id=second["id"], instructions="Be brief.", input="Thanks!")
    whole += [{"type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": said(second), "annotations": []}]},
              {"role": "user", "content": "Thanks!"}]
    assert sim.state()["last_ids"]["token_ids"] == rendered(render_sidecar.url,
                                                            {"input": whole, "instructions": "Be brief."})
    assert third["previous_response_id"] == second["id"]
    assert released(coord, sim)


def test_a_tool_call_and_its_output_carry_over(render_sidecar: Any, sim: SimulatedEngine,
                                               coordinator_factory: CoordinatorFactory) -> None:
    """An agent answers a function call in the next turn with only ``function_call_output``: the call
    itself comes from the store (vLLM 0.32's own store drops it; docs/responses-api.md)."""
    coord = coordinator_factory(render_sidecar.url, [sim.url])
    call = {"type": "function_call", "call_id": "call_7", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    tools = {"tools": [WEATHER], "tool_choice": "none"}  # this sidecar runs no tool parser
    first = create(coord.url, **tools, input=[{"role": "user", "content": "Weather in Oslo?"}, call])
    second = create(coord.url, **tools, previous_response_id=first["id"],
                    input=[{"type": "function_call_output", "call_id": "call_7", "output": "Snow, -3 C"}])
    whole = [{"role": "user", "content": "Weather in Oslo?"}, call,
             {"type": "message", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": said(first), "annotations": []}]},
             {"type": "function_call_output", "call_id": "call_7", "output": "Snow, -3 C"}]
    assert sim.state()["last_ids"]["token_ids"] == rendered(render_sidecar.url, {**tools, "input": whole})
    assert second["status"] in ("completed", "incomplete")


def test_retrieve_delete_and_input_items(render_sidecar: Any, sim: SimulatedEngine,
                                         coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url])
    answer = create(coord.url, input=[{"role": "user", "content": f"Item {i}"} for i in range(5)])
    got = httpx.get(f"{coord.url}/v1/responses/{answer['id']}", timeout=10)
    assert got.status_code == 200 and got.json() == answer

    items = httpx.get(f"{coord.url}/v1/responses/{answer['id']}/input_items", timeout=10).json()
    assert items["object"] == "list" and not items["has_more"]
    assert [i["content"][0]["text"] for i in items["data"]] == [f"Item {i}" for i in (4, 3, 2, 1, 0)]
    assert all(i["content"][0]["type"] == "input_text" and i["id"] for i in items["data"])
    page = httpx.get(f"{coord.url}/v1/responses/{answer['id']}/input_items",
                     params={"order": "asc", "limit": 2, "after": items["data"][-1]["id"]}, timeout=10).json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["Item 1", "Item 2"] and page["has_more"]
    bad = httpx.get(f"{coord.url}/v1/responses/{answer['id']}/input_items", params={"limit": 0}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"

    cancel = httpx.post(f"{coord.url}/v1/responses/{answer['id']}/cancel", timeout=10)
    assert cancel.status_code == 400 and cancel.json()["error"]["param"] == "response_id"

    gone = httpx.delete(f"{coord.url}/v1/responses/{answer['id']}", timeout=10)
    assert gone.json() == {"id": answer["id"], "object": "response.deleted", "deleted": True}
    for r in (httpx.get(f"{coord.url}/v1/responses/{answer['id']}", timeout=10),
              httpx.delete(f"{coord.url}/v1/responses/{answer['id']}", timeout=10)):
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["message"] == f"Response with id '{answer['id']}' not found."
        assert set(error) == {"message", "type", "param", "code"}
    follow = httpx.post(f"{coord.url}/v1/responses", json={**BODY, "previous_response_id": answer["id"],
                                                           "input": "And?"}, timeout=10)
    assert follow.status_code == 404 and follow.json()["error"]["param"] == "previous_response_id"


def test_a_streamed_response_is_stored_before_its_completed_event(
        render_sidecar: Any, sim: SimulatedEngine, coordinator_factory: CoordinatorFactory) -> None:
    """An agent chains on ``response.completed``: by then the response can be retrieved and continued."""
    coord = coordinator_factory(render_sidecar.url, [sim.url])
    with httpx.stream("POST", f"{coord.url}/v1/responses", json={**BODY, "input": "Hi", "stream": True},
                      timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"response.completed"' in line:
                completed = json.loads(line[len("data: "):])["response"]
                got = httpx.get(f"{coord.url}/v1/responses/{completed['id']}", timeout=10)
                assert got.status_code == 200 and got.json() == completed
                break
        else:
            pytest.fail("no response.completed")
    assert create(coord.url, previous_response_id=completed["id"], input="More.")["status"]


def test_store_false_keeps_nothing(render_sidecar: Any, sim: SimulatedEngine,
                                   coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url])
    answer = create(coord.url, input="Hi", store=False)
    assert httpx.get(f"{coord.url}/v1/responses/{answer['id']}", timeout=10).status_code == 404


def test_tenants_never_see_each_others_responses(render_sidecar: Any, sim: SimulatedEngine,
                                                 coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url], tenants=TENANTS)
    mine = create(coord.url, "k-acme", input="A secret: 4711.")
    theirs = {"Authorization": "Bearer k-globex"}
    for r in (httpx.get(f"{coord.url}/v1/responses/{mine['id']}", headers=theirs, timeout=10),
              httpx.get(f"{coord.url}/v1/responses/{mine['id']}/input_items", headers=theirs, timeout=10),
              httpx.delete(f"{coord.url}/v1/responses/{mine['id']}", headers=theirs, timeout=10),
              httpx.post(f"{coord.url}/v1/responses", headers=theirs, timeout=10,
                         json={**BODY, "previous_response_id": mine["id"], "input": "Repeat it."})):
        assert r.status_code == 404, r.text
        assert "4711" not in r.text
    assert httpx.get(f"{coord.url}/v1/responses/{mine['id']}", headers={"Authorization": "Bearer k-acme"},
                     timeout=10).status_code == 200
    assert httpx.get(f"{coord.url}/v1/responses/{mine['id']}", timeout=10).status_code == 401


def test_the_openai_sdk_chains_retrieves_lists_and_deletes(
        render_sidecar: Any, sim: SimulatedEngine, coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url])
    client = openai.OpenAI(base_url=f"{coord.url}/v1", api_key="unused", max_retries=0)
    first = client.responses.create(model=SERVED, input="My name is Ada.", max_output_tokens=8, temperature=0)
    second = client.responses.create(model=SERVED, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == second.output_text
    items = client.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["What is my name?"]  # type: ignore[union-attr]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=SERVED, input="Again?", previous_response_id=first.id)
    # The chain's later turn stands on its own: it keeps the conversation it was answered in.
    third = client.responses.create(model=SERVED, input="Spell it.", previous_response_id=second.id,
                                    max_output_tokens=4, temperature=0)
    assert third.previous_response_id == second.id


def test_what_cannot_be_served_is_refused_naming_the_field(render_sidecar: Any, sim: SimulatedEngine,
                                                            coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url])
    first = create(coord.url, input="Hi")
    cases = [({"previous_response_id": 7}, 400, "previous_response_id"),
             ({"previous_response_id": "resp_nothing"}, 404, "previous_response_id"),
             ({"conversation": "conv_1"}, 404, "conversation"),
             ({"conversation": 7}, 400, "conversation"),
             ({"conversation": "conv_1", "previous_response_id": first["id"]}, 400, "conversation")]
    for extra, status, param in cases:
        r = httpx.post(f"{coord.url}/v1/responses", json={**BODY, "input": "Hi", **extra}, timeout=10)
        assert r.status_code == status, (extra, r.text)
        assert r.json()["error"]["param"] == param, r.text
    off = coordinator_factory(render_sidecar.url, [sim.url], responses={"store": {"backend": "off"}})
    kept = create(off.url, input="Hi")  # answered, as vLLM without its store answers, and not kept
    assert httpx.get(f"{off.url}/v1/responses/{kept['id']}", timeout=10).status_code == 404
    r = httpx.post(f"{off.url}/v1/responses", json={**BODY, "input": "Hi", "previous_response_id": first["id"]},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"


def test_two_coordinators_on_one_redis_share_the_conversation(
        render_sidecar: Any, sim: SimulatedEngine, redis_server: RedisServer,
        coordinator_factory: CoordinatorFactory) -> None:
    store = {"store": {"backend": "redis", "redis_url": redis_server.url, "namespace": "shared"}}
    a = coordinator_factory(render_sidecar.url, [sim.url], responses=store)
    b = coordinator_factory(render_sidecar.url, [sim.url], responses=store)
    first = create(a.url, input="My name is Ada.")
    second = create(b.url, previous_response_id=first["id"], input="What is my name?")
    assert httpx.get(f"{a.url}/v1/responses/{second['id']}", timeout=10).json() == second
    assert httpx.delete(f"{b.url}/v1/responses/{first['id']}", timeout=10).status_code == 200
    assert httpx.get(f"{a.url}/v1/responses/{first['id']}", timeout=10).status_code == 404


def test_a_store_that_is_down_is_a_503_and_stateless_requests_go_on(
        render_sidecar: Any, sim: SimulatedEngine, redis_server: RedisServer,
        coordinator_factory: CoordinatorFactory) -> None:
    store = {"store": {"backend": "redis", "redis_url": redis_server.url, "timeout_s": 0.5}}
    coord = coordinator_factory(render_sidecar.url, [sim.url], responses=store)
    first = create(coord.url, input="Hi")
    redis_server.stop()
    try:
        follow = httpx.post(f"{coord.url}/v1/responses", timeout=30,
                            json={**BODY, "previous_response_id": first["id"], "input": "And?"})
        assert follow.status_code == 503 and follow.headers["retry-after"] == "1", follow.text
        assert set(follow.json()["error"]) == {"message", "type", "param", "code"}
        assert httpx.get(f"{coord.url}/v1/responses/{first['id']}", timeout=30).status_code == 503
        assert create(coord.url, input="Hi", store=False)["status"] in ("completed", "incomplete")
        # Answered all the same: only the stored copy is lost.
        assert create(coord.url, input="Hi")["status"] in ("completed", "incomplete")
    finally:
        redis_server.start()  # a fresh, empty server on the same port: the store is back
    again = create(coord.url, input="Hi")
    assert create(coord.url, previous_response_id=again["id"], input="And?")["previous_response_id"] == again["id"]
    assert released(coord, sim)


# -- background runs ----------------------------------------------------------------------------------
@pytest.fixture
def slow() -> Iterator[SimulatedEngine]:
    with SimulatedEngine(SimConfig(model=SERVED, seed=5, decode_s_per_token=0.05)) as engine:
        yield engine


def poll(url: str, rid: str, until: tuple[str, ...] = ("completed", "incomplete", "failed", "cancelled"),
         timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/v1/responses/{rid}", timeout=10)
        assert r.status_code == 200, r.text
        if r.json()["status"] in until:
            answer: dict[str, Any] = r.json()
            return answer
        time.sleep(0.05)
    raise AssertionError(f"{rid} never reached {until}")


def test_a_background_run_answers_at_once_and_goes_on(render_sidecar: Any, sim: SimulatedEngine,
                                                      coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url])
    queued = create(coord.url, input="My name is Ada.", background=True, max_output_tokens=24)
    assert queued["status"] == "queued" and queued["background"] is True and queued["output"] == []
    done = poll(coord.url, queued["id"])
    assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 24 and said(done)
    assert done["background"] is True
    items = httpx.get(f"{coord.url}/v1/responses/{queued['id']}/input_items", timeout=10).json()
    assert [i["content"][0]["text"] for i in items["data"]] == ["My name is Ada."]
    follow = create(coord.url, previous_response_id=queued["id"], input="What is my name?")
    whole = [{"role": "user", "content": "My name is Ada."},
             {"type": "message", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": said(done), "annotations": []}]},
             {"role": "user", "content": "What is my name?"}]
    assert sim.state()["last_ids"]["token_ids"] == rendered(render_sidecar.url, {"input": whole})
    assert follow["background"] is False
    cancel = httpx.post(f"{coord.url}/v1/responses/{queued['id']}/cancel", timeout=10)
    assert cancel.status_code == 400  # it is finished
    assert released(coord, sim)


def test_a_background_stream_survives_its_reader_and_resumes(render_sidecar: Any, slow: SimulatedEngine,
                                                            coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [slow.url])
    seen: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{coord.url}/v1/responses", timeout=30,
                      json={**BODY, "input": "Count.", "background": True, "stream": True,
                            "max_output_tokens": 30}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen.append(json.loads(line[len("data: "):]))
            if sum(1 for e in seen if e["type"] == "response.output_text.delta") == 3:
                break  # the reader leaves; the run does not
    rid = seen[0]["response"]["id"]
    assert poll(coord.url, rid, ("in_progress",))["status"] == "in_progress"
    last = seen[-1]["sequence_number"]
    with httpx.stream("GET", f"{coord.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": last},
                      timeout=60) as r:
        rest = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    events = seen + rest
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == said(events[-1]["response"]) == said(poll(coord.url, rid))
    assert released(coord, slow)


def test_cancelling_a_background_run_aborts_it_at_the_engine(render_sidecar: Any, slow: SimulatedEngine,
                                                             coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [slow.url])
    queued = create(coord.url, input="Count to a thousand.", background=True, max_output_tokens=400)
    poll(coord.url, queued["id"], ("in_progress",))
    assert wait_until(lambda: bool(slow.state()["running"]), 10)
    r = httpx.post(f"{coord.url}/v1/responses/{queued['id']}/cancel", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    assert poll(coord.url, queued["id"])["status"] == "cancelled"
    assert released(coord, slow) and slow.state()["aborted"]
    again = httpx.post(f"{coord.url}/v1/responses/{queued['id']}/cancel", timeout=10)
    assert again.status_code == 400


def test_background_runs_across_two_coordinators_on_one_redis(
        render_sidecar: Any, slow: SimulatedEngine, redis_server: RedisServer,
        coordinator_factory: CoordinatorFactory) -> None:
    """Polled and cancelled through the replica that does not run it: the runner sees the cancel on its
    next lease beat; a run whose runner stopped renewing reads as failed."""
    settings = {"store": {"backend": "redis", "redis_url": redis_server.url, "namespace": "bg"},
                "background_lease_s": 1.5}
    a = coordinator_factory(render_sidecar.url, [slow.url], responses=settings)
    b = coordinator_factory(render_sidecar.url, [slow.url], responses=settings)
    queued = create(a.url, input="Count to a thousand.", background=True, max_output_tokens=400)
    assert poll(b.url, queued["id"], ("in_progress",))["status"] == "in_progress"
    r = httpx.post(f"{b.url}/v1/responses/{queued['id']}/cancel", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert wait_until(lambda: not slow.state()["running"], 10), "the runner did not stop"
    assert slow.state()["aborted"] and released(a, slow)
    resume = httpx.get(f"{b.url}/v1/responses/{queued['id']}", params={"stream": "true"}, timeout=10)
    assert resume.status_code == 400 and resume.json()["error"]["param"] == "stream"

    async def orphan() -> None:  # what a runner that died leaves: in progress, its lease run out
        store = RedisStore(redis_server.url, "bg", 60.0, 1 << 20, timeout_s=2.0)
        await store.put("default", StoredResponse("resp_orphan", {"id": "resp_orphan", "status": "in_progress",
                                                                  "background": True, "output": []},
                                                  [], [], time.time(), lease_until=time.time() - 1))
        await store.aclose()
    asyncio.run(orphan())
    failed = httpx.get(f"{b.url}/v1/responses/resp_orphan", timeout=10).json()
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"


def test_background_needs_the_store(render_sidecar: Any, sim: SimulatedEngine,
                                    coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url])
    r = httpx.post(f"{coord.url}/v1/responses", json={**BODY, "input": "Hi", "background": True, "store": False},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "background"


# -- conversations ------------------------------------------------------------------------------------
def test_the_conversations_api_keeps_items_as_openai_documents(render_sidecar: Any, sim: SimulatedEngine,
                                                               coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url], tenants=TENANTS)
    acme, globex = {"Authorization": "Bearer k-acme"}, {"Authorization": "Bearer k-globex"}
    conv = httpx.post(f"{coord.url}/v1/conversations", headers=acme, timeout=10, json={
        "metadata": {"topic": "demo"}, "items": [{"type": "message", "role": "user", "content": "Hello!"}]}).json()
    assert conv["object"] == "conversation" and conv["id"].startswith("conv_") and conv["metadata"] == {"topic": "demo"}
    url = f"{coord.url}/v1/conversations/{conv['id']}"
    assert httpx.get(url, headers=acme, timeout=10).json() == conv
    assert httpx.get(url, headers=globex, timeout=10).status_code == 404
    updated = httpx.post(url, headers=acme, json={"metadata": {"topic": "other"}}, timeout=10).json()
    assert updated["metadata"] == {"topic": "other"}
    added = httpx.post(f"{url}/items", headers=acme, timeout=10, json={"items": [
        {"type": "message", "role": "assistant", "content": "Hi."},
        {"type": "message", "role": "user", "content": "How are you?"}]}).json()
    assert added["object"] == "list" and len(added["data"]) == 2
    listed = httpx.get(f"{url}/items", headers=acme, params={"order": "asc"}, timeout=10).json()
    assert [(i["role"], i["content"][0]["text"]) for i in listed["data"]] == [
        ("user", "Hello!"), ("assistant", "Hi."), ("user", "How are you?")]
    assert listed["data"][1]["content"][0]["type"] == "output_text"
    one = listed["data"][1]["id"]
    assert httpx.get(f"{url}/items/{one}", headers=acme, timeout=10).json() == listed["data"][1]
    assert httpx.delete(f"{url}/items/{one}", headers=acme, timeout=10).json()["id"] == conv["id"]
    assert httpx.get(f"{url}/items/{one}", headers=acme, timeout=10).status_code == 404
    too_many = httpx.post(f"{url}/items", headers=acme, timeout=10,
                          json={"items": [{"role": "user", "content": "x"}] * 21})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "items"
    gone = httpx.delete(url, headers=acme, timeout=10).json()
    assert gone == {"id": conv["id"], "object": "conversation.deleted", "deleted": True}
    assert httpx.get(url, headers=acme, timeout=10).status_code == 404
    # A conversation is not a response, on any route.
    assert httpx.get(f"{coord.url}/v1/responses/{conv['id']}", headers=acme, timeout=10).status_code == 404


def test_responses_in_a_conversation_read_it_and_append_to_it(render_sidecar: Any, sim: SimulatedEngine,
                                                              coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [sim.url])
    client = openai.OpenAI(base_url=f"{coord.url}/v1", api_key="unused", max_retries=0)
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."}])
    first = client.responses.create(model=SERVED, conversation=conv.id, input="Hello!", max_output_tokens=8,
                                    temperature=0)
    assert first.conversation is not None and first.conversation.id == conv.id
    whole = [{"role": "user", "content": "My name is Ada."}, {"role": "user", "content": "Hello!"}]
    assert sim.state()["last_ids"]["token_ids"] == rendered(render_sidecar.url, {"input": whole})
    second = create(coord.url, conversation={"id": conv.id}, input="What is my name?", store=False)
    whole += [{"type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": first.output_text, "annotations": []}]},
              {"role": "user", "content": "What is my name?"}]
    assert sim.state()["last_ids"]["token_ids"] == rendered(render_sidecar.url, {"input": whole})
    items = list(client.conversations.items.list(conv.id, order="asc"))
    texts = [part.text for item in items for part in item.content]  # type: ignore[union-attr]
    assert texts == ["My name is Ada.", "Hello!", first.output_text, "What is my name?", said(second)]
    assert httpx.get(f"{coord.url}/v1/responses/{second['id']}", timeout=10).status_code == 404  # store: false


def test_responses_store_benchmark_quick(render_sidecar: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """perf.responses_store's smoke run: every variant answers every turn, each store's own time and the
    engines' hits are measured, the report and plot are written (the figures are the benchmark's)."""
    import perf._report
    from perf import responses_store

    monkeypatch.setattr(perf._report, "OUT_ROOT", tmp_path)
    responses_store.main(["--quick", "--render-url", str(render_sidecar.url)])
    head = json.loads([line for line in capsys.readouterr().out.splitlines() if line.strip()][-1])
    assert head["benchmark"] == "responses_store" and head["failed"] == 0
    runs = {r["variant"]: r for r in json.loads((tmp_path / "responses_store" / "result.json").read_text())["runs"]}
    assert set(runs) == {"stateless", "sqlite", "redis"} and all(r["requests"] == 12 for r in runs.values())
    assert runs["sqlite"]["put_calls"] == 12 and runs["redis"]["get_calls"] == 8  # 4 conversations x 2 follow-ups
    assert head["sqlite_store_alone_p50_ms"] > 0 and head["redis_followup_hit_rate"] > 0
    assert (tmp_path / "responses_store" / "responses_store.png").stat().st_size > 0


# -- truncation: auto ---------------------------------------------------------------------------------
def test_truncation_auto_drops_the_oldest_turns_to_fit(render_sidecar: Any, sim: SimulatedEngine,
                                                       coordinator_factory: CoordinatorFactory) -> None:
    """Three long turns do not fit the 2,048-token context: ``disabled`` (the default) is a 400 naming
    ``input``; ``auto`` runs the newest turns that fit, cut at a turn's start, and says so."""
    coord = coordinator_factory(render_sidecar.url, [sim.url])
    long = [f"Turn {t}: " + "lighthouse " * 700 for t in range(3)]
    first = create(coord.url, input=long[0])
    second = create(coord.url, previous_response_id=first["id"], input=long[1])
    refused = httpx.post(f"{coord.url}/v1/responses", timeout=30,
                         json={**BODY, "previous_response_id": second["id"], "input": long[2]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input", refused.text
    third = create(coord.url, previous_response_id=second["id"], input=long[2], truncation="auto")
    assert third["truncation"] == "auto" and third["previous_response_id"] == second["id"]
    kept = [{"role": "user", "content": long[1]},
            {"type": "message", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": said(second), "annotations": []}]},
            {"role": "user", "content": long[2]}]
    assert sim.state()["last_ids"]["token_ids"] == rendered(render_sidecar.url, {"input": kept})
    # What fits is not cut: the same call on the second turn keeps everything (asked by an alias).
    create(coord.url, previous_response_id=first["id"], input="Short.", truncation="auto", model="gpt-4o-mini")
    whole = [{"role": "user", "content": long[0]},
             {"type": "message", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": said(first), "annotations": []}]},
             {"role": "user", "content": "Short."}]
    assert sim.state()["last_ids"]["token_ids"] == rendered(render_sidecar.url, {"input": whole})
    alone = httpx.post(f"{coord.url}/v1/responses", timeout=30,
                       json={**BODY, "input": "lighthouse " * 2100, "truncation": "auto"})
    assert alone.status_code == 400 and alone.json()["error"]["param"] == "input", alone.text
    for bad, param in (({"model": "no-such-model"}, "model"), ({"temperature": 9}, "temperature")):
        r = httpx.post(f"{coord.url}/v1/responses", timeout=30,
                       json={**BODY, "input": "Hi", "truncation": "auto", **bad})
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text  # not "input"
    assert released(coord, sim)
