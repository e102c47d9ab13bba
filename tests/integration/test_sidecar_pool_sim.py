"""Coordinator + two real render sidecar processes + a simulated engine.

Each sidecar's own ``/metrics`` (``http_requests_total`` per route) shows which one served what.
The last test kills the module's second sidecar, so it stays last in this file.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from render_sidecar.launch import RenderSidecar
from tests.conftest import MAX_MODEL_LEN, SERVED, CoordinatorFactory
from tests.support import CoordinatorServer, free_port, sse_events, streamed_text
from token_engine.simulator import SimConfig, SimulatedEngine

DERENDER = "/v1/chat/completions/derender"
RENDER = "/v1/chat/completions/render"


@pytest.fixture(scope="module")
def second_sidecar(request: pytest.FixtureRequest, model_dir: Path, logs_dir: Path) -> Iterator[RenderSidecar]:
    """Another sidecar process on the same model; boots while the session sidecar boots."""
    render = RenderSidecar(model_dir, port=free_port(), served_model_name=SERVED, max_model_len=MAX_MODEL_LEN,
                           log_path=logs_dir / "render-pool.log", echo=False, name="render-pool")
    try:
        render.start()
        request.getfixturevalue("render_sidecar")
        render.wait_ready(timeout=600)
        yield render
    finally:
        render.stop()


@pytest.fixture
def sim() -> Iterator[SimulatedEngine]:
    with SimulatedEngine(SimConfig(model=SERVED, decode_s_per_token=0.002)) as eng:
        yield eng


@pytest.fixture
def pair(render_sidecar: Any, second_sidecar: RenderSidecar) -> list[str]:
    return [str(render_sidecar.url), second_sidecar.url]


def served(url: str, route: str) -> float:
    """Successful calls of ``route`` a sidecar reports having served."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = rf'^http_requests_total\{{handler="{re.escape(route)}",method="POST",status="2xx"\}} (\S+)$'
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def stream_chat(coord: CoordinatorServer, content: str) -> str:
    body = {"model": "gpt-4o-mini", "stream": True, "max_tokens": 40,
            "messages": [{"role": "user", "content": content}]}
    resp = httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    events = sse_events(resp)
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events), events
    return streamed_text(events)[0]


PROMPTS = ["Tell me a story about a lighthouse keeper.", "Explain tides to a child, in French: où est la mer ?",
           "List three primes and one emoji 😀."]


def test_render_and_derender_calls_spread_over_both_and_text_matches_one_sidecar(
        pair: list[str], sim: SimulatedEngine, coordinator_factory: CoordinatorFactory) -> None:
    single = coordinator_factory(pair[0], [sim.url])
    expected = [stream_chat(single, p) for p in PROMPTS]
    assert all(expected)

    pooled = coordinator_factory(pair[0], [sim.url], render={"urls": pair})
    before = {u: (served(u, RENDER), served(u, DERENDER)) for u in pair}
    got = [stream_chat(pooled, p) for p in PROMPTS]
    after = {u: (served(u, RENDER), served(u, DERENDER)) for u in pair}

    assert got == expected
    renders = {u: after[u][0] - before[u][0] for u in pair}
    derenders = {u: after[u][1] - before[u][1] for u in pair}
    assert sum(renders.values()) == len(PROMPTS) and all(n >= 1 for n in renders.values()), renders
    # one stream's chunks go to whichever sidecar is free, so every stream's calls are split
    assert all(n >= len(PROMPTS) for n in derenders.values()), derenders
    ready = httpx.get(f"{pooled.url}/ready", timeout=10).json()
    assert ready["render_sidecars"] == {pair[0]: True, pair[1]: True}


def test_killing_one_sidecar_loses_no_request_started_afterwards(
        pair: list[str], second_sidecar: RenderSidecar, sim: SimulatedEngine,
        coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(pair[0], [sim.url], render={"urls": pair})
    expected = stream_chat(coord, PROMPTS[0])
    results: list[tuple[float, str | BaseException]] = []
    done = threading.Event()

    def client() -> None:
        while not done.is_set():
            started = time.monotonic()
            try:
                results.append((started, stream_chat(coord, PROMPTS[0])))
            except BaseException as exc:  # recorded, asserted below
                results.append((started, exc))

    workers = [threading.Thread(target=client) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        while len(results) < 6:
            time.sleep(0.05)
        second_sidecar.stop(timeout=0)  # SIGKILL: mid-stream calls on it break
        killed_at = time.monotonic()
        while len([r for r in results if r[0] > killed_at]) < 12:
            time.sleep(0.05)
    finally:
        done.set()
        for w in workers:
            w.join(timeout=120)

    after = [outcome for started, outcome in results if started > killed_at]
    assert after and all(outcome == expected for outcome in after), after
    ready = httpx.get(f"{coord.url}/ready", timeout=10)
    assert ready.status_code == 200
    assert ready.json()["render_sidecars"] == {pair[0]: True, pair[1]: False}
