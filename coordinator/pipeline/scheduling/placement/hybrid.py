"""The hybrid fallback (docs/scheduling.md): when no P/D pair can take a request because a role has
no engine that is healthy, not refused by its breaker and not already failed by this request, a
union engine runs it, else a prefill engine alone, else (prefill missing) the decode engine
prefills locally."""

from __future__ import annotations

from coordinator.config import EngineRole
from coordinator.pipeline.scheduling.placement.base import Placer
from coordinator.pipeline.scheduling.request import Placement
from coordinator.pipeline.scheduling.types import ScoringInput

# The fallback's order, each with its coordinator_pd_decisions path.
FALLBACKS: tuple[tuple[EngineRole, str], ...] = (
    ("union", "fallback_union"), ("prefill", "fallback_prefill"), ("decode", "decode_only"))


def place(placer: Placer, data: ScoringInput) -> tuple[bool, Placement | None]:
    """(whether the fallback applies, its placement or None to wait for capacity); when it does not
    apply (a pair is routable, or nothing is) the P/D rule decides."""
    req = data.req
    routable: dict[EngineRole, bool] = {role: placer.routable(req, role) for role in ("decode", "prefill")}
    if all(routable.values()):
        return False, None
    routable["union"] = placer.routable(req, "union")
    for role, path in FALLBACKS:
        if routable[role]:
            engine = placer.choose(data, role, req.cost_tokens)
            if engine is None:
                return True, None  # routable but full right now: wait for it
            return True, placer.commit(data, Placement(engine, None, data.matched_tokens(engine)), path)
    return False, None
