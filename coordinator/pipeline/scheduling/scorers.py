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


class LoraScorer:
    """Residency of the request's LoRA adapter: an engine that holds it (or is loading it) runs it at
    once; one with a free adapter slot must load it first; a full one must also unload an idle one;
    a full one with nothing idle would make it wait for a slot. A holder already running
    ``replicate_inflight`` of the adapter's requests ranks as one with a free slot, so a hot adapter
    spreads to a second engine when the load scorer prefers it. Neutral (0) for base-model requests."""

    name = "lora"

    def __init__(self, replicate_inflight: int = 8) -> None:
        self._replicate = replicate_inflight

    def __call__(self, data: ScoringInput, engines: Sequence[EngineView]) -> list[float]:
        name = data.req.lora
        if name is None:
            return [0.0] * len(engines)
        out = []
        for e in engines:
            a = e.adapters
            if a.holds(name) or a.is_loading(name):
                out.append(1.0 if a.running(name) < self._replicate else 0.5)
            elif a.free_slots > 0:
                out.append(0.5)
            else:
                out.append(0.25 if a.evictable() is not None else 0.0)
        return out


SCORERS: dict[str, type[PrefixScorer | LoadScorer | QueueScorer | KvUsageScorer | LoraScorer]] = {
    s.name: s for s in (PrefixScorer, LoadScorer, QueueScorer, KvUsageScorer, LoraScorer)
}
