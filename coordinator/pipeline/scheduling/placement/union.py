"""Union: one engine prefills and decodes (every request on a fleet without P/D, and the native
route, which only union engines serve)."""

from __future__ import annotations

from coordinator.pipeline.scheduling.placement.base import Placer
from coordinator.pipeline.scheduling.request import Placement
from coordinator.pipeline.scheduling.types import ScoringInput


def place(placer: Placer, data: ScoringInput) -> Placement | None:
    engine = placer.choose(data, "union", data.req.cost_tokens)
    if engine is None:
        return None
    return placer.commit(data, Placement(engine, None, data.matched_tokens(engine)), "union")
