"""The scheduler: filters → scorers → picker, per engine role, plus the P/D placement rule.

HTTP-free and synchronous: one decision is a pure function of the registry, the prefix index and the
budgets, so admission can call it from its wake-up loop without awaiting anything.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from coordinator.config import EngineRole, PdProtocol, SchedulingSettings, TopologySettings
from coordinator.contracts.hashing import block_hashes, chain_seed
from coordinator.observability.metrics import Metrics
from coordinator.pipeline.engines.capabilities import NO_NEEDS, Capability
from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.engines.registry import EngineRegistry
from coordinator.pipeline.errors import NoHealthyEngine
from coordinator.pipeline.scheduling.filters import FILTERS, Capable, HasRoom, NotTried
from coordinator.pipeline.scheduling.pickers import PICKERS, BoundedLoadPicker, Observer
from coordinator.pipeline.scheduling.placement import handoff as pd
from coordinator.pipeline.scheduling.placement import hybrid, union
from coordinator.pipeline.scheduling.prefix.index import PrefixIndex
from coordinator.pipeline.scheduling.prefix.memory import PrefixMemory
from coordinator.pipeline.scheduling.prefix.remote import RemoteIndex
from coordinator.pipeline.scheduling.request import Placement, SchedRequest
from coordinator.pipeline.scheduling.scorers import SCORERS, LoraScorer
from coordinator.pipeline.scheduling.types import EngineView, Filter, Picker, Scorer, ScoringInput

log = logging.getLogger(__name__)

PRESETS: dict[str, tuple[list[tuple[str, float]], str]] = {
    "affinity": ([("prefix", 2.0), ("load", 1.0), ("lora", 3.0)], "bounded_load"),
    "least_load": ([("load", 1.0), ("lora", 3.0)], "max_score"),
    "round_robin": ([], "round_robin"),
    "random": ([], "random"),
}


_CAPABLE = Capable()


class NoOtherEngine(NoHealthyEngine):
    """Every eligible engine was already tried by this request (retries stop here)."""


@dataclass
class Profile:
    """The configured stages; one instance per coordinator."""

    policy: str
    filters: list[Filter]
    scorers: list[tuple[Scorer, float]]
    picker: Picker


def build_profile(settings: SchedulingSettings, room: Callable[[EngineView, int], bool],
                  replicate_inflight: int = 8) -> Profile:
    """``replicate_inflight``: the lora scorer's spreading point (``lora.replicate_inflight``)."""
    named: list[tuple[str, float]]
    picker_name: str
    if settings.policy == "custom":
        named = [(s.name, s.weight) for s in settings.scorers]
        picker_name = settings.picker
    else:
        named, picker_name = PRESETS[settings.policy]
    filters: list[Filter] = [NotTried(), HasRoom(room)]
    filters += [FILTERS[f.name](f) for f in settings.filters]
    scorers: list[tuple[Scorer, float]] = [
        (LoraScorer(replicate_inflight) if n == "lora" else SCORERS[n](), w) for n, w in named if w > 0]
    picker: Picker
    if picker_name == "bounded_load":
        b = settings.bounded_load
        picker = BoundedLoadPicker(b.factor, b.slack, b.window_s)
    else:
        picker = PICKERS[picker_name]()
    return Profile(settings.policy, filters, scorers, picker)


def soon(work: Callable[[], None]) -> None:
    """Run ``work`` on the event loop's next turn, after the current request has gone on its way (at
    once when no loop runs: scripts, benchmarks)."""
    try:
        asyncio.get_running_loop().call_soon(work)
    except RuntimeError:
        work()


class Scheduler:
    def __init__(self, registry: EngineRegistry, profile: Profile, *, index: PrefixIndex | None,
                 block_size: int, learn: bool, topology: TopologySettings,
                 metrics: Metrics | None = None, pending: PrefixIndex | None = None,
                 defer: Callable[[Callable[[], None]], None] | None = None,
                 remote: RemoteIndex | None = None, tiers: Mapping[str, PrefixIndex] | None = None,
                 tier_weights: Mapping[str, float] | None = None) -> None:
        """``learn``: routing decisions feed ``index`` (the approximate source). ``pending``: a short-TTL
        index that routing decisions feed while ``index`` is fed by the engines' KV events (the precise
        source): events arrive only once a prefill has stored its blocks, and a prefix being prefilled
        right now must already attract its followers. ``defer``: how what decisions teach the index
        is applied later, in one batch (e.g. ``soon``; None: at once, inside ``place``). A decision
        only reads the index; until the batch runs, later decisions read the unapplied lessons
        directly (``PrefixMemory.lookup``), so they see what they would have seen without deferral.
        ``remote``: the pod's indexer holds the index and the pending layer instead (``prefetch``
        asks it before each placement). ``tiers``: offload tiers' indexes (KV events), read beside
        ``index`` with ``tier_weights`` (which also weigh the tiers a ``remote`` indexer reports)."""
        self._registry = registry
        self.profile = profile
        self.memory = PrefixMemory(index, pending, learn=learn, defer=defer, remote=remote, tiers=tiers,
                                   tier_weights=tier_weights)
        self._block_size = block_size
        self._topology = topology
        self._metrics = metrics
        self._scores_prefix = any(scorer.name == "prefix" for scorer, _ in profile.scorers)
        self._panic: set[tuple[str, EngineRole]] = set()  # (model, role) routed in panic right now

    # -- public ---------------------------------------------------------------------------------
    def uses_handoff(self, model: str, needs: frozenset[Capability] = NO_NEEDS) -> bool:
        """P/D for ``model``: configured, or (auto) it has prefill engines and decode engines that can
        run what the request needs (else its union engines run it; a prefill leg without the
        capability is skipped: the decode engine prefills locally)."""
        mode = self._topology.mode
        if mode != "auto":
            return mode == "handoff"
        engines = [e for e in self._registry.engines if e.serves(model)]
        return (any(e.role == "prefill" for e in engines)
                and any(e.role == "decode" and e.can_all(needs) for e in engines))

    def capable(self, model: str, needs: frozenset[Capability]) -> bool:
        """Whether any engine that may run ``model``'s output (union or decode, whatever its state
        right now) can do what ``needs`` names: without one the request can never be served (a
        client error naming the field), with one it waits or gets a 503 like any other."""
        return not needs or any(e.role in ("union", "decode") and e.serves(model) and not e.removed
                                and e.can_all(needs) for e in self._registry.engines)

    async def prefetch(self, req: SchedRequest) -> None:
        """With the pod's indexer: ask it about ``req``'s prompt before admission places it (``place``
        is synchronous). Without an answer the decision routes on load and this process's own
        recent lessons, and the metric says so."""
        if self.memory.remote is None or not self._reads_index(req):
            return
        self._prepare(req)
        if not req.block_hashes:
            return
        req.prefix_view = await self.memory.view(req.block_hashes)
        if req.prefix_view is None and self._metrics is not None:
            self._metrics.indexer_unanswered.inc()

    def _reads_index(self, req: SchedRequest) -> bool:
        handoff = self.uses_handoff(req.model, req.needs) and not req.native_api  # native: union only
        return handoff or self._scores_prefix

    def place(self, req: SchedRequest) -> Placement | None:
        """Engines for ``req`` with room now; None = wait for capacity; raises NoHealthyEngine. The
        rules are in ``placement/``; this picks the one for the request's topology."""
        handoff = self.uses_handoff(req.model, req.needs) and not req.native_api  # native: union only
        if handoff or self._scores_prefix:  # the index costs ~0.1 ms; skip it when nothing reads it
            self._prepare(req)
        data = self._scoring_input(req)  # once, for every role
        if not handoff:
            return union.place(self, data)
        if req.scores_prompt:  # a decode engine handed the prompt's KV never computes its logprobs
            return pd.decode_only(self, data)
        if self._topology.hybrid_fallback:
            applies, fallback = hybrid.place(self, data)
            if applies:
                return fallback
        return pd.place(self, data)

    def _scoring_input(self, req: SchedRequest) -> ScoringInput:
        matched, continuing = self.memory.lookup(req.block_hashes, req.prefix_view)
        offloaded = self.memory.offloaded(req.block_hashes, matched, req.prefix_view)
        return ScoringInput(req, matched, self._block_size, continuing, offloaded,
                            self.memory.pod_shares(req.prefix_view))

    def place_prefill(self, req: SchedRequest) -> Engine:
        """Trigger: the prefill engine for ``req``, chosen when its decode engine calls back. Among
        those with room as usual; when every one is full, the least loaded one anyway: the decode
        engine already holds the request's KV blocks, and waiting here would only hold them longer.
        Raises ``NoHealthyEngine`` when no prefill engine can take it."""
        self._prepare(req)
        data = self._scoring_input(req)
        tokens = req.prompt_tokens + 1
        engine = self.choose(data, "prefill", tokens)
        if engine is None:
            pool = [e for e in self.eligible(req.model, "prefill")
                    if e.url not in req.exclude and e.breaker.available() and e.can_all(req.needs)]
            if not pool:
                raise NoHealthyEngine(f"No prefill engine can take a request for {req.model!r} right now")
            engine = min(pool, key=lambda e: e.inflight_tokens)
        engine.breaker.on_pick()
        self.memory.learn(engine.url, req.block_hashes)
        return engine

    def has_other_engine(self, req: SchedRequest) -> bool:
        """Whether a retry has somewhere to go (an eligible engine this request has not failed on).
        With the hybrid fallback a P/D request may also go to a union or a prefill engine."""
        handoff = self.uses_handoff(req.model, req.needs) and not req.native_api  # native: union only
        roles: tuple[EngineRole, ...] = ("union",)
        if handoff:
            roles = ("decode", "union", "prefill") if self._topology.hybrid_fallback else ("decode",)
        return any(e.url not in req.exclude and e.can_all(req.needs)
                   for role in roles for e in self.eligible(req.model, role))

    @property
    def index(self) -> PrefixIndex | None:
        return self.memory.index

    def forget(self, engine_url: str) -> None:
        self.memory.forget(engine_url)

    def flush_learning(self) -> None:
        """Apply the decisions' lessons to the index (and the pending layer), oldest first."""
        self.memory.flush()

    def export_metrics(self) -> None:
        """Size of the prefix index, its pending layer and the offload tiers' indexes, for ``/metrics``
        (called at scrape time)."""
        if self._metrics is None:
            return
        named = [("index", self.memory.index), ("pending", self.memory.pending),
                 *((f"tier_{tier.lower()}", ix) for tier, ix in self.memory.tiers.items())]
        self._metrics.prefix_indexes([(name, ix) for name, ix in named if ix is not None])

    # -- the steps placement rules share (placement/base.py, Placer) ---------------------------
    @property
    def topology(self) -> TopologySettings:
        return self._topology

    def pd_protocol(self, model: str) -> PdProtocol:
        return self._registry.pd_protocol(model)

    def routable(self, req: SchedRequest, role: EngineRole) -> bool:
        """Probe-healthy: a fleet whose decode engines all look down goes to a healthy union engine
        before panic routing to them is considered."""
        return any(e.url not in req.exclude and e.breaker.available() and e.can_all(req.needs)
                   for e in self._registry.eligible(req.model, role))

    def _prepare(self, req: SchedRequest) -> None:
        if not self.memory.active:
            return
        source = "render"
        if req.block_hashes is None:
            source = "coordinator"
            req.block_hashes = block_hashes(req.prompt_token_ids, self._block_size,
                                            chain_seed(req.hash_seed_name, req.cache_salt), media=req.media)
        if not req.hashes_counted and self._metrics is not None:
            req.hashes_counted = True
            self._metrics.prefix_hashes.labels(source).inc()

    def choose(self, data: ScoringInput, role: EngineRole, tokens: int) -> Engine | None:
        req = data.req
        eligible = self.eligible(req.model, role)
        eligible = _CAPABLE(req, eligible, tokens)  # first: the other filters never see an incapable engine
        if not eligible:
            raise NoHealthyEngine(f"No healthy {role} engine can serve model {req.model!r} right now")
        # Healthy (or, in panic, probe-unhealthy) already: the breaker decides the rest.
        pool: Sequence[Engine] = [e for e in eligible if e.breaker.available()]
        if req.exclude and not any(e.url not in req.exclude for e in eligible):
            raise NoOtherEngine(f"every {role} engine for model {req.model!r} failed this request")
        for f in self.profile.filters:
            if not pool:
                break
            pool = f(req, pool, tokens)
        if not pool:
            return None
        totals = [0.0] * len(pool)
        for scorer, weight in self.profile.scorers:
            for i, s in enumerate(scorer(data, pool)):
                totals[i] += weight * s
        return self.profile.picker(pool, totals, data)

    def eligible(self, model: str, role: EngineRole) -> list[Engine]:
        """Healthy engines; when probes call every one unhealthy, those no open breaker refuses (panic
        routing, docs/scheduling.md): better a request that may fail than a certain 503. Not for the
        prefill role: without a prefill engine the decode engine prefills locally, a sure path."""
        eligible = self._registry.eligible(model, role)
        key = (model, role)
        if eligible or role == "prefill":
            if key in self._panic:
                self._panic.discard(key)
                log.info("healthy %s engines for %s again: panic routing ends", role, model)
            return eligible
        eligible = self._registry.panic_pool(model, role)
        if eligible and key not in self._panic:
            self._panic.add(key)
            log.warning("health probes call every %s engine for %s unhealthy: routing to them anyway "
                        "(panic) while their breakers allow", role, model)
        return eligible

    def commit(self, data: ScoringInput, placement: Placement, path: str) -> Placement:
        req = data.req
        m = self._metrics
        if isinstance(self.profile.picker, Observer):
            self.profile.picker.observe(placement.engine, data)
        for e in placement.engines:
            e.breaker.on_pick()
            if m is not None and not e.healthy:
                m.panic_decisions.labels(e.role).inc()
            self.memory.learn(e.url, req.block_hashes, cold=data.cold)
        if m is not None:
            m.decisions.labels(self.profile.policy, placement.engine.url).inc()
            m.handoffs.labels(path).inc()
            m.prefix_lookup(req.prompt_tokens, placement.matched_tokens)
        return placement
