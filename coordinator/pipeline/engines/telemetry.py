"""The engines' own view of their load, scraped from vLLM's Prometheus ``/metrics``.

Why: the coordinator only knows what *it* sent; the engine knows what is queued and how full its KV cache
is (other clients, preemptions, cache evictions). Scorers and filters use these values when known.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)


@dataclass
class Telemetry:
    """The engine's own view of its load, scraped from its ``/metrics`` (None = not known yet)."""

    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    max_loras: int | None = None                  # --max-loras (vllm:lora_requests_info), when LoRA is on
    running_adapters: tuple[str, ...] = ()        # adapters in the engine's running batch
    waiting_adapters: tuple[str, ...] = ()        # adapters whose requests wait (e.g. for a LoRA slot)


# Sample name (``_total`` stripped) → Telemetry field. Older vLLM releases used the ``gpu_`` names.
_SERIES: dict[str, str] = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:gpu_prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits": "prefix_hits",
    "vllm:gpu_prefix_cache_hits": "prefix_hits",
}


def parse_metrics(text: str) -> Telemetry:
    """Read the series we use from Prometheus text exposition.

    Counts and counters are summed over label sets (one per data-parallel rank); KV usage is averaged,
    since a sum of fractions would exceed 1. Raises ``ValueError`` on malformed text.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    lora: dict[str, str] | None = None
    lora_at = float("-inf")
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:lora_requests_info" and sample.value > lora_at:
                # One gauge per label set, each set to the time it was last reported: the newest is now.
                lora, lora_at = sample.labels, sample.value
                continue
            name = sample.name.removesuffix("_total")
            fld = _SERIES.get(name)
            if fld is None:
                continue
            sums[fld] = sums.get(fld, 0.0) + float(sample.value)
            counts[fld] = counts.get(fld, 0) + 1

    def count(fld: str) -> int | None:
        return int(sums[fld]) if fld in sums else None

    def names(label: str) -> tuple[str, ...]:
        return tuple(n for n in (lora or {}).get(label, "").split(",") if n)

    max_lora = (lora or {}).get("max_lora", "")
    return Telemetry(
        max_loras=int(max_lora) if max_lora.isdigit() else None,
        running_adapters=names("running_lora_adapters"),
        waiting_adapters=names("waiting_lora_adapters"),
        waiting=count("waiting"),
        running=count("running"),
        kv_usage=sums["kv_usage"] / counts["kv_usage"] if "kv_usage" in sums else None,
        prefix_queries=sums.get("prefix_queries"),
        prefix_hits=sums.get("prefix_hits"),
    )


async def scrape(http: httpx.AsyncClient, url: str, timeout_s: float = 2.0) -> Telemetry | None:
    """``GET {url}/metrics`` parsed; None when the scrape failed (callers keep what they had)."""
    try:
        resp = await http.get(f"{url}/metrics", timeout=timeout_s)
        if resp.status_code != 200:
            log.debug("metrics scrape of %s: HTTP %d", url, resp.status_code)
            return None
        return parse_metrics(resp.text)
    except (httpx.HTTPError, ValueError) as exc:
        log.debug("metrics scrape of %s failed: %s", url, exc)
        return None
