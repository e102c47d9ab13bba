"""The benchmarks' ``--quick`` modes run end to end and keep their output contract (report files, one
JSON last line), and the overload benchmark's definitions (goodput window, SLO, leaks) hold.

No vLLM here (unit layer): the smoke runs talk to a minimal stand-in for the render sidecar that
covers only what they need (token-id completions, plain chat, /tokenize, vLLM's per-route request
counter); their numbers are meaningless, their plumbing is not. ``python -m perf.<name> --quick``
against the real sidecar is each benchmark's own smoke run. ``perf.ab_native`` needs two real vLLM
engines (minutes to start on 2 cores), so only its figures are checked here.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

import perf._report
from perf import (
    ab_native,
    capacity,
    derender_cost,
    docs,
    fairness,
    fleet_admission,
    kv_affinity,
    lora,
    offload_tiers,
    overload,
    scheduler_latency,
    topologies,
)

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
    scale, intake = figures["scale"], figures["intake"]
    assert 0 < scale["index_blocks"]["max"] <= scale["capacity_blocks"] and scale["hit_share"] > 0
    assert intake["idle"]["blocks_applied_per_s"] == 0 < intake["busy"]["blocks_applied_per_s"]  # real ZMQ
    assert (out_root / "scheduler_latency" / "scheduler_latency.png").stat().st_size > 0
    assert (out_root / "scheduler_latency" / "report.md").read_text().startswith("# Scheduler")


# ------------------------------------------------------------------------------------ overload
def stub_render_app() -> FastAPI:
    """Render: token-id prompt passed through (chat: fixed ids); derender: one "x" per token; /metrics:
    vLLM's ``http_requests_total`` per handler."""
    app = FastAPI()
    calls: Counter[str] = Counter()

    @app.middleware("http")
    async def count(request: Any, call_next: Any) -> Any:
        calls[request.url.path] += 1
        return await call_next(request)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("".join(f'http_requests_total{{handler="{path}",method="POST",status="2xx"}} '
                                         f"{n}.0\n" for path, n in calls.items()))

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any]) -> dict[str, Any]:
        return {"tokens": [100 + len(w) for w in body["prompt"].split()]}

    @app.post("/v1/chat/completions/render")
    async def chat_render(body: dict[str, Any]) -> dict[str, Any]:
        ids = [1, 520] + [100 + len(m["content"]) for m in body["messages"]] + [1, 520, 198]
        return {"request_id": "chatcmpl-stub", "token_ids": ids, "model": SERVED, "output_mode": "tokens",
                "stream": body.get("stream", False),
                "sampling_params": {"max_tokens": body.get("max_tokens", 16), "ignore_eos": True}}

    @app.post("/v1/chat/completions/derender")
    async def chat_derender(body: dict[str, Any]) -> dict[str, Any]:
        first = body.get("stream_state") is None
        choices = [{"index": c.get("index", 0),
                    "delta": {**({"role": "assistant"} if first else {}),
                              "content": "x" * len(c.get("token_ids") or [])},
                    "logprobs": None, "finish_reason": c.get("finish_reason")}
                   for c in body["generate_chunk"]["choices"]]
        return {"chunk": {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0,
                          "model": SERVED, "choices": choices, "usage": None},
                "stream_state": {"role_sent": True}}

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


def test_offload_tiers_quick(out_root: Path, stub_render: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Simulated engines with CPU tiers publishing over ZMQ, a coordinator per policy: the engines load
    conversations back from their tiers, and the report and plot are written."""
    offload_tiers.main(["--quick", "--render-url", stub_render])
    result = last_json(capsys.readouterr().out)
    assert result["benchmark"] == "offload_tiers" and result["errors"] == 0
    assert result["precise_tiers_offload_hit_rate"] > 0 and "computed_tokens_tierless_vs_tiers" in result
    assert (out_root / "offload_tiers" / "report.md").read_text().startswith("# Offload tiers")
    assert (out_root / "offload_tiers" / "offload_tiers.png").stat().st_size > 0


def test_fleet_admission_quick(out_root: Path, stub_render: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Coordinator processes, a real redis-server and simulated engines end to end: the Redis fleet
    keeps every engine within its budget + one request (sampled at the engines) even in a short run."""
    fleet_admission.main(["--quick", "--render-url", stub_render])
    result = last_json(capsys.readouterr().out)
    assert result["benchmark"] == "fleet_admission" and result["quick"] is True
    assert result["capacity_rps"] > 0 and result["redis_errors"] == 0
    assert result["redis_within_budget"], result
    figures = json.loads((out_root / "fleet_admission" / "result.json").read_text())
    assert figures["phases"]["redis"]["samples"] > 10 and figures["phases"]["redis"]["ok"] > 0
    assert (out_root / "fleet_admission" / "fleet_admission.png").stat().st_size > 0


def test_fairness_quick(out_root: Path, stub_render: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Two tenants through a coordinator process, simulated engines and one load-generator process per
    tenant, end to end: every phase served both tenants and the report, its TTFT breakdown from the
    coordinator's request log and the plot are written (the targets are for full runs)."""
    fairness.main(["--quick", "--render-url", stub_render])
    result = last_json(capsys.readouterr().out)
    assert result["benchmark"] == "fairness" and result["quick"] is True
    assert result["capacity_rps"] > 0 and result["errors"] == 0
    figures = json.loads((out_root / "fairness" / "result.json").read_text())
    for run, tenants in (("alone", {"B"}), ("mixed", {"A", "B"}), ("baseline", {"A", "B"})):
        phase = figures["phases"][run]["tenants"]
        assert set(phase) == tenants
        for s in phase.values():
            assert s["ok"] > 0 and s["ttft_breakdown"]["requests"] > 0, (run, s)
    assert figures["phases"]["mixed"]["admission"]["tenants"].keys() >= {"A", "B"}
    assert figures["phases"]["baseline"]["admission"]["tenants"].keys() >= {"shared"}
    assert (out_root / "fairness" / "report.md").read_text().startswith("# Fairness")
    assert (out_root / "fairness" / "fairness.png").stat().st_size > 0


def test_max_min_shares() -> None:
    """A tenant asking less than its part gets all it asks; the others split the rest by weight."""
    assert fairness.max_min_shares({"A": 27.3, "B": 2.73}, {"A": 1, "B": 1}, 10) == pytest.approx({"A": 7.27, "B": 2.73})
    assert fairness.max_min_shares({"A": 20, "B": 8}, {"A": 1, "B": 1}, 10) == {"A": 5, "B": 5}
    assert fairness.max_min_shares({"A": 20, "B": 8}, {"A": 3, "B": 1}, 10) == {"A": 7.5, "B": 2.5}
    assert fairness.max_min_shares({"A": 2, "B": 3}, {"A": 1, "B": 1}, 10) == {"A": 2, "B": 3}


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


# ------------------------------------------------------------------------ capacity, derender cost
def test_capacity_quick(out_root: Path, stub_render: str, capsys: pytest.CaptureFixture[str]) -> None:
    capacity.main(["--quick", "--render-url", stub_render])
    result = last_json(capsys.readouterr().out)
    assert result["benchmark"] == "capacity"
    assert result["outputs_identical"] is True
    assert result["direct_tokens_per_s"] > 0 and result["streamed_tokens_per_s"] > 0
    figures = json.loads((out_root / "capacity" / "result.json").read_text())
    plain, coalesced = figures["cells"]                       # 1 sidecar: coalescing off, on
    assert (plain["coalesce"], coalesced["coalesce"]) == (False, True)
    assert plain["derender_calls_per_token"] == 1.0          # one call per one-token engine chunk
    assert coalesced["derender_calls_per_token"] <= 1.0
    assert plain["coordinator_cpu_s_per_1k_tokens"] > 0     # a child process: its CPU is measured
    assert plain["sidecar_cpu_s_per_1k_tokens"] is None      # a given sidecar: not ours to measure
    assert (out_root / "capacity" / "capacity.png").stat().st_size > 0
    assert (out_root / "capacity" / "last_line.json").exists()


def test_lora_quick(out_root: Path, stub_render: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Both policies serve every adapter request; round robin loads adapters in the measured window; the
    report and plot are written."""
    lora.main(["--quick", "--render-url", stub_render])
    result = last_json(capsys.readouterr().out)
    assert result["benchmark"] == "lora" and result["failed"] == 0
    runs = {r["policy"]: r for r in json.loads((out_root / "lora" / "result.json").read_text())["runs"]}
    assert set(runs) == {"affinity", "round_robin"}
    assert all(r["requests"] == 24 and r["ok"] == 24 for r in runs.values())    # after 8 warm-up requests
    assert runs["round_robin"]["loads"] >= 1, "6 adapters on 2 engines of 2 slots: round robin loads"
    assert (out_root / "lora" / "lora.png").stat().st_size > 0


def test_topologies_quick(out_root: Path, stub_render: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Union, handoff and trigger coordinators serve the same prompts: same texts, nothing failed or
    held, and every trigger request went through one metaserver callback."""
    topologies.main(["--quick", "--render-url", stub_render])
    result = last_json(capsys.readouterr().out)
    assert result["benchmark"] == "topologies"
    assert result["failed"] == 0 and result["held_after"] == 0 and result["texts_equal_union"] is True
    figures = json.loads((out_root / "topologies" / "result.json").read_text())
    runs = {r["topology"]: r for r in figures["runs"]}
    assert set(runs) == {"union", "handoff", "trigger"}
    assert all(r["output_tokens"] == 8 * 16 for r in runs.values())     # --quick: 8 prompts x 16 tokens
    assert runs["trigger"]["trigger_callbacks"] == {'{status="200"}': 8.0}
    assert result["trigger_ttft_vs_handoff"] > 0
    assert (out_root / "topologies" / "topologies.png").stat().st_size > 0


def test_derender_cost_quick(out_root: Path, stub_render: str, capsys: pytest.CaptureFixture[str]) -> None:
    derender_cost.main(["--quick", "--render-url", stub_render])
    result = last_json(capsys.readouterr().out)
    assert result["benchmark"] == "derender_cost"
    assert result["cost_ratio_200_vs_10"] > 0
    assert "hermes_parser_cost_ratio_200_vs_10" not in result    # no parser sidecar given: skipped
    report = (out_root / "derender_cost" / "report.md").read_text()
    assert report.startswith("# Streaming derender cost") and "| plain |" in report


# ---------------------------------------------------------------------------------- kv_affinity
def test_kv_affinity_ceiling_counts_every_distinct_block_once() -> None:
    a = list(range(100, 100 + 3 * kv_affinity.BLOCK_SIZE))          # 3 blocks
    b = a + list(range(500, 500 + 2 * kv_affinity.BLOCK_SIZE)) + [7]  # the same 3, 2 new, a partial tail
    schedule = [kv_affinity.Turn(0, 0, 0.0, a), kv_affinity.Turn(0, 1, 1.0, b)]
    ceil = kv_affinity.ceiling(schedule)
    assert (ceil["blocks_sent"], ceil["distinct_blocks"]) == (8, 5)
    assert ceil["hit_rate_blocks"] == round(1 - 5 / 8, 4)
    assert ceil["hit_rate_tokens"] == round(3 * kv_affinity.BLOCK_SIZE / (len(a) + len(b)), 4)


# ------------------------------------------------------------------------------------ ab_native
def test_ab_native_ratios_are_coordinator_over_native_medians() -> None:
    def run(ttft: float, itl: float, tput: float) -> dict[str, Any]:
        return {"median_ttft_ms": ttft, "median_itl_ms": itl, "output_throughput": tput, "failed": 0,
                "cpu_s_per_token": {"coordinator": 0.001, "sidecar": 0.002}}

    runs = {"chat|1|coordinator": [run(11, 10.4, 95), run(13, 10.6, 97)],
            "chat|1|native": [run(10, 10, 100), run(10, 10, 100)]}
    args = argparse.Namespace(prompts=2, input_len=8, output_len=4, reps=2, quick=True)
    f = ab_native.figures(runs, ["chat"], [1], args)
    cell = f["cells"]["chat|1"]
    assert (cell["ttft_p50_ratio"], cell["itl_p50_ratio"], cell["throughput_ratio"]) == (1.2, 1.05, 0.96)
    assert cell["met"] == {"ttft_p50_ratio": False, "itl_p50_ratio": True, "throughput_ratio": True}
    assert f["targets_met"] is False
    assert "1.2 (missed)" in ab_native._markdown(f)


# ----------------------------------------------------------------------------------------- docs
def test_docs_replaces_marked_blocks_appends_new_ones_and_skips_quick_runs(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nintro\n\n<!-- report:capacity -->\nold\n<!-- /report:capacity -->\n\n"
                   "Reading: kept.\n\n<!-- report:overload -->\nold overload\n<!-- /report:overload -->\n")
    out = tmp_path / "out"
    for name, quick in (("capacity", False), ("overload", True), ("derender_cost", False)):
        (out / name).mkdir(parents=True)
        (out / name / "report.md").write_text(f"# Title\n\nnew {name}\n\n## Part\n\n![plot]({name}.png)\n")
        (out / name / "result.json").write_text(json.dumps({"quick": quick}))
        (out / name / f"{name}.png").write_bytes(b"png")
    (out / "capacity" / "last_line.json").write_text('{"benchmark":"capacity"}\n')
    docs.main(["--doc", str(doc), "--out", str(out)])
    text = doc.read_text()
    assert "new capacity" in text and "old\n" not in text and "Reading: kept." in text
    assert "### Part" in text and "![capacity](img/capacity.png)" in text
    assert 'Last line: `{"benchmark":"capacity"}`' in text
    assert "old overload" in text and "new overload" not in text          # a quick run changes nothing
    assert text.rstrip().endswith("<!-- /report:derender_cost -->")        # a new section at the end
    assert (tmp_path / "img" / "capacity.png").exists() and not (tmp_path / "img" / "overload.png").exists()
