"""vLLM's own benchmark client (``vllm bench serve``) against the coordinator: chat, completions and
Responses (its ``openai-responses`` backend reads the typed event stream and ``response.completed``'s
usage).

It is the strictest SSE consumer around (exact ``data: `` prefix, ``\\n\\n`` separators) and takes
token counts from the server's usage chunk, so a framing slip fails requests and a wrong usage number
shows up in its totals. The random dataset forces ``ignore_eos``: every request must produce exactly
the requested output length.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.compat.conftest import DRIVERS, PYTHON, offline_env, run_tool, tail
from tests.conftest import SERVED
from tests.support import CoordinatorServer

pytestmark = [pytest.mark.e2e, pytest.mark.compat]

NUM_PROMPTS = 10
OUTPUT_LEN = 16


@pytest.mark.parametrize(("backend", "endpoint"), [("openai-chat", "/v1/chat/completions"),
                                                   ("openai", "/v1/completions"),
                                                   ("openai-responses", "/v1/responses")])
def test_vllm_bench_serve(compat_coord: CoordinatorServer, model_dir: Path, tmp_path: Path,
                          backend: str, endpoint: str) -> None:
    proc = run_tool([PYTHON, DRIVERS / "vllm_bench.py", "--backend", backend,
                     "--base-url", compat_coord.url, "--endpoint", endpoint, "--model", SERVED,
                     "--tokenizer", model_dir, "--dataset-name", "random", "--random-input-len", "32",
                     "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS),
                     "--max-concurrency", "4", "--request-rate", "inf", "--seed", "0",
                     "--save-result", "--result-dir", tmp_path, "--result-filename", "bench.json",
                     "--disable-tqdm"], timeout=600, env=offline_env())
    assert proc.returncode == 0, tail(proc)
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["failed"] == 0, tail(proc)
    assert result["completed"] == NUM_PROMPTS
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN, "usage disagrees with ignore_eos output"
    assert result["total_input_tokens"] > 0
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0
    assert compat_coord.wait_idle() == 0
