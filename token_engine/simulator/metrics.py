"""`GET /metrics` in Prometheus text with vLLM's metric names and labels (`engine`, `model_name`).

Why: load-aware and cache-aware scheduling scrape these series from real engines; the simulator must offer
the same names so the same scraper works. Values are read from the engine at scrape time through a
per-app registry (no process-global state, so several simulators can share a process).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .engine import SimEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector(Collector):
    def __init__(self, engine: SimEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        eng = self._engine
        labels = ["model_name", "engine"]
        values = [eng.config.model, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", len(eng.running)
        )
        yield gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(eng.waiting)
        )
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", eng.kv_cache_usage()
        )
        pc = eng.prefix_cache.stats
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            pc.queries,
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", pc.hits
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", eng.stats.prompt_tokens)
        yield counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", eng.stats.generation_tokens
        )
        # Simulator-only (`sim:` prefix): blocks a finished P/D prefill still holds for its decode leg.
        pins = eng.transfers.pinned
        yield gauge(
            "sim:kv_transfer_pinned_blocks",
            "KV blocks held by finished prefills until a decode engine pulls them or their lease ends.",
            sum(p.blocks for p in pins),
        )
        yield gauge(
            "sim:kv_transfer_pinned_requests",
            "Finished prefills whose KV blocks are still pinned.",
            len(pins),
        )
        if eng.config.enable_lora:
            # vLLM sets one gauge per label set to the time of the report; the newest is the state now.
            info = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            running = ",".join(dict.fromkeys(r.lora for r in eng.running if r.lora))
            waiting = ",".join(dict.fromkeys(r.lora for r in eng.waiting if r.lora))
            info.add_metric([str(eng.config.max_loras), waiting, running], time.time())
            yield info
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*labels, "finished_reason"],
        )
        for reason, count in eng.stats.finished_by_reason.items():
            success.add_metric([*values, reason], count)
        yield success


def build_registry(engine: SimEngine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(engine))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
