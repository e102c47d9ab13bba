"""Scorers: rate each remaining engine in [0, 1]; the scheduler sums them with configured weights."""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.pipeline.scheduling.types import EngineView, ScoringInput


class PrefixScorer:
    """Share of the prompt already cached on the engine: each cached token is prefill work saved."""

    name = "prefix"

    def __call__(self, data: ScoringInput, engines: Sequence[EngineView]) -> list[float]:
        if not data.matched_blocks:
            return [0.0] * len(engines)
        total = max(1, data.req.prompt_tokens)
        return [data.matched_tokens(e) / total for e in engines]


class LoadScorer:
    """Free share of the engine's token budget (queued + in-flight tokens against capacity)."""

    name = "load"

    def __call__(self, data: ScoringInput, engines: Sequence[EngineView]) -> list[float]:
        return [max(0.0, 1.0 - e.inflight_tokens / e.token_budget) for e in engines]


class QueueScorer:
    """Fewer requests waiting inside the engine (its own telemetry) is better."""

    name = "queue"

    def __call__(self, data: ScoringInput, engines: Sequence[EngineView]) -> list[float]:
        return [1.0 / (1.0 + (e.telemetry.waiting or 0)) for e in engines]


class KvUsageScorer:
    """More free KV cache (engine telemetry) is better."""

    name = "kv_usage"

    def __call__(self, data: ScoringInput, engines: Sequence[EngineView]) -> list[float]:
        return [1.0 - min(1.0, e.telemetry.kv_usage or 0.0) for e in engines]


SCORERS: dict[str, type[PrefixScorer | LoadScorer | QueueScorer | KvUsageScorer]] = {
    s.name: s for s in (PrefixScorer, LoadScorer, QueueScorer, KvUsageScorer)
}
