"""LoRA adapters through the whole coordinator: real render sidecar, simulated engines that speak
vLLM's adapter API (load / unload routes, ``/v1/models`` with ``parent``, ``vllm:lora_requests_info``,
``max_loras`` deferral). tests/e2e/test_lora_real.py runs the same paths on real vLLM engines.

What a user sees: an adapter is a model (listed, named in ``model``, answered under its name); it is
loaded where it is needed and requests follow it there; an engine never holds more than it may, and
what is running is never unloaded; a failed load goes elsewhere, then ends in an error naming it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from coordinator.contracts.permutation import KeyedPermutation
from coordinator.nnrp.client import NnrpClient
from tests.conftest import SERVED, CoordinatorFactory
from tests.support import CoordinatorServer, sse_events, wait_until
from token_engine.simulator import SimConfig, SimulatedEngine

ADAPTERS = [{"name": "support-bot", "path": "sim:support"}, {"name": "sql-writer", "path": "sim:sql"}]


@contextmanager
def sims(n: int, **cfg: Any) -> Iterator[list[SimulatedEngine]]:
    base: dict[str, Any] = {"model": SERVED, "enable_lora": True, "max_loras": 1, "decode_s_per_token": 0.002}
    with ExitStack() as stack:
        yield [stack.enter_context(SimulatedEngine(SimConfig(seed=i, **{**base, **cfg}))) for i in range(n)]


def models(adapters: list[dict[str, Any]] = ADAPTERS) -> list[dict[str, Any]]:
    return [{"name": SERVED, "aliases": ["gpt-4o-mini"], "adapters": adapters}]


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Write a haiku about tests."}],
            "max_tokens": 12, **extra}


def loras(sim: SimulatedEngine) -> dict[str, Any]:
    state: dict[str, Any] = sim.state()["loras"]
    return state


def sent_models(sim: SimulatedEngine) -> list[str | None]:
    return [h["model"] for h in sim.state()["history"]]


def start(factory: CoordinatorFactory, render: Any, fleet: list[SimulatedEngine], **overrides: Any
          ) -> CoordinatorServer:
    """A coordinator that probes its engines every 0.2 s (what they hold is learned in each round)."""
    overrides.setdefault("models", models())
    overrides["engine_client"] = {"health_interval_s": 0.2, **overrides.get("engine_client", {})}
    return factory(str(render.url), [s.url for s in fleet], **overrides)


def released(coord: CoordinatorServer) -> bool:
    return all(not e.adapters.inflight and e.inflight_requests == 0 for e in coord.components.registry.engines)


def test_an_adapter_is_a_model_clients_can_name(render_sidecar: Any,
                                                coordinator_factory: CoordinatorFactory) -> None:
    """Listed as vLLM lists one (parent: the base, root: its path); answered under its own name,
    streaming or not; the engine runs it by name while render and derender use the base model."""
    with sims(1) as (sim,):
        coord = start(coordinator_factory, render_sidecar, [sim])
        listed = {m["id"]: m for m in httpx.get(f"{coord.url}/v1/models").json()["data"]}
        assert listed["support-bot"]["parent"] == SERVED and listed["support-bot"]["root"] == "sim:support"
        assert listed[SERVED]["parent"] is None
        r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat("support-bot"), timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "support-bot" and r.json()["choices"][0]["message"]["content"]
        streamed = httpx.post(f"{coord.url}/v1/chat/completions", json=chat("support-bot", stream=True), timeout=30)
        events = [e for e in sse_events(streamed) if isinstance(e, dict)]
        assert events and {e["model"] for e in events} == {"support-bot"}
        completion = httpx.post(f"{coord.url}/v1/completions", timeout=30,
                                json={"model": "support-bot", "prompt": "Hello", "max_tokens": 5})
        assert completion.status_code == 200 and completion.json()["model"] == "support-bot"
        base = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(SERVED), timeout=30)
        assert base.json()["model"] == SERVED
        assert sent_models(sim) == ["support-bot", "support-bot", "support-bot", SERVED]
        assert loras(sim)["load_calls"] == 1, "the adapter is loaded once, then held"
        assert released(coord)


def test_an_unknown_adapter_is_a_404_naming_it(render_sidecar: Any,
                                              coordinator_factory: CoordinatorFactory) -> None:
    with sims(1) as (sim,):
        coord = start(coordinator_factory, render_sidecar, [sim])
        r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat("no-such-adapter"), timeout=30)
        assert r.status_code == 404
        err = r.json()["error"]
        assert "no-such-adapter" in err["message"] and err["param"] == "model"
        assert loras(sim)["load_calls"] == 0 and sim.state()["generate_calls"] == 0


def test_requests_follow_the_adapter_to_the_engine_that_holds_it(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """Four engines, two adapters, 24 requests: each adapter is loaded on one engine and every later
    request for it goes there (round robin would have loaded each on every engine)."""
    with sims(4, max_loras=2) as engines:
        coord = start(coordinator_factory, render_sidecar, engines)
        for i in range(24):
            name = ADAPTERS[i % 2]["name"]
            r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(name, max_tokens=4), timeout=30)
            assert r.status_code == 200, r.text
        holders = {a["name"]: [s.url for s in engines if a["name"] in loras(s)["registered"]] for a in ADAPTERS}
        assert all(len(urls) == 1 for urls in holders.values()), holders
        assert sum(loras(s)["load_calls"] for s in engines) == 2
        for a in ADAPTERS:
            (holder,) = [s for s in engines if s.url == holders[a["name"]][0]]
            assert sent_models(holder).count(a["name"]) == 12
        placements = coord.components.metrics.registry.get_sample_value
        assert placements("coordinator_lora_placements_total", {"residency": "held"}) == 22


def test_a_full_engine_unloads_its_idle_adapter_never_a_running_one(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """One engine with room for one adapter: asking for the second unloads the first (idle); while a
    stream of the first is running, asking for the second loads it beside it instead (the engine runs
    it once the stream ends: vLLM defers an adapter beyond --max-loras)."""
    with sims(1, max_loras=1, decode_s_per_token=0.02) as (sim,):
        coord = start(coordinator_factory, render_sidecar, [sim])
        engine = coord.components.registry.engines[0]
        assert wait_until(lambda: engine.adapters.learned_capacity == 1, timeout=10), "max_lora from metrics"
        assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat("support-bot"), timeout=30).status_code == 200
        assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat("sql-writer"), timeout=30).status_code == 200
        assert set(loras(sim)["registered"]) == {"sql-writer"}, "the idle adapter made room"
        evictions = coord.components.metrics.registry.get_sample_value(
            "coordinator_lora_evictions_total", {"engine": sim.url})
        assert evictions == 1

        done = threading.Event()

        def long_stream() -> None:
            body = chat("sql-writer", stream=True, max_tokens=150)
            with httpx.stream("POST", f"{coord.url}/v1/chat/completions", json=body, timeout=60) as s:
                for _ in s.iter_lines():
                    pass
            done.set()

        statuses: list[int] = []
        t = threading.Thread(target=long_stream)
        t.start()
        assert wait_until(lambda: sim.state()["running"], timeout=10)
        other = threading.Thread(target=lambda: statuses.append(httpx.post(
            f"{coord.url}/v1/chat/completions", json=chat("support-bot", max_tokens=4), timeout=60).status_code))
        other.start()
        assert wait_until(lambda: "support-bot" in loras(sim)["registered"], timeout=10)
        assert "sql-writer" in loras(sim)["registered"], "the running adapter was unloaded"
        assert wait_until(lambda: loras(sim)["deferred"], timeout=10), "the engine defers the second adapter"
        assert not done.is_set(), "the running stream was cut"
        t.join(60)
        other.join(60)
        assert done.is_set() and statuses == [200] and released(coord)


def test_a_failed_load_goes_to_another_engine_then_names_the_adapter(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """An engine that cannot load adapters at run time is skipped for one that can; with none that can,
    the client gets a 503 naming the adapter and why, and nothing stays held."""
    with sims(1, runtime_lora_updating=False) as (fixed,), sims(1) as (dynamic,):
        coord = start(coordinator_factory, render_sidecar, [fixed, dynamic], scheduling={"policy": "round_robin"})
        for _ in range(4):
            r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat("support-bot"), timeout=30)
            assert r.status_code == 200, r.text
        assert sent_models(dynamic).count("support-bot") == 4 and not sent_models(fixed)

        alone = start(coordinator_factory, render_sidecar, [fixed])
        r = httpx.post(f"{alone.url}/v1/chat/completions", json=chat("support-bot"), timeout=30)
        assert r.status_code == 503
        err = r.json()["error"]
        assert "support-bot" in err["message"] and "at run time" in err["message"]
        assert released(alone) and not sent_models(fixed)


def test_an_adapter_the_engine_refuses_is_a_400_and_the_engine_lives_on(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """A rank above the engine's --max-lora-rank: vLLM's 500 for the load is the adapter's fault, so
    the client gets a 400 naming it; the full engine's idle adapter was not unloaded for it (loads
    come before unloads) and the base model still answers on the same engine."""
    wide = [*ADAPTERS, {"name": "too-wide", "path": "sim:rank=64"}]
    with sims(1, max_lora_rank=16, max_loras=1) as (sim,):
        coord = start(coordinator_factory, render_sidecar, [sim], models=models(wide))
        engine = coord.components.registry.engines[0]
        assert wait_until(lambda: engine.adapters.learned_capacity == 1, timeout=10)
        assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat("support-bot"), timeout=30).status_code == 200
        r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat("too-wide"), timeout=30)
        assert r.status_code == 400
        assert "too-wide" in r.json()["error"]["message"] and "max_lora_rank" in r.json()["error"]["message"]
        assert set(loras(sim)["registered"]) == {"support-bot"}, "a failed load unloaded nothing"
        assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat(SERVED), timeout=30).status_code == 200
        assert released(coord)


def test_an_adapter_unloaded_behind_the_coordinators_back_is_loaded_again(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """Another coordinator (or an operator) unloaded it: the engine's 404 for the name makes the
    coordinator load it again and retry, and the client never sees it."""
    with sims(1) as (sim,):
        coord = start(coordinator_factory, render_sidecar, [sim])
        assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat("support-bot"), timeout=30).status_code == 200
        httpx.post(f"{sim.url}/v1/unload_lora_adapter", json={"lora_name": "support-bot"}).raise_for_status()
        r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat("support-bot"), timeout=30)
        assert r.status_code == 200, r.text
        assert loras(sim)["load_calls"] == 2


def test_the_engines_own_list_is_learned(render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """An adapter an operator loaded on the engine by hand counts as held after a probe round (no load
    is asked for it), and one the engine lost (a restart) counts as gone."""
    with sims(2, max_loras=2) as engines:
        coord = start(coordinator_factory, render_sidecar, engines)
        httpx.post(f"{engines[1].url}/v1/load_lora_adapter",
                   json={"lora_name": "sql-writer", "lora_path": "sim:sql"}).raise_for_status()
        assert wait_until(lambda: coord.components.registry.get(engines[1].url).adapters.holds("sql-writer"),
                          timeout=10)
        for _ in range(3):
            assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat("sql-writer"),
                              timeout=30).status_code == 200
        assert sent_models(engines[1]).count("sql-writer") == 3 and loras(engines[1])["load_calls"] == 1
        httpx.post(f"{engines[1].url}/v1/unload_lora_adapter", json={"lora_name": "sql-writer"}).raise_for_status()
        assert wait_until(lambda: not coord.components.registry.get(engines[1].url).adapters.holds("sql-writer"),
                          timeout=10)


def test_pins_admin_and_tenants(render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """A configured pin is loaded at start-up and never unloaded for room; /admin lists residency,
    unloads, pins (loading) and unpins; a tenant limited to some adapters gets a 403 for another, does
    not see it in /v1/models, and has no admin route."""
    with sims(1, max_loras=1) as (sim,):
        pinned = [{**ADAPTERS[0], "engines": [sim.url]}, ADAPTERS[1]]
        coord = start(
            coordinator_factory, render_sidecar, [sim], models=models(pinned), server={"api_keys": ["ops-key"]},
            tenants={"members": [{"name": "sql-team", "api_keys": ["sql-key"], "adapters": ["sql-writer"]}]})
        ops = {"Authorization": "Bearer ops-key"}
        assert wait_until(lambda: "support-bot" in loras(sim)["registered"], timeout=10), "pinned at start"
        r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat("sql-writer"), timeout=30, headers=ops)
        assert r.status_code == 200
        assert set(loras(sim)["registered"]) == {"support-bot", "sql-writer"}, "the pin was not unloaded"

        sql = {"Authorization": "Bearer sql-key"}
        denied = httpx.post(f"{coord.url}/v1/chat/completions", json=chat("support-bot"), timeout=30, headers=sql)
        assert denied.status_code == 403 and "support-bot" in denied.json()["error"]["message"]
        assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat("sql-writer"), timeout=30,
                          headers=sql).status_code == 200
        assert httpx.get(f"{coord.url}/admin/adapters", headers=sql).status_code == 403
        seen = {m["id"] for m in httpx.get(f"{coord.url}/v1/models", headers=sql).json()["data"]}
        assert "sql-writer" in seen and SERVED in seen and "support-bot" not in seen, seen
        assert httpx.get(f"{coord.url}/v1/models/support-bot", headers=sql).status_code == 404
        assert httpx.get(f"{coord.url}/v1/models/support-bot", headers=ops).status_code == 200

        listing = httpx.get(f"{coord.url}/admin/adapters", headers=ops).json()
        assert {a["name"]: a["engines"] for a in listing["adapters"]} == {"support-bot": [sim.url],
                                                                          "sql-writer": [sim.url]}
        assert listing["engines"][sim.url]["pinned"] == ["support-bot"]
        unloaded = httpx.post(f"{coord.url}/admin/adapters/unload", headers=ops,
                              json={"adapter": "sql-writer", "engine": sim.url})
        assert unloaded.status_code == 200 and unloaded.json()["held"] == ["support-bot"]
        assert set(loras(sim)["registered"]) == {"support-bot"}
        pinned_now = httpx.post(f"{coord.url}/admin/adapters/pin", headers=ops,
                                json={"adapter": "sql-writer", "engine": sim.url})
        assert pinned_now.status_code == 200 and pinned_now.json()["pinned"] == ["sql-writer", "support-bot"]
        assert set(loras(sim)["registered"]) == {"support-bot", "sql-writer"}, "pinning loads it"
        unpinned = httpx.post(f"{coord.url}/admin/adapters/unpin", headers=ops,
                              json={"adapter": "sql-writer", "engine": sim.url})
        assert unpinned.json()["pinned"] == ["support-bot"]
        unknown = httpx.post(f"{coord.url}/admin/adapters/pin", headers=ops, json={"adapter": "x", "engine": sim.url})
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "adapter"


def test_admin_loads_refuse_paths_outside_the_allowed_roots(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory, tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    (root / "extra").mkdir(parents=True)
    (root / "extra" / "adapter_config.json").write_text('{"r": 8, "peft_type": "LORA"}')
    with sims(1, max_loras=2) as (sim,):
        coord = start(coordinator_factory, render_sidecar, [sim], models=models([]),
                      lora={"allowed_roots": [str(root)]})
        outside = httpx.post(f"{coord.url}/admin/adapters/load", json={
            "adapter": "escape", "engine": sim.url, "model": SERVED, "path": str(root / ".." / "etc")})
        assert outside.status_code == 400 and outside.json()["error"]["param"] == "path"
        assert loras(sim)["load_calls"] == 0
        missing = httpx.post(f"{coord.url}/admin/adapters/load", json={
            "adapter": "ghost", "engine": sim.url, "model": SERVED, "path": str(root / "ghost")})
        assert missing.status_code == 404 and "ghost" in missing.json()["error"]["message"]
        assert "ghost" not in {m["id"] for m in httpx.get(f"{coord.url}/v1/models").json()["data"]}, \
            "an adapter that did not load is not served"
        ok = httpx.post(f"{coord.url}/admin/adapters/load", json={
            "adapter": "extra", "engine": sim.url, "model": SERVED, "path": str(root / "extra")})
        assert ok.status_code == 200 and ok.json()["held"] == ["extra"]
        assert "extra" in {m["id"] for m in httpx.get(f"{coord.url}/v1/models").json()["data"]}
        r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat("extra"), timeout=30)
        assert r.status_code == 200 and r.json()["model"] == "extra"


def test_both_legs_of_a_pd_pair_run_the_adapter(render_sidecar: Any,
                                                coordinator_factory: CoordinatorFactory) -> None:
    with sims(1, kv_role="prefill", engine_id="p0") as (pre,), sims(1, kv_role="decode", engine_id="d0") as (dec,):
        coord = start(coordinator_factory, render_sidecar, [],
                      engines=[{"url": pre.url, "role": "prefill"}, {"url": dec.url, "role": "decode"}],
                      topology={"pd_min_uncached_tokens": 0})
        r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat("support-bot"), timeout=30)
        assert r.status_code == 200, r.text
        assert sent_models(pre) == ["support-bot"] and sent_models(dec) == ["support-bot"]
        assert released(coord)


def test_an_adapters_prefix_is_its_own(render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """The engines' KV events carry the adapter (vLLM's ``lora_name``): the precise index files the
    adapter run's blocks under the adapter, so its next request finds them and the base model's request
    with the same prompt does not (vLLM would not reuse them either)."""
    with sims(1, max_loras=2, kv_events_endpoint="tcp://*:0") as (sim,):
        endpoint = sim.state()["kv_events"]["endpoint"].replace("*", "127.0.0.1")
        coord = start(coordinator_factory, render_sidecar, [], engines=[{"url": sim.url, "kv_events": endpoint}],
                      scheduling={"prefix": {"source": "precise", "block_size": 16}})
        body = {"messages": [{"role": "user", "content": "Summarise the following text. " * 30}], "max_tokens": 2}

        def hits() -> float:
            value = coord.components.metrics.registry.get_sample_value("coordinator_prefix_hit_tokens_total")
            return float(value or 0.0)

        index = coord.components.scheduler.index
        assert index is not None
        assert httpx.post(f"{coord.url}/v1/chat/completions", json={**body, "model": "support-bot"},
                          timeout=30).status_code == 200
        assert wait_until(lambda: index.blocks(sim.url) > 0, timeout=10), "the adapter run's KV events"
        assert httpx.post(f"{coord.url}/v1/chat/completions", json={**body, "model": SERVED},
                          timeout=30).status_code == 200
        assert hits() == 0, "the base model's request matched the adapter's blocks"
        assert httpx.post(f"{coord.url}/v1/chat/completions", json={**body, "model": "support-bot"},
                          timeout=30).status_code == 200
        assert hits() > 0, "the adapter's own blocks were not found"


def test_every_door_takes_an_adapter(render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """Messages, Responses and NNRP name the adapter as chat does: the engine runs it, the answer
    carries its name, NNRP's model list shows it."""
    key = {"Authorization": "Bearer sk-lora"}
    with sims(1) as (sim,):
        coord = start(coordinator_factory, render_sidecar, [sim], server={"api_keys": ["sk-lora"]})
        messages = httpx.post(f"{coord.url}/v1/messages", headers=key, timeout=30, json={
            "model": "sql-writer", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]})
        assert messages.status_code == 200 and messages.json()["model"] == "sql-writer", messages.text
        responses = httpx.post(f"{coord.url}/v1/responses", headers=key, timeout=30, json={
            "model": "sql-writer", "input": "Hi", "max_output_tokens": 8})
        assert responses.status_code == 200 and responses.json()["model"] == "sql-writer", responses.text

        async def over_nnrp() -> tuple[list[dict[str, Any]], dict[str, Any]]:
            url = coord.url.replace("http://", "ws://") + "/nnrp/v1"
            async with await NnrpClient.connect(url, api_key="sk-lora") as client:
                listed = await client.models()
                op = await client.chat({**chat("sql-writer"), "stream": True})
                return [e async for e in op], listed

        events, listed = asyncio.run(over_nnrp())
        assert events[-1]["type"] == "response.completed"
        assert "sql-writer" in {m["id"] for m in listed["data"]}
        assert sent_models(sim) == ["sql-writer"] * 3 and loras(sim)["load_calls"] == 1


def test_a_hot_adapter_spreads_to_a_second_engine(render_sidecar: Any,
                                                  coordinator_factory: CoordinatorFactory) -> None:
    """lora.replicate_inflight 2: while its holder runs two of its streams, the next request for the
    adapter may go to the other engine (the load scorer prefers the idle one), so it is loaded there
    too; with the rule off (a huge threshold) every request stays on the holder."""
    def run(replicate: int) -> list[SimulatedEngine]:
        with sims(2, max_loras=2, decode_s_per_token=0.02) as engines:
            coord = start(coordinator_factory, render_sidecar, engines, lora={"replicate_inflight": replicate})
            assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat("support-bot", max_tokens=2),
                              timeout=30).status_code == 200
            threads = [threading.Thread(target=lambda: httpx.post(
                f"{coord.url}/v1/chat/completions", json=chat("support-bot", max_tokens=60), timeout=60))
                for _ in range(4)]
            for t in threads:
                t.start()
                time.sleep(0.2)
            for t in threads:
                t.join(60)
            return [s for s in engines if "support-bot" in loras(s)["registered"]]

    assert len(run(replicate=2)) == 2
    assert len(run(replicate=1000)) == 1


def test_a_relayed_stream_continues_on_an_engine_that_loads_the_adapter(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """The engine running an adapter's stream drops it mid-way: the stream continues on the other engine,
    which loads the adapter first; the client sees one whole stream under the adapter's name."""
    with sims(2, max_loras=2, mode="context", decode_s_per_token=0.003) as engines:
        coord = start(coordinator_factory, render_sidecar, engines, engine_client={"stream_idle_timeout_s": 1.0})
        assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat("support-bot", max_tokens=2),
                          timeout=30).status_code == 200
        (holder,) = [s for s in engines if "support-bot" in loras(s)["registered"]]
        holder.set_faults(calls=1, drop_after_tokens=6)
        events = sse_events(httpx.post(f"{coord.url}/v1/chat/completions",
                                       json=chat("support-bot", stream=True, max_tokens=30), timeout=60))
        assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events), events
        assert {e["model"] for e in events if isinstance(e, dict)} == {"support-bot"}
        assert coord.components.metrics.relays._value.get() == 1
        (other,) = [s for s in engines if s is not holder]
        assert sent_models(holder) == ["support-bot"] * 2 and sent_models(other) == ["support-bot"]
        assert "support-bot" in loras(other)["registered"], "the relay target loaded it"


def test_both_legs_of_a_trigger_pair_run_the_adapter(render_sidecar: Any,
                                                     coordinator_factory: CoordinatorFactory) -> None:
    """Trigger P/D: the prefill engine is chosen at the decode engine's callback; it loads the adapter
    then, before its leg is sent."""
    layerwise = {"mode": "context", "kv_connector": "layerwise"}
    with sims(1, kv_role="prefill", engine_id="tp", **layerwise) as (pre,), \
            sims(1, kv_role="decode", engine_id="td", **layerwise) as (dec,):
        coord = start(coordinator_factory, render_sidecar, [],
                      engines=[{"url": pre.url, "role": "prefill", "pd_protocol": "trigger"},
                               {"url": dec.url, "role": "decode", "pd_protocol": "trigger"}],
                      topology={"pd_min_uncached_tokens": 0, "trigger": {"port": 0}})
        r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat("support-bot"), timeout=30)
        assert r.status_code == 200 and r.json()["model"] == "support-bot", r.text
        assert sent_models(pre) == ["support-bot"] and sent_models(dec) == ["support-bot"]
        assert dec.state()["layerwise"]["callback_statuses"] == [200]
        assert released(coord)


def test_an_adapter_runs_under_token_obfuscation(render_sidecar: Any, model_dir: Path, tmp_path: Path,
                                                 coordinator_factory: CoordinatorFactory) -> None:
    """With obfuscation the engine (a key-permuted copy) gets physical ids and the adapter's name; the
    client gets what the plain engine answers for the same adapter. An adapter of the attention
    projections needs no permutation (docs/lora.md)."""
    key = bytes(range(32))
    (tmp_path / "token.key").write_bytes(key)
    table = KeyedPermutation(49152, key).physical_table()
    plain_cfg = SimConfig(model=SERVED, enable_lora=True)
    permuted_cfg = SimConfig(model=SERVED, enable_lora=True, eos_token_id=table[2],
                             echo_skip_ids=[table[s] for s in range(17)],
                             echo_fallback_token_id=table[plain_cfg.echo_fallback_token_id])
    with SimulatedEngine(plain_cfg) as plain, SimulatedEngine(permuted_cfg) as permuted:
        off = start(coordinator_factory, render_sidecar, [plain])
        on = start(coordinator_factory, render_sidecar, [permuted],
                   models=[{"name": SERVED, "path": str(model_dir), "adapters": ADAPTERS}],
                   obfuscation={"enabled": True, "key_file": str(tmp_path / "token.key")})
        body = chat("support-bot", temperature=0)
        a = httpx.post(f"{off.url}/v1/chat/completions", json=body, timeout=30)
        b = httpx.post(f"{on.url}/v1/chat/completions", json=body, timeout=30)
        assert a.status_code == b.status_code == 200, b.text
        assert b.json()["model"] == "support-bot"
        assert b.json()["choices"][0]["message"]["content"] == a.json()["choices"][0]["message"]["content"]
        assert sent_models(permuted) == ["support-bot"]
        assert permuted.state()["last_ids"]["token_ids"] != plain.state()["last_ids"]["token_ids"]
