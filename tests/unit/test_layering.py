"""The coordinator runs on a small CPU image without vLLM, and its pipeline knows nothing of HTTP."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_coordinator_never_imports_vllm_or_torch() -> None:
    mods = imported_after("import coordinator.app, coordinator.__main__")
    assert not {m for m in mods if m == "vllm" or m.startswith(("vllm.", "torch"))}


def test_pipeline_is_http_framework_free() -> None:
    mods = imported_after("import coordinator.pipeline.service")
    assert not {m for m in mods if m.split(".")[0] in ("fastapi", "starlette", "uvicorn")}


def test_simulator_imports_nothing_from_the_coordinator() -> None:
    mods = imported_after("import token_engine.simulator, token_engine.simulator.app")
    assert not {m for m in mods if m == "coordinator" or m.startswith(("coordinator.", "vllm"))}
