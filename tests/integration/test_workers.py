"""``server.workers: 2``: one ``python -m coordinator`` process supervising two workers on one port,
in front of the real render sidecar and a simulated engine, seen as a client and an operator see it:
requests spread over the workers while ``/metrics`` and ``/ready`` answer for the pod whichever
worker a connection reaches; SIGTERM drains every worker (an open stream ends whole, exit 0, the
port stops accepting); a SIGKILLed worker is started again while the pod keeps answering; with the
local fleet backend the workers split the engine's budget, so the pod never exceeds it."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import SERVED
from tests.support import ROOT, StreamReader, peak_at_engine, refused, wait_until
from token_engine.process import ManagedProcess
from token_engine.simulator import SimConfig, SimulatedEngine

BODY = {"model": SERVED, "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 40, "ignore_eos": True,
        "temperature": 0}
COST = 8 + 40  # prompt + max_tokens: what admission counts per request


class Pod:
    """The supervisor process, its port (it binds port 0 itself) and its workers."""

    def __init__(self, process: ManagedProcess, port: int) -> None:
        self.process = process
        self.port = port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawned(self) -> list[psutil.Process]:
        """The supervisor's processes: its workers and the pod's KV indexer."""
        children = psutil.Process(self.process.pid).children()
        return [p for p in children if "spawn_main" in " ".join(p.cmdline())]

    def workers(self) -> list[psutil.Process]:
        state = httpx.get(f"{self.url}/ready", timeout=10).json().get("prefix_index")
        indexer = state.get("pid") if isinstance(state, dict) else None
        return [p for p in self.spawned() if p.pid != indexer]

    def metrics(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        """Each sample of the pod's /metrics (asked on a new connection): name → labels → value."""
        out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for fam in text_string_to_metric_families(httpx.get(f"{self.url}/metrics", timeout=10).text):
            for s in fam.samples:
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return out


@contextmanager
def pod(tmp_path: Path, render_url: str, engine_url: str, **sections: Any) -> Iterator[Pod]:
    server = {"workers": 2, "host": "127.0.0.1", "log_level": "info", **sections.pop("server", {})}
    config = {"render": {"url": render_url}, "engines": [{"url": engine_url}], "models": [{"name": SERVED}],
              "server": server, **sections}
    path = tmp_path / "pod.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("COORD_")}
    process = ManagedProcess([sys.executable, "-m", "coordinator", "--config", str(path), "--port", "0"],
                             env=env, name="pod", cwd=ROOT, echo=bool(os.environ.get("LLMC_TEST_ECHO")),
                             log_path=tmp_path / "pod.log")
    process.start()
    try:
        line = process.wait_for_line(r"workers on http://127\.0\.0\.1:\d+", timeout=60)
        assert line is not None, process.tail()
        match = re.search(r":(\d+)\s*$", line)
        assert match is not None, line
        p = Pod(process, int(match.group(1)))
        process.wait_http_ready(f"{p.url}/ready", timeout=120, interval=0.2)
        yield p
    finally:
        process.stop(timeout=20)


@pytest.fixture
def slow_engine() -> Iterator[SimulatedEngine]:
    with SimulatedEngine(SimConfig(model=SERVED, seed=5, decode_s_per_token=0.02)) as engine:
        yield engine


@pytest.fixture
def fast_engine() -> Iterator[SimulatedEngine]:
    with SimulatedEngine(SimConfig(model=SERVED, seed=5, decode_s_per_token=0.002)) as engine:
        yield engine


def _total(samples: dict[tuple[tuple[str, str], ...], float]) -> float:
    return sum(samples.values())


def test_requests_spread_over_the_workers_and_the_pod_answers_for_all(
        tmp_path: Path, render_sidecar: Any, fast_engine: SimulatedEngine) -> None:
    """40 requests, each on a new connection, 8 at a time: more than one worker serves them, and the
    pod's request counter is 40 whichever worker a /metrics scrape reaches; /ready lists both."""
    with pod(tmp_path, str(render_sidecar.url), fast_engine.url) as p:
        statuses: list[int] = []

        def client() -> None:
            for _ in range(5):
                statuses.append(httpx.post(f"{p.url}/v1/completions", json=BODY, timeout=60).status_code)

        threads = [threading.Thread(target=client) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert statuses == [200] * 40
        for _ in range(6):  # new connections: whichever worker accepts answers for the pod
            m = p.metrics()
            assert _total(m["coordinator_requests_total"]) == 40
            per_worker = {dict(k)["worker"]: v for k, v in m["coordinator_worker_requests"].items()}
            assert sorted(per_worker) == ["0", "1"] and sum(per_worker.values()) == 40
            assert all(v > 0 for v in per_worker.values()), f"one worker served everything: {per_worker}"
            assert _total(m["coordinator_worker_up"]) == 2
        print(f"requests per worker: {per_worker}")
        for _ in range(4):
            r = httpx.get(f"{p.url}/ready", timeout=10)
            assert r.status_code == 200 and r.json()["ready"] is True
            assert r.json()["workers"] == {"0": True, "1": True}


def test_sigterm_drains_every_worker_then_the_pod_exits_0(
        tmp_path: Path, render_sidecar: Any, slow_engine: SimulatedEngine) -> None:
    """SIGTERM to the supervisor while a stream is open: /ready turns 503, the port stops accepting
    after the delay, the stream ends whole, every worker exits and so does the pod, with status 0."""
    with pod(tmp_path, str(render_sidecar.url), slow_engine.url,
             server={"drain_delay_s": 2.0, "drain_timeout_s": 60}) as p, \
            httpx.Client(base_url=p.url, timeout=10) as probe:
        assert probe.get("/ready").status_code == 200
        workers = p.workers()
        assert len(workers) == 2
        spawned = p.spawned()   # the workers and the pod's KV indexer, which serves them to the end
        assert len(spawned) == 3
        stream = {**BODY, "max_tokens": 150, "stream": True}  # ~3 s at 20 ms a token
        reader = StreamReader(p.url, stream, path="/v1/completions")
        reader.start()
        assert reader.first.wait(30) and reader.error is None
        # The probe's connection is used once more right before the signal: an idle keep-alive
        # connection the server times out meanwhile would fail the probe for a reason of its own.
        assert probe.get("/health").status_code == 200
        os.kill(p.process.pid, signal.SIGTERM)

        def draining() -> bool:
            r = probe.get("/ready")
            return r.status_code == 503 and r.json()["draining"] is True

        # The supervisor passes the signal on to one worker after the other: whichever answers, the
        # pod reads as draining as soon as one of them drains, well inside the 2 s delay.
        assert wait_until(draining, timeout=1.5), "/ready did not turn 503 draining within the delay"
        assert reader.is_alive(), "the stream must still be running while the pod drains"
        assert wait_until(lambda: refused(p.url), timeout=30), "the port still accepts connections"
        reader.join(60)
        assert reader.error is None and reader.status == 200
        events = reader.events
        assert events[-1] == "[DONE]"
        assert not any("error" in e for e in events if isinstance(e, dict))
        finish = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", [])
                  if c.get("finish_reason")]
        assert finish == ["length"]
        assert p.process.wait(60) == 0
        assert not any(w.is_running() for w in spawned)


def test_a_killed_worker_is_started_again_while_the_pod_keeps_answering(
        tmp_path: Path, render_sidecar: Any, fast_engine: SimulatedEngine) -> None:
    with pod(tmp_path, str(render_sidecar.url), fast_engine.url) as p:
        before = p.workers()
        assert len(before) == 2
        before[0].send_signal(signal.SIGKILL)
        before[0].wait(10)
        statuses = [httpx.post(f"{p.url}/v1/completions", json=BODY, timeout=60).status_code for _ in range(10)]
        assert statuses == [200] * 10

        def back() -> bool:
            r = httpx.get(f"{p.url}/ready", timeout=10)
            return r.status_code == 200 and r.json()["workers"] == {"0": True, "1": True}

        assert wait_until(back, timeout=60), "the killed worker did not come back"
        now = p.workers()
        assert len(now) == 2 and before[1].pid in {w.pid for w in now} and before[0].pid not in {w.pid for w in now}
        m = p.metrics()
        assert _total(m["coordinator_worker_restarts"]) == 1
        assert _total(m["coordinator_worker_up"]) == 2
        assert p.process.wait_for_line(r"worker \d \(pid \d+\) exited with status -9", timeout=5) is not None


def test_local_backend_splits_the_engine_budget_between_the_workers(
        tmp_path: Path, render_sidecar: Any, slow_engine: SimulatedEngine) -> None:
    """The engine's budget fits three requests. Two workers each admitting against all of it would let
    the engine hold up to six (tests/integration/test_fleet_redis.py, two coordinators); with the
    local backend each worker has half, so the engine never holds more than three."""
    with pod(tmp_path, str(render_sidecar.url), slow_engine.url,
             admission={"engine_tokens": 3 * COST + COST // 2, "fleet": {"backend": "local"}}) as p:
        # Which worker accepts a connection is the kernel's choice; a round in which one worker got
        # none shows nothing about the split, so it is run again (each round still must hold the bound).
        for _ in range(3):
            peak, done = peak_at_engine([p.url], slow_engine, BODY, clients=8, seconds=4.0,
                                        new_connections=True)
            per_worker = {dict(k)["worker"]: v for k, v in p.metrics()["coordinator_worker_requests"].items()}
            print(f"two workers, local backend: the engine held at most {peak} requests; {done} completed "
                  f"({per_worker} per worker, all rounds)")
            assert done >= 4
            assert 1 <= peak <= 3, f"the engine held {peak} requests of a 3-request budget"
            if all(v > 0 for v in per_worker.values()):
                break
        assert sorted(per_worker) == ["0", "1"] and all(v > 0 for v in per_worker.values()), per_worker


def test_the_workers_share_one_response_store(tmp_path: Path, render_sidecar: Any,
                                              fast_engine: SimulatedEngine) -> None:
    """Stored Responses on the pod's SQLite file: a chain whose turns reach either worker (a new
    connection each) continues whatever worker stored the turn before, and any worker retrieves it."""
    store = {"store": {"path": str(tmp_path / "responses.sqlite3")}}
    with pod(tmp_path, str(render_sidecar.url), fast_engine.url, responses=store) as p:
        body = {"model": SERVED, "max_output_tokens": 4, "temperature": 0}
        ids: list[str] = []
        for chain in range(6):
            previous = None
            for turn in range(4):
                extra = {"previous_response_id": previous} if previous else {}
                r = httpx.post(f"{p.url}/v1/responses", json={**body, **extra, "input": f"Chain {chain}, turn {turn}."},
                               timeout=60)
                assert r.status_code == 200, r.text
                previous = r.json()["id"]
                ids.append(previous)
        for rid in ids:
            assert httpx.get(f"{p.url}/v1/responses/{rid}", timeout=10).status_code == 200
        per_worker = {dict(k)["worker"]: v for k, v in p.metrics()["coordinator_worker_requests"].items()}
        assert all(v > 0 for v in per_worker.values()) and len(per_worker) == 2, per_worker
