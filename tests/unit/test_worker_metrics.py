"""The pod's /metrics from its workers' (coordinator/runtime/pod.py): counters, histograms summed by
labels; gauges one sample per worker; a worker that did not answer shows as down, not as zeros."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.runtime.pod import merge_metrics


def exposition(requests: int, inflight: float, waits: list[float]) -> str:
    r = CollectorRegistry()
    c = Counter("coordinator_requests", "ended", ["status"], registry=r)
    c.labels("200").inc(requests)
    Gauge("coordinator_inflight_requests", "in flight", registry=r).set(inflight)
    h = Histogram("coordinator_queue_wait_seconds", "wait", buckets=(0.1, 1.0), registry=r)
    for w in waits:
        h.observe(w)
    return generate_latest(r).decode()


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text.decode()) for s in fam.samples}


def test_counters_and_histograms_are_summed_gauges_kept_per_worker() -> None:
    merged = samples(merge_metrics({0: exposition(3, 1, [0.05]), 1: exposition(4, 2, [0.5, 2.0])}))
    assert merged[("coordinator_requests_total", (("status", "200"),))] == 7
    assert merged[("coordinator_queue_wait_seconds_count", ())] == 3
    assert merged[("coordinator_queue_wait_seconds_bucket", (("le", "0.1"),))] == 1
    assert merged[("coordinator_queue_wait_seconds_bucket", (("le", "1.0"),))] == 2
    assert merged[("coordinator_inflight_requests", (("worker", "0"),))] == 1
    assert merged[("coordinator_inflight_requests", (("worker", "1"),))] == 2
    assert ("coordinator_inflight_requests", ()) not in merged
    created = [k for k in merged if k[0] == "coordinator_requests_created"]
    assert created == [("coordinator_requests_created", (("status", "200"),))]  # one, no worker label
    assert merged[("coordinator_worker_up", (("worker", "0"),))] == 1


def test_a_worker_that_did_not_answer_is_down() -> None:
    merged = samples(merge_metrics({0: exposition(3, 1, []), 1: None}))
    assert merged[("coordinator_requests_total", (("status", "200"),))] == 3
    assert merged[("coordinator_worker_up", (("worker", "1"),))] == 0
    assert ("coordinator_inflight_requests", (("worker", "1"),)) not in merged
