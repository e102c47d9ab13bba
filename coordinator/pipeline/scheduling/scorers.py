"""Scorers: rate each remaining engine in [0, 1]; the scheduler sums them with configured weights."""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.pipeline.scheduling.types import EngineView, ScoringInput


class PrefixScorer:
    """Share of the prompt already cached on the engine: each cached token is prefill work saved. A
    token held only in an offload tier saves less (it is loaded back), by its tier's weight."""

    name = "prefix"

    def __call__(self, data: ScoringInput, engines: Sequence[EngineView]) -> list[float]:
        if data.cold:
            return [0.0] * len(engines)
        total = max(1, data.req.prompt_tokens)
        return [(data.matched_tokens(e) + data.offloaded_tokens(e)) / total for e in engines]


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
    once (1); one with a free adapter slot must load it first (0.5); a full one must also unload an
    idle one (0.25); a full one with nothing idle would make it wait for a slot (0). Neutral (0) for
    base-model requests.

    Hot adapters spread by one rule: when every engine in the pool that holds the adapter already runs
    ``replicate_inflight`` of its requests, and another engine could load it, the ranks swap: the
    engines that could load it score as holders do (free slot 1, idle adapter to unload 0.75) and the
    holders 0.25, so the next request loads it on a second engine (weight 3 outranks any prefix match)."""

    name = "lora"

    def __init__(self, replicate_inflight: int = 8) -> None:
        self._replicate = replicate_inflight

    def __call__(self, data: ScoringInput, engines: Sequence[EngineView]) -> list[float]:
        name = data.req.lora
        if name is None:
            return [0.0] * len(engines)
        holds = [e.adapters.holds(name) or e.adapters.is_loading(name) for e in engines]
        room = [0.5 if e.adapters.free_slots > 0 else 0.25 if e.adapters.evictable() is not None else 0.0
                for e in engines]
        hot = [h and e.adapters.running(name) >= self._replicate for h, e in zip(holds, engines, strict=True)]
        spread = any(holds) and all(t for h, t in zip(holds, hot, strict=True) if h) and any(
            r > 0 for h, r in zip(holds, room, strict=True) if not h)
        if spread:
            return [0.25 if h else 2 * r for h, r in zip(holds, room, strict=True)]
        return [(0.5 if t else 1.0) if h else r for h, t, r in zip(holds, hot, room, strict=True)]


SCORERS: dict[str, type[PrefixScorer | LoadScorer | QueueScorer | KvUsageScorer | LoraScorer]] = {
    s.name: s for s in (PrefixScorer, LoadScorer, QueueScorer, KvUsageScorer, LoraScorer)
}
