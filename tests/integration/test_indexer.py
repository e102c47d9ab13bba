"""The pod's KV indexer (``scheduling.prefix.indexer``): one process beside the workers holds the prefix
index, so a conversation's turns reach the engine that holds it whichever worker routes them; a
SIGKILLed indexer costs no request (routing falls back to load), is started again, and rebuilds what
the engines hold from their KV events' replay buffers, with the workers' lines back up. Replicas share
one indexer service the same way, and route on load while it is gone."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.pipeline.scheduling.prefix.memory import RECENT_S
from tests.conftest import SERVED, CoordinatorFactory
from tests.integration.test_workers import Pod, pod
from tests.support import ROOT, free_port, wait_until
from token_engine.process import ManagedProcess
from token_engine.simulator import SimConfig, SimulatedEngine

TURN_TOKENS = 48


def _prompt(conversation: int, turns: int) -> list[int]:
    """A conversation's prompt after ``turns`` turns: each turn extends the one before."""
    return [100 + (conversation * 7919 + i * 31) % 20000 for i in range(TURN_TOKENS * turns)]


def _turn(p: Pod, conversation: int, turn: int) -> int:
    r = httpx.post(f"{p.url}/v1/completions", timeout=60,   # a new connection: any worker may take it
                   headers={"x-request-id": f"conv{conversation}-turn{turn}"},
                   json={"model": SERVED, "prompt": _prompt(conversation, turn), "max_tokens": 4,
                         "ignore_eos": True, "temperature": 0})
    return r.status_code


def _served_on(engines: list[SimulatedEngine], ids: list[str]) -> dict[str, str]:
    """Client request id → the engine (url) it ran on, from each engine's own log of what it received
    (the engine's id for a request carries the client's ``x-request-id``)."""
    received = [(entry["request_id"], e.url) for e in engines
                for entry in httpx.get(f"{e.url}/sim/state", timeout=10).json()["history"]]
    out = {}
    for rid in ids:
        where = {url for engine_id, url in received if engine_id.endswith(rid) or f"{rid}-" in engine_id}
        assert len(where) == 1, (rid, received)
        out[rid] = where.pop()
    return out


def _metric(url: str, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} is not on {url}/metrics")


def _ready(p: Pod) -> dict[str, Any]:
    return httpx.get(f"{p.url}/ready", timeout=10).json()


def _index(p: Pod) -> dict[str, Any]:
    state = _ready(p)["prefix_index"]
    assert isinstance(state, dict), state
    return state


def test_turns_reach_the_engine_that_holds_them_whichever_worker_routes(tmp_path: Path,
                                                                       render_sidecar: Any) -> None:
    """Approximate source, two workers: 8 conversations of 4 turns at once, each turn on a new
    connection. Both workers route, and every later turn runs where the conversation's first did
    (each worker alone would know only the turns it routed itself)."""
    engines = [SimulatedEngine(SimConfig(model=SERVED, seed=i, decode_s_per_token=0.002)).start()
               for i in range(2)]
    try:
        extra = {"engines": [{"url": e.url} for e in engines]}
        with pod(tmp_path, str(render_sidecar.url), engines[0].url, **extra) as p:
            state = _index(p)
            assert state["indexer"] == "up" and state["source"] == "approximate"
            statuses: list[int] = []

            def conversation(c: int) -> None:
                for turn in range(1, 5):
                    statuses.append(_turn(p, c, turn))

            threads = [threading.Thread(target=conversation, args=(c,)) for c in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert statuses == [200] * 32
            per_worker = p.metrics()["coordinator_worker_requests"]
            assert len([v for v in per_worker.values() if v > 0]) == 2, per_worker  # both workers routed
            served = _served_on(engines, [f"conv{c}-turn{t}" for c in range(8) for t in range(1, 5)])
            for c in range(8):
                first = served[f"conv{c}-turn1"]
                assert [served[f"conv{c}-turn{t}"] for t in range(2, 5)] == [first] * 3, (
                    c, served, p.metrics().get("coordinator_prefix_indexer_unanswered_total"))
            assert len({served[f"conv{c}-turn1"] for c in range(8)}) == 2   # and load still spreads them
            assert _index(p)["blocks"] > 0
    finally:
        for e in engines:
            e.stop()


def test_a_killed_indexer_costs_no_request_and_rebuilds_from_the_engines_replay(
        tmp_path: Path, render_sidecar: Any) -> None:
    """Precise source, two workers, two engines publishing KV events with replay sockets. The indexer
    is SIGKILLed while requests run: none fails; the supervisor starts it again; the workers' lines
    come back (and send it the feeds again); it holds what the engines hold, from their replay buffers,
    without one more request."""
    ports = [(free_port(), free_port()) for _ in range(2)]
    engines = [SimulatedEngine(SimConfig(model=SERVED, seed=i, decode_s_per_token=0.002,
                                         kv_events_endpoint=f"tcp://*:{pub}",
                                         kv_events_replay_endpoint=f"tcp://*:{replay}")).start()
               for i, (pub, replay) in enumerate(ports)]
    try:
        extra = {"engines": [{"url": e.url, "kv_events": f"tcp://127.0.0.1:{pub}",
                              "kv_events_replay": f"tcp://127.0.0.1:{replay}"}
                             for e, (pub, replay) in zip(engines, ports, strict=True)],
                 "scheduling": {"prefix": {"source": "precise"}}}
        with pod(tmp_path, str(render_sidecar.url), engines[0].url, **extra) as p:
            assert wait_until(lambda: _index(p).get("feeds") == 2, timeout=20), _ready(p)
            first = _index(p)
            statuses: list[int] = []
            stop = threading.Event()

            def load(c: int) -> None:
                turn = 0
                while not stop.is_set():
                    turn += 1
                    statuses.append(_turn(p, c + 100 * (turn // 6), turn % 6 + 1))

            threads = [threading.Thread(target=load, args=(c,)) for c in range(4)]
            for t in threads:
                t.start()
            assert wait_until(lambda: len(statuses) >= 20, timeout=60)
            psutil.Process(first["pid"]).kill()
            assert wait_until(lambda: _index(p).get("pid") not in (None, first["pid"]), timeout=30), _ready(p)
            time.sleep(1.0)
            stop.set()
            for t in threads:
                t.join()
            assert statuses and all(s == 200 for s in statuses), statuses

            def whole() -> bool:
                held = sum(httpx.get(f"{e.url}/sim/state", timeout=10).json()["prefix_cache"]["blocks"]
                           for e in engines)
                state = _index(p)
                return state.get("feeds") == 2 and state.get("blocks") == held > 0

            assert wait_until(whole, timeout=30), (_ready(p), [httpx.get(f"{e.url}/sim/state").json()
                                                               ["prefix_cache"] for e in engines])
            after = _index(p)
            assert after["replayed"] > 0 and after["started_at"] > first["started_at"]
            up = p.metrics()["coordinator_prefix_indexer_up"]
            assert len(up) == 2 and all(v == 1 for v in up.values()), up
    finally:
        for e in engines:
            e.stop()


@pytest.mark.parametrize(("mode", "processes"), [("local", 2), ("auto", 3)])
def test_the_indexer_process_is_there_unless_the_index_is_local(tmp_path: Path, render_sidecar: Any,
                                                                 mode: str, processes: int) -> None:
    """Two workers: ``indexer.mode: local`` starts no indexer process and /ready says the index is each
    worker's own; the default (auto) starts one beside the workers."""
    with SimulatedEngine(SimConfig(model=SERVED, seed=1)) as engine:
        with pod(tmp_path, str(render_sidecar.url), engine.url,
                 scheduling={"prefix": {"indexer": {"mode": mode}}}) as p:
            state = _ready(p)["prefix_index"]
            assert state == "local" if mode == "local" else state["indexer"] == "up"
            assert len(p.spawned()) == processes   # the workers (and the indexer)


def _indexer_service(tmp_path: Path, port: int) -> ManagedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COORD_")}
    process = ManagedProcess([sys.executable, "-m", "coordinator.indexer", "--listen", f"tcp://127.0.0.1:{port}"],
                             env=env, name="indexer", cwd=ROOT, echo=bool(os.environ.get("LLMC_TEST_ECHO")),
                             log_path=tmp_path / f"indexer-{time.monotonic_ns()}.log")
    process.start()
    assert process.wait_for_line(r"KV indexer listening on", timeout=60) is not None, process.tail()
    return process


def _replica_index(r: Any) -> dict[str, Any]:
    """A replica's /ready word on the prefix index."""
    return httpx.get(f"{r.url}/ready", timeout=10).json()["prefix_index"]


def _alternate(replicas: list[Any], c: int, t: int) -> int:
    """Conversation ``c``'s turn ``t``, sent to one replica or the other by the turn's parity."""
    r = replicas[t % 2]
    return httpx.post(f"{r.url}/v1/completions", timeout=60, headers={"x-request-id": f"conv{c}-turn{t}"},
                      json={"model": SERVED, "prompt": _prompt(c, t), "max_tokens": 4,
                            "ignore_eos": True, "temperature": 0}).status_code


def test_replicas_share_one_indexer_service_and_route_on_load_without_it(
        tmp_path: Path, render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """Two coordinator replicas point at one ``python -m coordinator.indexer``: a conversation whose
    turns alternate between the replicas stays on one engine. With the service SIGKILLed every request
    still succeeds (routed on load), /ready and the metrics say why; started again, both replicas are
    back on it by themselves."""
    port = free_port()
    engines = [SimulatedEngine(SimConfig(model=SERVED, seed=i, decode_s_per_token=0.002)).start()
               for i in range(2)]
    service = _indexer_service(tmp_path, port)
    try:
        line = {"prefix": {"indexer": {"mode": "service", "address": f"tcp://127.0.0.1:{port}"}}}
        replicas = [coordinator_factory(str(render_sidecar.url), [e.url for e in engines], scheduling=line)
                    for _ in range(2)]

        assert wait_until(lambda: all(_replica_index(r)["indexer"] == "up" for r in replicas), timeout=20)

        assert [_alternate(replicas, c, t) for c in range(6) for t in range(1, 5)] == [200] * 24
        served = _served_on(engines, [f"conv{c}-turn{t}" for c in range(6) for t in range(1, 5)])
        for c in range(6):
            assert len({served[f"conv{c}-turn{t}"] for t in range(1, 5)}) == 1, (c, served)

        os.kill(service.pid, signal.SIGKILL)
        assert service.wait(10) is not None
        assert wait_until(lambda: all(_replica_index(r)["indexer"] == "down" for r in replicas), timeout=20)
        assert [_alternate(replicas, c, t) for c in range(6, 9) for t in range(1, 3)] == [200] * 6
        unanswered = [_metric(r.url, "coordinator_prefix_indexer_unanswered_total") for r in replicas]
        assert sum(unanswered) == 6, unanswered   # each decision without the index is counted
        assert [_metric(r.url, "coordinator_prefix_indexer_up") for r in replicas] == [0, 0]

        service = _indexer_service(tmp_path, port)
        assert wait_until(lambda: all(_replica_index(r)["indexer"] == "up" for r in replicas), timeout=20)
        assert [_alternate(replicas, 9, t) for t in range(1, 5)] == [200] * 4
        served = _served_on(engines, [f"conv9-turn{t}" for t in range(1, 5)])
        assert len(set(served.values())) == 1, served
    finally:
        service.stop(timeout=10)
        for e in engines:
            e.stop()


def test_an_ha_pair_of_indexer_services_keeps_every_conversation_on_its_engine(
        tmp_path: Path, render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """Two replicas point at an HA pair (``address`` and ``standby``): both services are told every
    replica's lessons. With the first SIGKILLed, the conversations begun before go on reaching the
    engine that holds them (the standby knows them), no decision goes without an answer, and /ready
    names the line that is down; started again, the first is back on both replicas' lines."""
    ports = [free_port(), free_port()]
    engines = [SimulatedEngine(SimConfig(model=SERVED, seed=i, decode_s_per_token=0.002)).start()
               for i in range(3)]
    services = [_indexer_service(tmp_path, port) for port in ports]
    first, second = (f"tcp://127.0.0.1:{port}" for port in ports)
    try:
        line = {"prefix": {"indexer": {"mode": "service", "address": first, "standby": second}}}
        replicas = [coordinator_factory(str(render_sidecar.url), [e.url for e in engines], scheduling=line)
                    for _ in range(2)]

        assert wait_until(lambda: all(_replica_index(r).get("lines") == {first: "up", second: "up"} for r in replicas),
                          timeout=20)

        assert [_alternate(replicas, c, t) for c in range(6) for t in range(1, 3)] == [200] * 12
        os.kill(services[0].pid, signal.SIGKILL)
        assert services[0].wait(10) is not None
        assert wait_until(lambda: all(_replica_index(r).get("lines") == {first: "down", second: "up"} for r in replicas),
                          timeout=20)
        assert all(_replica_index(r)["indexer"] == "up" and _replica_index(r)["answered_by"] == second for r in replicas)
        time.sleep(RECENT_S + 0.5)   # the replicas' own recent lessons are gone: only the standby knows
        assert [_alternate(replicas, c, t) for c in range(6) for t in range(3, 5)] == [200] * 12
        served = _served_on(engines, [f"conv{c}-turn{t}" for c in range(6) for t in range(1, 5)])
        for c in range(6):   # turns 3 and 4, routed with the standby's index, joined turns 1 and 2
            assert len({served[f"conv{c}-turn{t}"] for t in range(1, 5)}) == 1, (c, served)
        assert [_metric(r.url, "coordinator_prefix_indexer_unanswered_total") for r in replicas] == [0, 0]
        assert [_metric(r.url, "coordinator_prefix_indexer_up") for r in replicas] == [1, 1]

        services[0] = _indexer_service(tmp_path, ports[0])
        assert wait_until(lambda: all(_replica_index(r).get("lines") == {first: "up", second: "up"} for r in replicas),
                          timeout=20)
    finally:
        for service in services:
            service.stop(timeout=10)
        for e in engines:
            e.stop()
