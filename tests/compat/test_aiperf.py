"""NVIDIA aiperf streaming chat load with real mid-stream client cancellations.

aiperf closes a share of its streams a fixed delay after sending them (``--request-cancellation-*``),
the way impatient users and gateways do. The coordinator must answer every request without a server
error, and every cancelled stream must be torn down end to end: afterwards the engine reports no
running request (``vllm:num_requests_running``) and the coordinator nothing in flight (``/ready``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.compat.conftest import compat_bin, run_tool, settles_to_zero, tail
from tests.conftest import SERVED, VllmStack
from tests.support import CoordinatorServer

pytestmark = [pytest.mark.e2e, pytest.mark.compat]

REQUESTS = 16
OUTPUT_LEN = 64  # long enough that a 0.5 s cancellation lands mid-stream on a CPU engine


def test_aiperf_stream_with_cancellations_leaves_nothing_running(compat_coord: CoordinatorServer,
                                                                  vllm_stack: VllmStack, model_dir: Path,
                                                                  tmp_path: Path) -> None:
    # aiperf resolves a local tokenizer directory only outside HF offline mode, and only by absolute path.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    out = tmp_path / "aiperf"
    proc = run_tool([compat_bin("aiperf"), "profile", "--model", SERVED, "--url", compat_coord.url,
                     "--endpoint-type", "chat", "--streaming", "--tokenizer", model_dir.resolve(),
                     "--prompt-input-tokens-mean", "32", "--prompt-input-tokens-stddev", "0",
                     "--prompt-output-tokens-mean", str(OUTPUT_LEN), "--prompt-output-tokens-stddev", "0",
                     "--extra-inputs", "ignore_eos:true", "--concurrency", "4", "--request-count", str(REQUESTS),
                     "--random-seed", "1", "--request-cancellation-rate", "50",
                     "--request-cancellation-delay", "0.5", "--ui-type", "none", "--workers-max", "2",
                     "--record-processor-service-count", "1", "--no-server-metrics", "--no-gpu-telemetry",
                     "--no-auto-plot", "--output-artifact-dir", out], timeout=600, env=env)
    assert proc.returncode == 0, tail(proc)
    report = json.loads((out / "profile_export_aiperf.json").read_text())

    errors = report.get("error_summary") or []
    server_errors = [e for e in errors if e["error_details"].get("code", 0) >= 500]
    assert server_errors == [], errors
    # Every failure must be one of aiperf's own cancellations, not something the server sent back.
    assert {e["error_details"]["type"] for e in errors} <= {"RequestCancellationError"}, errors
    cancelled = sum(e["count"] for e in errors)
    finished = int(report["request_count"]["avg"])
    assert cancelled > 0, "no stream was cancelled: the test would prove nothing about teardown"
    assert finished > 0 and finished + cancelled == REQUESTS, report["request_count"]
    # The streams that ran to the end were billed exactly what ignore_eos produced.
    assert report["usage_completion_tokens"]["min"] == report["usage_completion_tokens"]["max"] == OUTPUT_LEN

    running, inflight = settles_to_zero(vllm_stack.engine.url, compat_coord.url)
    assert (running, inflight) == (0, 0), "a cancelled stream kept running on the engine or in the coordinator"
