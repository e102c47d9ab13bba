"""The benchmarks' ``--quick`` modes run end to end and keep their output contract (report files, one
JSON last line), and the overload benchmark's definitions (goodput window, SLO, leaks) hold.

No vLLM here (unit layer): the overload smoke run talks to a minimal stand-in for the render sidecar
that covers only what a token-id completion needs; its numbers are meaningless, its plumbing is not.
``python -m perf.overload --quick`` against the real sidecar is the benchmark's own smoke run.
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
from fastapi import FastAPI

import perf._report
from perf import overload, scheduler_latency

SERVED = "smollm2-135m-instruct"


@pytest.fixture
def out_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(perf._report, "OUT_ROOT", tmp_path)   # never overwrite perf/out
    return tmp_path


def last_json(out: str) -> dict[str, Any]:
    lines = [line for line in out.splitlines() if line.strip()]
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def test_scheduler_latency_quick(out_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scheduler_latency.main(["--quick"])
    result = last_json(capsys.readouterr().out)
    assert result["benchmark"] == "scheduler_latency"
    assert 0 < result["p50_ms"] <= result["p99_ms"]
    assert result["rr_no_index_p50_ms"] < result["p50_ms"]   # hashing + matching cost something
    figures = json.loads((out_root / "scheduler_latency" / "result.json").read_text())
    assert figures["index_blocks_after_run"]["max"] <= figures["blocks_per_engine"]   # capacity holds
    assert set(figures["scaling"]) == {"512", "2048", "8192"}
    assert (out_root / "scheduler_latency" / "scheduler_latency.png").stat().st_size > 0
    assert (out_root / "scheduler_latency" / "report.md").read_text().startswith("# Scheduler")


# ------------------------------------------------------------------------------------ overload
def stub_render_app() -> FastAPI:
    """Render: token-id prompt passed through; derender: one text chunk per engine chunk."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": SERVED, "object": "model", "root": SERVED,
                                            "max_model_len": 2048}]}

    @app.post("/v1/completions/render")
    async def render(body: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"request_id": "cmpl-stub", "token_ids": body["prompt"], "model": SERVED,
                 "output_mode": "tokens", "stream": body.get("stream", False),
                 "sampling_params": {"max_tokens": body["max_tokens"], "ignore_eos": True}}]

    @app.post("/v1/completions/derender")
    async def derender(body: dict[str, Any]) -> dict[str, Any]:
        choices = [{"index": c.get("index", 0), "text": "x" * len(c.get("token_ids") or []),
                    "logprobs": None, "finish_reason": c.get("finish_reason"),
                    "stop_reason": c.get("stop_reason")}
                   for c in body["generate_chunk"]["choices"]]
        return {"chunk": {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": SERVED,
                          "choices": choices, "usage": None}, "stream_state": {}}

    return app


@pytest.fixture
def stub_render() -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(stub_render_app(), log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


def test_overload_quick(out_root: Path, stub_render: str, capsys: pytest.CaptureFixture[str]) -> None:
    overload.main(["--quick", "--render-url", stub_render])
    result = last_json(capsys.readouterr().out)
    assert result["benchmark"] == "overload"
    assert result["leaked_budget"] == 0
    figures = json.loads((out_root / "overload" / "result.json").read_text())
    assert figures["queue_length_after"] == 0
    for left in figures["leftovers"].values():
        assert set(left.values()) == {0}, left
    on = figures["admission_on"]["outcomes"]
    assert on["ok"] > 0 and on["rejected"] > 0 and on["failed"] == 0   # 3x: some served, some refused
    assert figures["admission_off"]["outcomes"]["rejected"] == 0
    assert (out_root / "overload" / "overload.png").stat().st_size > 0


def outcome(arrival: float, kind: str = "ok", ttft: float | None = 0.1, status: int = 200,
            latency: float = 0.5) -> overload.Outcome:
    return overload.Outcome(arrival, arrival, status, kind, latency, ttft)


def test_goodput_counts_in_window_arrivals_within_the_slo_only() -> None:
    outs = [
        outcome(0.5),                                   # before the window: left out
        outcome(1.5), outcome(2.5),                     # good
        outcome(3.0, ttft=0.4),                         # completed, but TTFT over the SLO
        outcome(3.5, "failed"),                         # broken stream
        outcome(3.6, "rejected", None, 429, 0.003),
        outcome(3.7, "queue_timeout", None, 503, 0.2),
        outcome(4.5),                                   # after the window: left out
    ]
    s = overload.summarize(outs, (1.0, 4.0), slo_s=0.3)
    assert s["requests"] == 6
    assert s["goodput_rps"] == round(2 / 3, 2)
    assert s["completed_rps"] == 1.0
    assert s["outcomes"] == {"ok": 3, "rejected": 1, "queue_timeout": 1, "client_timeout": 0, "failed": 1}
    assert s["reject_latency_p50_ms"] == 3.0
    assert s["admitted_ttft_p99_ms"] == 400.0


def test_timeline_censors_requests_that_never_saw_a_token() -> None:
    outs = [outcome(0.2, ttft=0.1), outcome(0.4, "client_timeout", None, 0, 8.0)]
    t = overload.timeline(outs, 1.0, slo_s=0.3, timeout_s=8.0)
    assert t["goodput_rps"] == [1]
    assert t["ttft_p99_ms"] == [8000.0]
