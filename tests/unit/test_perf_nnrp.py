"""The NNRP benchmarks' quick modes run end to end and keep their output contract (report files, one JSON
last line), so ``make bench`` cannot break unnoticed. No vLLM: ``perf.nnrp_latency`` talks to the
render stand-in of ``test_perf_smoke``; ``perf.nnrp_long_context`` needs a real engine, so only its
figures are checked here. The numbers of these runs mean nothing; their plumbing does.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

import perf._report
from perf import nnrp_latency, nnrp_long_context, profile_mapper
from tests.unit.test_perf_smoke import stub_render_app


@pytest.fixture
def out_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(perf._report, "OUT_ROOT", tmp_path)   # never overwrite perf/out
    return tmp_path


@pytest.fixture
def render() -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(stub_render_app(), log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(5)


def last_json(out: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads([ln for ln in out.splitlines() if ln.strip()][-1])
    return result


def test_profile_mapper_quick(out_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile_mapper.main(["--quick"])
    result = last_json(capsys.readouterr().out)
    assert result["benchmark"] == "profile_mapper"
    assert result["map_events_per_s"] > 0 and result["nnrp_json_vs_sse_ratio"] > 0
    figures = json.loads((out_root / "profile_mapper" / "result.json").read_text())
    text = figures["scenarios"]["text"]
    # role chunk: no event; 16 content chunks: 16 deltas; usage: 1; then response.completed
    assert text["nnrp-json"]["events_per_stream"] == 16 + 1 + 1
    assert figures["scenarios"]["tool_calls"]["map"]["events_per_stream"] == 16 + 1 + 1
    assert (out_root / "profile_mapper" / "profile_mapper.png").stat().st_size > 0


def test_nnrp_latency_quick(out_root: Path, render: str, capsys: pytest.CaptureFixture[str]) -> None:
    # 10 ms per token: slow enough that derender keeps up on a loaded 2-core machine (a coalesced
    # call has no per-chunk push latency, and with every call coalesced the push figures are NaN).
    nnrp_latency.main(["--quick", "--decode-ms", "10", "--render-url", render])
    result = last_json(capsys.readouterr().out)
    assert result["benchmark"] == "nnrp_latency"
    assert result["inflight_after"] == 0
    assert 0 < result["nnrp_push_p50_ms"] <= result["nnrp_push_p95_ms"]
    assert result["sse_push_p50_ms"] > 0 and result["cancel_to_last_event_p50_ms"] > 0
    figures = json.loads((out_root / "nnrp_latency" / "result.json").read_text())
    assert figures["cancel"]["last_event_is_cancelled"] is True
    assert figures["cancel"]["to_engine_closed"]["n"] == figures["cancels"]   # every abort reached the engine
    assert figures["nnrp"]["push"]["n"] > 0 and figures["sse"]["push"]["n"] > 0
    assert (out_root / "nnrp_latency" / "nnrp_latency.png").stat().st_size > 0


def test_nnrp_long_context_figures_are_nnrp_over_sse_medians() -> None:
    f = nnrp_long_context.figures({"sse": [(1.0, 2.0), (1.2, 2.2), (1.1, 2.1)],
                                   "nnrp": [(1.1, 2.1), (1.3, 2.3), (1.2, 2.2)]},
                                  prompt_tokens=1800, max_tokens=32, max_model_len=2048)
    assert f["sse"]["ttft"]["p50_ms"] == 1100.0 and f["nnrp"]["ttft"]["p50_ms"] == 1200.0
    assert f["ttft_p50_ratio"] == round(1200 / 1100, 3)
    assert f["total_p50_ratio"] == round(2200 / 2100, 3)
    assert "| TTFT |" in nnrp_long_context._markdown(f)
