"""The coordinator reads each vLLM server's line (``GET /version``) and keeps off those it cannot use
(docs/versions.md, "Mixing lines"). Simulated engines answer ``/version`` as vLLM does, with the
version they are told to claim; the render sidecar is the real one.

What an operator sees: an engine left on an old line during a rollout gets no requests and ``/ready``
says why, while the rest of the fleet answers; a fleet of only such engines, or a render sidecar of
such a line, stops the coordinator's start with a message naming the server and the line; a newer
pair nobody has tested runs, with one warning.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import SERVED, CoordinatorFactory
from tests.support import free_port
from token_engine.simulator import SimConfig, SimulatedEngine

ASK = {"model": SERVED, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


def test_an_engine_on_an_old_line_gets_no_requests_and_ready_says_why(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    with SimulatedEngine(SimConfig(vllm_version="0.31.0")) as old, SimulatedEngine(SimConfig()) as current:
        coord = coordinator_factory(render_sidecar.url, [old.url, current.url])
        ready = httpx.get(f"{coord.url}/ready", timeout=10).json()
        assert ready["ready"] is True
        assert ready["engines"] == {old.url: "unhealthy", current.url: "healthy"}
        assert "vLLM 0.31.0" in ready["refused"][old.url] and "0.32 or later" in ready["refused"][old.url]
        for _ in range(6):
            r = httpx.post(f"{coord.url}/v1/chat/completions", json=ASK, timeout=30)
            assert r.status_code == 200, r.text
        assert old.state()["requests_total"] == 0
        assert current.state()["requests_total"] == 6


def start_fails(tmp_path: Path, render_url: str, engine_urls: list[str]) -> str:
    """``python -m coordinator`` with that fleet: it must exit non-zero; its output."""
    path = tmp_path / "coordinator.yaml"
    path.write_text(yaml.safe_dump({"render": {"url": render_url}, "models": [{"name": SERVED}],
                                    "engines": [{"url": u} for u in engine_urls]}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("COORD_")}
    done = subprocess.run([sys.executable, "-m", "coordinator", "--config", str(path), "--port", str(free_port())],
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout + done.stderr


def test_a_fleet_of_old_engines_stops_the_start(render_sidecar: Any, tmp_path: Path) -> None:
    with SimulatedEngine(SimConfig(vllm_version="0.27.1")) as old:
        out = start_fails(tmp_path, render_sidecar.url, [old.url])
    assert f"engine {old.url} runs vLLM 0.27.1; the coordinator needs 0.32 or later" in out, out[-3000:]


def test_a_render_sidecar_on_an_old_line_stops_the_start(tmp_path: Path) -> None:
    # Any vLLM server answers /version; a simulated one stands in for a render server of 0.31.
    with SimulatedEngine(SimConfig(vllm_version="0.31.0")) as old_render, SimulatedEngine(SimConfig()) as e:
        out = start_fails(tmp_path, old_render.url, [e.url])
    assert f"render sidecar {old_render.url} runs vLLM 0.31.0" in out, out[-3000:]


def test_an_untested_pair_runs_with_one_warning(render_sidecar: Any, coordinator_factory: CoordinatorFactory,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="coordinator.app")
    with SimulatedEngine(SimConfig(vllm_version="0.34.0")) as newer, \
            SimulatedEngine(SimConfig(vllm_version=None)) as unversioned:
        coord = coordinator_factory(render_sidecar.url, [newer.url, unversioned.url])
        for _ in range(4):
            r = httpx.post(f"{coord.url}/v1/chat/completions", json=ASK, timeout=30)
            assert r.status_code == 200, r.text
        assert newer.state()["requests_total"] + unversioned.state()["requests_total"] == 4
        assert httpx.get(f"{coord.url}/ready", timeout=10).json()["refused"] == {}
    warned = [r.getMessage() for r in caplog.records if "no suite has proved this pair" in r.getMessage()]
    assert len(warned) == 1 and "engines on vLLM 0.34.0" in warned[0], warned
