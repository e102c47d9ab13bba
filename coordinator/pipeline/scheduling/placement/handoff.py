"""P/D: a decode engine, and a prefill engine that computes the prompt's KV and hands it over
(docs/scheduling.md, Topologies). The decode engine is chosen first, on the whole request's cost:
it is where the request lives. It prefills locally (``decode_only``) when little of the prompt is
uncached there, when the request scores its prompt (a decode engine handed the KV never computes
prompt logprobs), or when no prefill engine is left. With the trigger protocol the prefill engine
is chosen later, when the decode engine calls back (``Scheduler.place_prefill``)."""

from __future__ import annotations

from coordinator.pipeline.errors import NoHealthyEngine
from coordinator.pipeline.scheduling.placement.base import Placer
from coordinator.pipeline.scheduling.request import Placement
from coordinator.pipeline.scheduling.types import ScoringInput


def place(placer: Placer, data: ScoringInput) -> Placement | None:
    req = data.req
    decode = placer.choose(data, "decode", req.cost_tokens)
    if decode is None:
        return None
    local = Placement(decode, None, data.matched_tokens(decode))
    if req.prompt_tokens - local.matched_tokens < placer.topology.pd_min_uncached_tokens:
        return placer.commit(data, local, "decode_only")
    if placer.pd_protocol(req.model) == "trigger":
        # Decode first; the prefill engine is chosen when the decode engine calls back. With no
        # prefill engine at all the decode engine prefills locally.
        if not placer.eligible(req.model, "prefill"):
            return placer.commit(data, local, "decode_only")
        local.trigger = True
        return placer.commit(data, local, "trigger")
    try:
        prefill = placer.choose(data, "prefill", req.prompt_tokens + 1)
    except NoHealthyEngine:
        # No prefill engine left at all: the decode engine prefills locally rather than failing.
        return placer.commit(data, local, "decode_only")
    if prefill is None:
        return None
    return placer.commit(data, Placement(decode, prefill, local.matched_tokens), "handoff")


def decode_only(placer: Placer, data: ScoringInput) -> Placement | None:
    """The decode engine alone (it prefills locally)."""
    decode = placer.choose(data, "decode", data.req.cost_tokens)
    if decode is None:
        return None
    return placer.commit(data, Placement(decode, None, data.matched_tokens(decode)), "decode_only")
