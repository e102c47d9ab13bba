"""SIGTERM to a real coordinator process with a real stream open (docs/shutdown.md).

``python -m coordinator --config`` runs as its own process in front of the session's render sidecar
and token-only CPU engine, as in a pod; the test sends the signal a pod gets and watches what a
client and a load balancer would see: ``/ready`` turns 503 at once while the stream goes on, new
connections are refused once ``drain_delay_s`` has passed, the stream ends whole (every token, its
finish reason, ``[DONE]``) and the process exits 0. With a drain timeout shorter than the stream,
the stream ends with a retryable error event and ``[DONE]``, the engine's request is aborted and
the process still exits 0.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import SERVED, VllmStack
from tests.support import CoordinatorProcess, StreamReader, refused, wait_until

pytestmark = pytest.mark.e2e


def config(stack: VllmStack, **server: float) -> dict[str, Any]:
    return {"render": {"url": stack.render_url}, "engines": [{"url": stack.engine.url}],
            "models": [{"name": SERVED, "aliases": ["gpt-4o-mini"]}], "server": server}


def long_stream(max_tokens: int) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]}


def engine_metric(url: str, name: str, **labels: str) -> float:
    """Sum of an engine metric's samples (``_total`` for counters) whose labels include ``labels``."""
    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        if fam.name == name:
            total += sum(s.value for s in fam.samples
                         if s.name in (name, f"{name}_total") and labels.items() <= s.labels.items())
    return total


def content_chunks(events: list[Any]) -> list[dict[str, Any]]:
    return [e for e in events if isinstance(e, dict) and e.get("choices")]


def test_sigterm_lets_the_open_stream_finish_then_exits_0(vllm_stack: VllmStack, tmp_path: Path) -> None:
    # Long enough that a probe sent right after the signal lands inside the delay even on a loaded
    # two-core machine (three CPU engines stream meanwhile); the probe's client and connection are
    # made before the signal, as a kubelet's prober is, so only the request itself is timed.
    delay = 5.0
    with CoordinatorProcess(config(vllm_stack, drain_delay_s=delay, drain_timeout_s=120), tmp_path) as coord, \
            httpx.Client(base_url=coord.url, timeout=10) as probe:
        assert probe.get("/ready").status_code == 200
        # 400 tokens: several seconds even on an idle machine, so the stream outlives the probe.
        reader = StreamReader(coord.url, long_stream(400))
        reader.start()
        assert reader.first.wait(120) and reader.error is None
        sent = time.monotonic()
        os.kill(coord.process.pid, signal.SIGTERM)
        r = probe.get("/ready")
        answered = time.monotonic()
        assert r.status_code == 503 and r.json()["draining"] is True and r.json()["ready"] is False
        assert reader.error is None, reader.error
        ended = reader.ended_at
        assert ended is None or ended > answered, (
            f"the stream must still be running while /ready says draining: it ended {answered - ended:.2f}s "
            f"before the probe's answer ({answered - sent:.2f}s after the signal)")
        assert wait_until(lambda: refused(coord.url), timeout=delay + 10)
        refused_after = time.monotonic() - sent
        assert refused_after >= delay - 0.2  # requests were still accepted during the delay
        reader.join(120)
        assert reader.error is None and reader.ended_at is not None
        events = reader.events
        assert events[-1] == "[DONE]"
        assert not any("error" in e for e in events if isinstance(e, dict))
        finish = [c["finish_reason"] for e in content_chunks(events) for c in e["choices"] if c.get("finish_reason")]
        assert finish == ["length"]
        assert events[-2]["usage"]["completion_tokens"] == 400
        rc = coord.process.wait(60)
        exited_after = time.monotonic() - sent
        assert rc == 0, coord.process.tail()
        print(f"\nSIGTERM → refused after {refused_after:.2f}s, stream ended after "
              f"{reader.ended_at - sent:.2f}s, exit 0 after {exited_after:.2f}s")


def test_drain_timeout_ends_the_stream_with_a_retryable_error_and_aborts_the_engine_request(
        vllm_stack: VllmStack, tmp_path: Path) -> None:
    engine = vllm_stack.engine.url
    finished = engine_metric(engine, "vllm:request_success")  # vLLM counts no client abort here
    with CoordinatorProcess(config(vllm_stack, drain_delay_s=0.5, drain_timeout_s=1.0), tmp_path) as coord:
        reader = StreamReader(coord.url, long_stream(1800))  # a minute or more on CPU
        reader.start()
        assert reader.first.wait(120) and reader.error is None
        assert wait_until(lambda: engine_metric(engine, "vllm:num_requests_running") == 1, timeout=10)
        sent = time.monotonic()
        os.kill(coord.process.pid, signal.SIGTERM)
        reader.join(60)
        assert reader.error is None and reader.ended_at is not None
        ended_after = reader.ended_at - sent
        events = reader.events
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
        assert 0 < len(content_chunks(events)) < 1800
        assert 1.4 <= ended_after < 10  # delay (0.5) + timeout (1.0), then cut at once
        rc = coord.process.wait(60)
        assert rc == 0, coord.process.tail()
        exited_after = time.monotonic() - sent
    # Aborted, not finished: the engine stopped running it long before 1800 tokens.
    assert wait_until(lambda: engine_metric(engine, "vllm:num_requests_running") == 0, timeout=10)
    assert engine_metric(engine, "vllm:request_success") == finished
    print(f"\nSIGTERM → stream ended with the error after {ended_after:.2f}s, exit 0 after {exited_after:.2f}s")
