"""schemathesis: property-based requests generated from OpenAI's spec, valid and invalid.

Operations createChatCompletion, createCompletion and listModels, phases examples + coverage
(boundary and negative values per field) + fuzzing, in positive and negative mode. Checks: no 5xx,
every 200 body matches the spec (the widened document of ``tests.compat.spec``, so only the
documented vLLM differences are tolerated) and every response has a documented content type.
``schemathesis_hooks.py`` aims each body at the served model with short generations, so that the
requests really reach the engine.

Fuzzed bodies can carry values that crash an engine, so this module runs its own tokens-only engine
behind its own coordinator; the session's engine stays out of harm's way. Afterwards that engine must
still answer a real request.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterator
from pathlib import Path
from xml.etree import ElementTree

import httpx
import pytest

from tests.compat.conftest import compat_bin, run_tool, tail
from tests.compat.spec import widened_spec_path
from tests.conftest import MAX_MODEL_LEN, SERVED, VllmStack, make_settings
from tests.support import CoordinatorServer, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.compat]

HOOKS = Path(__file__).resolve().parent / "schemathesis_hooks.py"
OPERATIONS = ("createChatCompletion", "createCompletion", "listModels")
MAX_EXAMPLES = 40


@pytest.fixture(scope="module")
def fuzz_target(vllm_stack: VllmStack, model_dir: Path, logs_dir: Path) -> Iterator[CoordinatorServer]:
    """A coordinator in front of an engine of its own (see the module docstring)."""
    from token_engine.launch import VllmEngine

    engine = VllmEngine(model_dir, port=free_port(), served_model_name=SERVED, mode="tokens-only",
                        max_model_len=MAX_MODEL_LEN, log_path=logs_dir / "fuzz-engine.log",
                        echo=bool(os.environ.get("LLMC_TEST_ECHO")), name="fuzz-engine")
    try:
        engine.start()
        engine.wait_ready(timeout=600)
        with CoordinatorServer(make_settings(vllm_stack.render_url, [engine.url])) as coord:
            yield coord
    finally:
        engine.stop()


def test_schemathesis_openai_spec(fuzz_target: CoordinatorServer, tmp_path: Path) -> None:
    coord = fuzz_target
    reports = tmp_path / "schemathesis"
    args: list[str | Path] = [compat_bin("schemathesis"), "run", widened_spec_path(), "--url", f"{coord.url}/v1"]
    for op in OPERATIONS:
        args += ["--include-operation-id", op]
    args += ["--checks", "not_a_server_error,response_schema_conformance,content_type_conformance",
             "--phases", "examples,coverage,fuzzing", "--mode", "all", "--max-examples", str(MAX_EXAMPLES),
             "--seed", "1", "--request-timeout", "60", "--workers", "1", "--continue-on-failure",
             "--report", "junit,har", "--report-dir", reports, "--warnings", "off", "--no-color"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS), "COMPAT_MODEL": SERVED}
    proc = run_tool(args, timeout=900, env=env)

    junit = ElementTree.parse(next(reports.glob("junit*.xml"))).getroot()
    failures = int(junit.get("failures", "0")) + int(junit.get("errors", "0"))
    har = json.loads(next(reports.glob("har*.json")).read_text())
    statuses = collections.Counter((e["request"]["method"], e["request"]["url"].split("/v1", 1)[1],
                                    e["response"]["status"]) for e in har["log"]["entries"])
    server_errors = {k: n for k, n in statuses.items() if k[2] >= 500}
    assert server_errors == {}, f"5xx answers: {server_errors}\n{tail(proc, 12000)}"
    assert failures == 0 and proc.returncode == 0, f"statuses: {dict(statuses)}\n{tail(proc, 12000)}"
    # The hooks did their job: generation really ran for both generating operations.
    for route in ("/chat/completions", "/completions"):
        assert statuses[("POST", route, 200)] > 0, f"no generated {route} request succeeded: {dict(statuses)}"

    r = httpx.post(f"{coord.url}/v1/chat/completions", timeout=120,
                   json={"model": SERVED, "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
