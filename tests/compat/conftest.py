"""Fixtures for the third-party client suite: one coordinator in front of the session's real engine,
the tool virtual environment, and engine/coordinator idleness probes.

Heavy clients (aiperf, schemathesis, LangChain, LiteLLM) live in ``.venv-compat`` (built by
``make compat-venv`` from tests/compat/requirements.txt) because their pins clash with the project
venv; they are run as subprocesses. Light ones (the OpenAI SDK, jsonschema, vLLM's own benchmark
client) run from the project venv.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import VllmStack, make_settings
from tests.support import CoordinatorServer, wait_until

ROOT = Path(__file__).resolve().parents[2]
COMPAT_VENV = Path(os.environ.get("LLMC_COMPAT_VENV", ROOT / ".venv-compat"))
DRIVERS = Path(__file__).resolve().parent / "drivers"


def compat_bin(name: str) -> Path:
    """An executable of the tool venv; missing means the venv was not built (a failure, not a skip)."""
    path = COMPAT_VENV / "bin" / name
    assert path.exists(), f"{path} is missing: run `make compat-venv` (tests/compat/requirements.txt)"
    return path


def run_tool(args: list[str | Path], *, timeout: float, env: dict[str, str] | None = None,
             cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a client to completion; ``timeout`` only bounds a hung tool, it is not a speed assertion."""
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else os.environ.copy(), cwd=cwd or ROOT, check=False)


def tail(proc: subprocess.CompletedProcess[str], chars: int = 4000) -> str:
    return f"rc={proc.returncode}\n--- stdout ---\n{proc.stdout[-chars:]}\n--- stderr ---\n{proc.stderr[-chars:]}"


def offline_env(**extra: str) -> dict[str, str]:
    """Environment for clients that must not reach a model hub (vLLM's benchmark, LiteLLM's cost map)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **extra}


@pytest.fixture(scope="session")
def compat_coord(vllm_stack: VllmStack) -> Iterator[CoordinatorServer]:
    """One coordinator for the whole compat suite, in front of the session's tokens-only engine."""
    with CoordinatorServer(make_settings(vllm_stack.render_url, [vllm_stack.engine.url])) as server:
        yield server


def engine_running(engine_url: str) -> float:
    """The engine's own count of running requests (``vllm:num_requests_running``, summed over labels)."""
    text = httpx.get(f"{engine_url}/metrics", timeout=10).text
    values = [float(m.group(1)) for m in re.finditer(r"^vllm:num_requests_running(?:\{[^}]*\})? (\S+)$", text,
                                                      re.MULTILINE)]
    assert values, "the engine's /metrics has no vllm:num_requests_running"
    return sum(values)


def coordinator_inflight(coord_url: str) -> int:
    """In-flight client requests as the coordinator reports them on ``/ready``."""
    return int(httpx.get(f"{coord_url}/ready", timeout=10).json()["inflight"])


def settles_to_zero(engine_url: str, coord_url: str, timeout: float = 15.0) -> tuple[float, int]:
    """Wait (bounded) until both the engine and the coordinator are idle; return what is left."""
    wait_until(lambda: engine_running(engine_url) == 0 and coordinator_inflight(coord_url) == 0, timeout=timeout)
    return engine_running(engine_url), coordinator_inflight(coord_url)


PYTHON = sys.executable
