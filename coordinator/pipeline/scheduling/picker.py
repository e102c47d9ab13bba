"""Choosing an engine for one prompt.

Deliberately small here: least in-flight tokens, ties broken round-robin. Scorers (KV affinity,
load) and filters plug in front of this picker.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from coordinator.pipeline.context import PromptPlan
from coordinator.pipeline.engines.registry import Engine, EngineRegistry
from coordinator.pipeline.errors import NoHealthyEngine


class LeastLoadPicker:
    def __init__(self, registry: EngineRegistry) -> None:
        self._registry = registry
        self._rr = itertools.count()

    def pick(self, model: str, plan: PromptPlan) -> Engine:
        pool: Sequence[Engine] = self._registry.candidates(model)
        if not pool:
            raise NoHealthyEngine(f"No healthy engine can serve model {model!r} right now")
        turn = next(self._rr)
        ordered = [pool[(turn + i) % len(pool)] for i in range(len(pool))]
        return min(ordered, key=lambda e: (e.inflight_tokens / e.weight, e.inflight_requests))
