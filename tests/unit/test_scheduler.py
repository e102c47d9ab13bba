"""The scheduler's decisions: filters, scorers, pickers, presets and the P/D placement rule."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from coordinator.config import EngineSettings, SchedulingSettings, Settings, TopologySettings
from coordinator.contracts.hashing import block_hashes, chain_seed
from coordinator.observability.metrics import Metrics
from coordinator.pipeline.admission.budget import TokenLedger
from coordinator.pipeline.engines.registry import EngineRegistry
from coordinator.pipeline.errors import NoHealthyEngine
from coordinator.pipeline.scheduling.prefix.index import PrefixIndex
from coordinator.pipeline.scheduling.prefix.memory import PrefixMemory
from coordinator.pipeline.scheduling.request import SchedRequest
from coordinator.pipeline.scheduling.scheduler import NoOtherEngine, Scheduler, build_profile

MODEL = "smollm2-135m-instruct"


def make(engines: list[dict[str, Any]], policy: str = "affinity", learn: bool = True, pd_min: int = 256,
         **sched: Any) -> tuple[Scheduler, EngineRegistry, PrefixIndex, Metrics]:
    settings = Settings(engines=[EngineSettings(**e) for e in engines],
                        scheduling=SchedulingSettings(policy=policy, **sched),  # type: ignore[arg-type]
                        topology=TopologySettings(pd_min_uncached_tokens=pd_min))
    metrics = Metrics()
    registry = EngineRegistry(settings, httpx.AsyncClient(), metrics)
    ledger = TokenLedger(None)
    index = PrefixIndex()
    profile = build_profile(settings.scheduling, ledger.engine_room)
    sched = Scheduler(registry, profile, index=index, block_size=16, learn=learn,
                      topology=settings.topology, metrics=metrics)
    return sched, registry, index, metrics


def req(ids: list[int], max_tokens: int = 16, **kw: Any) -> SchedRequest:
    return SchedRequest("r", MODEL, ids, max_tokens, **kw)


PROMPT = list(range(100, 420))  # 320 tokens = 20 blocks


def urls(n: int, **extra: Any) -> list[dict[str, Any]]:
    return [{"url": f"http://e{i}:8000", **extra} for i in range(n)]


def test_affinity_prefers_the_engine_holding_the_prefix() -> None:
    sched, _reg, index, metrics = make(urls(3), learn=False)
    index.add("http://e2:8000", block_hashes(PROMPT[:160], 16, chain_seed(MODEL)))
    placement = sched.place(req(PROMPT))
    assert placement is not None and placement.engine.url == "http://e2:8000"
    assert placement.matched_tokens == 160
    assert metrics.registry.get_sample_value("coordinator_prefix_hit_tokens_total") == 160


def test_load_beats_a_small_prefix_match() -> None:
    sched, reg, index, _ = make(urls(2), learn=False)
    index.add("http://e0:8000", block_hashes(PROMPT[:32], 16, chain_seed(MODEL)))  # 10% of the prompt
    reg.engines[0].inflight_tokens = reg.engines[0].token_budget // 2               # half full
    placement = sched.place(req(PROMPT))
    assert placement is not None and placement.engine.url == "http://e1:8000"


def test_approximate_source_learns_from_its_own_decisions() -> None:
    sched, _reg, _index, _ = make(urls(4))
    first = sched.place(req(PROMPT))
    assert first is not None
    for _ in range(5):                                     # the same prefix keeps its engine
        again = sched.place(req([*PROMPT, 7, 8, 9]))
        assert again is not None and again.engine is first.engine


def test_cache_salt_and_model_separate_prefixes() -> None:
    sched, _reg, index, _ = make(urls(2), learn=False)
    index.add("http://e1:8000", block_hashes(PROMPT, 16, chain_seed(MODEL)))
    salted = sched.place(req(PROMPT, cache_salt="tenant-b"))
    assert salted is not None and salted.matched_tokens == 0


def test_round_robin_and_least_load_presets() -> None:
    sched, reg, _, _ = make(urls(3), policy="round_robin")
    picked = [sched.place(req(PROMPT)) for _ in range(6)]
    assert [p.engine.url for p in picked if p] == [f"http://e{i % 3}:8000" for i in range(6)]
    sched, reg, _, _ = make(urls(3), policy="least_load")
    reg.engines[0].inflight_tokens = 500
    reg.engines[2].inflight_tokens = 100
    placement = sched.place(req(PROMPT))
    assert placement is not None and placement.engine.url == "http://e1:8000"


def test_custom_profile_uses_engine_telemetry() -> None:
    sched, reg, _, _ = make(urls(2), policy="custom", scorers=[{"name": "queue", "weight": 1.0}])
    reg.engines[0].telemetry.waiting = 12
    reg.engines[1].telemetry.waiting = 0
    placement = sched.place(req(PROMPT))
    assert placement is not None and placement.engine.url == "http://e1:8000"


def test_a_filter_named_in_config_keeps_long_queues_out_even_against_the_prefix() -> None:
    """``scheduling.filters`` adds the queue_depth filter: the engine holding the whole prefix but
    reporting 3 waiting requests is not picked; when every engine's queue is long, the request waits."""
    sched, reg, index, _ = make(urls(2), learn=False, filters=[{"name": "queue_depth", "max_waiting": 1}])
    assert [f.name for f in sched.profile.filters] == ["not_tried", "has_room", "queue_depth"]
    index.add("http://e0:8000", block_hashes(PROMPT, 16, chain_seed(MODEL)))
    reg.engines[0].telemetry.waiting = 3
    reg.engines[1].telemetry.waiting = 1
    placement = sched.place(req(PROMPT))
    assert placement is not None and placement.engine.url == "http://e1:8000"
    reg.engines[0].telemetry.waiting = 0
    placement = sched.place(req(PROMPT))
    assert placement is not None and placement.engine.url == "http://e0:8000"  # the prefix wins again
    reg.engines[0].telemetry.waiting = reg.engines[1].telemetry.waiting = 2
    assert sched.place(req(PROMPT)) is None


def test_the_older_queue_limit_becomes_the_same_filter_in_the_one_list() -> None:
    """``admission.max_waiting_per_engine`` builds a queue_depth filter like ``scheduling.filters``
    does, and one configured there wins."""
    older = Settings(admission={"max_waiting_per_engine": 2})  # type: ignore[arg-type]
    assert [(f.name, f.max_waiting) for f in older.scheduling.filters] == [("queue_depth", 2)]
    both = Settings(admission={"max_waiting_per_engine": 2},  # type: ignore[arg-type]
                    scheduling={"filters": [{"name": "queue_depth", "max_waiting": 5}]})  # type: ignore[arg-type]
    assert [(f.name, f.max_waiting) for f in both.scheduling.filters] == [("queue_depth", 5)]
    profile = build_profile(older.scheduling, TokenLedger(None).engine_room)
    assert [f.name for f in profile.filters] == ["not_tried", "has_room", "queue_depth"]


def test_config_refuses_a_filter_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="queue_depth"):
        SchedulingSettings(filters=[{"name": "lora_affinity"}])  # type: ignore[list-item]


def test_full_engines_mean_wait_and_no_engine_means_503() -> None:
    sched, reg, _, _ = make(urls(2, max_inflight_tokens=400))
    for e in reg.engines:
        e.inflight_tokens = 300                            # 300 + 336 > 400 everywhere
    assert sched.place(req(PROMPT)) is None               # None = wait for capacity
    for e in reg.engines:
        e.probe_ok = False                                 # unhealthy by probes alone: still tried
    assert sched.place(req(PROMPT)) is None                # (panic routing, test_panic_routing.py)
    for e in reg.engines:
        for _ in range(3):
            reg.record_failure(e)                          # and real requests failed: out
    with pytest.raises(NoHealthyEngine):
        sched.place(req(PROMPT))


def test_open_breakers_and_draining_engines_are_skipped() -> None:
    sched, reg, _, _ = make(urls(3), policy="round_robin")
    for _ in range(3):
        reg.engines[0].breaker.record_failure()
    reg.drain("http://e1:8000")
    chosen = {p.engine.url for p in (sched.place(req(PROMPT)) for _ in range(4)) if p}
    assert chosen == {"http://e2:8000"}


def test_retries_never_return_to_a_failed_engine() -> None:
    sched, _reg, _, _ = make(urls(2))
    r = req(PROMPT)
    r.exclude.add("http://e0:8000")
    placement = sched.place(r)
    assert placement is not None and placement.engine.url == "http://e1:8000"
    assert sched.has_other_engine(r)
    r.exclude.add("http://e1:8000")
    assert not sched.has_other_engine(r)
    with pytest.raises(NoOtherEngine):
        sched.place(r)


PD = [{"url": "http://p0:8000", "role": "prefill"}, {"url": "http://d0:8000", "role": "decode"},
      {"url": "http://d1:8000", "role": "decode"}]


def test_handoff_places_a_prefill_and_a_decode_engine() -> None:
    sched, _reg, _index, metrics = make(PD, pd_min=64)
    placement = sched.place(req(PROMPT))
    assert placement is not None and placement.prefill is not None
    assert placement.prefill.role == "prefill" and placement.engine.role == "decode"
    assert metrics.registry.get_sample_value("coordinator_pd_decisions_total", {"path": "handoff"}) == 1


def test_a_request_scoring_its_prompt_is_never_split_into_pd_legs() -> None:
    """Prompt logprobs come from the engine that computes the prompt: a decode engine handed the
    prompt's KV by a prefill engine never does, so the decode engine prefills it itself."""
    sched, _reg, _index, metrics = make(PD, pd_min=64)
    placement = sched.place(req(PROMPT, scores_prompt=True))
    assert placement is not None and placement.prefill is None and placement.engine.role == "decode"
    assert metrics.registry.get_sample_value("coordinator_pd_decisions_total", {"path": "decode_only"}) == 1


def test_conditional_pd_skips_prefill_when_the_decode_engine_has_the_prompt() -> None:
    sched, _reg, index, metrics = make(PD, learn=False, pd_min=64)
    index.add("http://d1:8000", block_hashes(PROMPT, 16, chain_seed(MODEL)))
    placement = sched.place(req([*PROMPT, 1, 2, 3]))
    assert placement is not None and placement.prefill is None and placement.engine.url == "http://d1:8000"
    assert metrics.registry.get_sample_value("coordinator_pd_decisions_total", {"path": "decode_only"}) == 1


def test_decode_engine_prefills_itself_when_no_prefill_engine_is_healthy() -> None:
    sched, reg, _, _ = make(PD, pd_min=0)
    reg.engines[0].probe_ok = False
    placement = sched.place(req(PROMPT))
    assert placement is not None and placement.prefill is None and placement.engine.role == "decode"


HYBRID = [*PD, {"url": "http://u0:8000", "role": "union"}]


def _open(engine: Any) -> None:
    for _ in range(5):
        engine.breaker.record_failure()


def path_count(metrics: Metrics, path: str) -> float | None:
    return metrics.registry.get_sample_value("coordinator_pd_decisions_total", {"path": path})


@pytest.mark.parametrize("broken", ["decode", "prefill", "both"])
def test_hybrid_fallback_runs_a_request_without_a_pd_pair_on_a_union_engine(broken: str) -> None:
    sched, reg, _, metrics = make(HYBRID, pd_min=0)
    for e in reg.engines:
        if e.role == broken or (broken == "both" and e.role in ("prefill", "decode")):
            _open(e)
    placement = sched.place(req(PROMPT))
    assert placement is not None and placement.prefill is None and placement.engine.url == "http://u0:8000"
    assert path_count(metrics, "fallback_union") == 1


def test_a_routable_pair_is_used_even_with_union_engines_in_the_pool() -> None:
    sched, _reg, _, metrics = make(HYBRID, pd_min=0)
    placement = sched.place(req(PROMPT))
    assert placement is not None and placement.prefill is not None and path_count(metrics, "handoff") == 1


def test_without_union_engines_a_prefill_engine_runs_it_alone_else_decode_prefills_locally() -> None:
    sched, reg, _, metrics = make(PD, pd_min=0)
    for e in reg.engines:
        if e.role == "decode":
            _open(e)
    placement = sched.place(req(PROMPT))
    assert placement is not None and placement.prefill is None and placement.engine.role == "prefill"
    assert path_count(metrics, "fallback_prefill") == 1
    sched, reg, _, metrics = make(PD, pd_min=0)
    _open(reg.engines[0])                       # the prefill engine's breaker is open (probes say healthy)
    placement = sched.place(req(PROMPT))
    assert placement is not None and placement.prefill is None and placement.engine.role == "decode"
    assert path_count(metrics, "decode_only") == 1


def test_an_engine_the_request_failed_on_counts_as_unroutable_for_its_retry() -> None:
    sched, _reg, _, _m = make(HYBRID[:2] + HYBRID[3:], pd_min=0)   # p0, d0, u0
    r = req(PROMPT)
    r.exclude.add("http://d0:8000")             # the only decode engine failed this request
    assert sched.has_other_engine(r)
    placement = sched.place(r)
    assert placement is not None and placement.engine.url == "http://u0:8000"


def test_hybrid_fallback_off_keeps_the_request_waiting_for_its_pair() -> None:
    sched, reg, _, _ = make(HYBRID, pd_min=0)
    sched._topology = TopologySettings(pd_min_uncached_tokens=0, hybrid_fallback=False)
    for e in reg.engines:
        if e.role == "decode":
            _open(e)
    assert sched.place(req(PROMPT)) is None      # waits for a decode breaker's half-open trial


def test_bounded_load_spreads_pinned_prefixes() -> None:
    """Affinity alone would send every request of one shared prefix to its first engine forever; the
    bounded-load picker caps any engine at max(1.25 x fair share, fair share + slack) of recent
    decisions, while engines within their share still win on prefix."""
    now = [0.0]
    sched, _reg, _index, _ = make(urls(4), bounded_load={"factor": 1.25, "slack": 2, "window_s": 30})
    picker = sched.profile.picker
    assert picker.name == "bounded_load"
    picker._clock = lambda: now[0]  # type: ignore[attr-defined]
    counts: dict[str, int] = {}
    for i in range(40):                                   # one hot prefix, conversations diverge after it
        placement = sched.place(req(PROMPT + [i] * 32))
        assert placement is not None
        counts[placement.engine.url] = counts.get(placement.engine.url, 0) + 1
    assert max(counts.values()) <= 1.25 * 10 + 2 and len(counts) == 4
    unbounded, *_ = make(urls(4), policy="custom", picker="max_score")
    first = unbounded.place(req(PROMPT))
    assert first is not None
    assert all((p := unbounded.place(req(PROMPT + [i] * 32))) is not None and p.engine is first.engine
               for i in range(20))


def bounded_pair(window_s: float = 10) -> tuple[Scheduler, PrefixIndex, list[float]]:
    now = [0.0]
    sched, _reg, index, _ = make(urls(2), learn=False, bounded_load={"factor": 1.0, "slack": 0, "window_s": window_s})
    sched.profile.picker._clock = lambda: now[0]  # type: ignore[attr-defined]
    return sched, index, now


SHARED = PROMPT[:160]  # a "system prompt" that another conversation already continued on e0


def test_bounded_load_window_forgets_old_decisions() -> None:
    sched, index, now = bounded_pair()
    index.add("http://e0:8000", block_hashes([*SHARED, *[1] * 32], 16, chain_seed(MODEL)))
    picks = [sched.place(req([*SHARED, *[i] * 64])) for i in (2, 3)]   # two new conversations
    assert [p.engine.url for p in picks if p] == ["http://e0:8000", "http://e1:8000"]  # e0 over its share
    now[0] = 11.0                                         # both decisions left the window
    again = sched.place(req([*SHARED, *[4] * 64]))
    assert again is not None and again.engine.url == "http://e0:8000"   # the prefix wins again


def test_bounded_load_bounds_the_pods_shares_when_its_indexer_tells_them() -> None:
    """In a pod of workers each picker alone sees a quarter of the decisions; with the indexer's count
    (``pod_shares``) an engine the other workers filled is over its share here too, and new prefixes
    go to the engine that founded the fewest in the whole pod."""
    from coordinator.pipeline.scheduling.prefix.memory import PodShares
    from coordinator.pipeline.scheduling.types import ScoringInput

    sched, reg, _index, _ = make(urls(2), learn=False, bounded_load={"factor": 1.0, "slack": 1, "window_s": 10})
    picker = sched.profile.picker
    e0, e1 = reg.engines
    request = req([*SHARED, 9])
    prefers_e0 = [1.0, 0.0]
    assert picker(reg.engines, prefers_e0, ScoringInput(request, {e0.url: 10}, 16)) is e0   # alone: in share
    pod = ScoringInput(request, {e0.url: 10}, 16, pod_shares=PodShares({e0.url: 6, e1.url: 1}, {}))
    assert picker(reg.engines, prefers_e0, pod) is e1           # the pod already gave e0 more than its share
    balanced = ScoringInput(request, {e0.url: 10}, 16, pod_shares=PodShares({e0.url: 3, e1.url: 3}, {}))
    assert picker(reg.engines, prefers_e0, balanced) is e0
    cold = req(list(range(5000, 5100)))                         # nothing cached: it founds a new home
    even = [0.5, 0.5]
    founders = PodShares({e0.url: 2, e1.url: 2}, {e0.url: 0, e1.url: 2})
    assert picker(reg.engines, even, ScoringInput(cold, {}, 16, pod_shares=founders)) is e0
    founders = PodShares({e0.url: 2, e1.url: 2}, {e0.url: 2, e1.url: 0})
    assert picker(reg.engines, even, ScoringInput(cold, {}, 16, pod_shares=founders)) is e1


def test_a_continuing_conversation_keeps_its_engine_over_the_cap() -> None:
    sched, index, _ = bounded_pair()
    history = [*SHARED, *[5] * 64]
    index.add("http://e0:8000", block_hashes(history, 16, chain_seed(MODEL)))
    picks = [sched.place(req([*history, *[6 + i] * 32])) for i in range(3)]
    assert {p.engine.url for p in picks if p} == {"http://e0:8000"}   # its next turns stay home


def test_new_prefix_homes_are_spread_not_piled_on_the_momentarily_idlest_engine() -> None:
    """Each cold request (nothing cached anywhere) founds a home its followers stick to; the bounded
    picker spreads homes by how many each engine founded recently, not by the in-flight count of the
    moment (which would put all four on the one engine that happens to be idle)."""
    sched, reg, _index, _ = make(urls(4))
    for e in reg.engines[1:]:
        e.inflight_tokens = e.token_budget // 4
    homes = []
    for tenant in range(8):
        placement = sched.place(req([1000 + tenant] * 320))
        assert placement is not None
        homes.append(placement.engine.url)
    assert sorted(homes.count(e.url) for e in reg.engines) == [2, 2, 2, 2]
    least, least_reg, *_ = make(urls(4), policy="least_load")
    for e in least_reg.engines[1:]:
        e.inflight_tokens = e.token_budget // 4
    assert {p.engine.url for t in range(8) if (p := least.place(req([1000 + t] * 320)))} == {"http://e0:8000"}


def test_precise_source_counts_prefills_in_flight_until_events_confirm_them() -> None:
    """With the precise source the index only learns from KV events, which arrive after the prefill;
    the short-lived pending layer makes a prefix being prefilled attract its followers meanwhile."""
    now = [0.0]
    settings = Settings(engines=[EngineSettings(**e) for e in urls(3)],
                        scheduling=SchedulingSettings(policy="custom", picker="max_score"))
    registry = EngineRegistry(settings, httpx.AsyncClient())
    events_index, pending = PrefixIndex(), PrefixIndex(ttl_s=10, clock=lambda: now[0])
    profile = build_profile(settings.scheduling, TokenLedger(None).engine_room)
    sched = Scheduler(registry, profile, index=events_index, block_size=16, learn=False,
                      topology=settings.topology, pending=pending)
    first = sched.place(req(PROMPT))
    assert first is not None and events_index.blocks(first.engine.url) == 0   # nothing confirmed yet
    follower = sched.place(req([*PROMPT, 1, 2, 3]))
    assert follower is not None and follower.engine is first.engine and follower.matched_tokens == 320
    now[0] = 11.0                                                           # never confirmed: forgotten
    later = sched.place(req([*PROMPT, 4, 5, 6]))
    assert later is not None and later.matched_tokens == 0


def test_a_lesson_reads_on_past_what_the_events_confirm_and_stops_where_the_engine_evicts() -> None:
    """The pending layer holds a lesson only past what the engine's KV events confirm (a turn of a
    long conversation is its new blocks, not the whole chain again): a follower still matches the
    whole chain on that engine, and no further than the engine's own run once it evicts a block."""
    now = [0.0]
    settings = Settings(engines=[EngineSettings(**e) for e in urls(3)],
                        scheduling=SchedulingSettings(policy="custom", picker="max_score"))
    registry = EngineRegistry(settings, httpx.AsyncClient())
    events_index, pending = PrefixIndex(), PrefixIndex(ttl_s=10, clock=lambda: now[0])
    sched = Scheduler(registry, build_profile(settings.scheduling, TokenLedger(None).engine_room),
                      index=events_index, block_size=16, learn=False, topology=settings.topology,
                      pending=pending)
    first = sched.place(req(PROMPT))
    assert first is not None
    url = first.engine.url
    chain = block_hashes(PROMPT, 16, chain_seed(MODEL))
    events_index.add(url, chain)                     # the engine's events confirm the first turn
    now[0] = 11.0                                    # and its lesson has expired
    turn = [*PROMPT, *range(1000, 1064)]             # + 4 blocks
    second = sched.place(req(turn))
    assert second is not None and second.engine.url == url and second.matched_tokens == 320
    assert pending.blocks(url) == 4                  # only what the events have not confirmed
    follower = sched.place(req([*turn, 7, 8, 9]))
    assert follower is not None and follower.engine.url == url and follower.matched_tokens == 384
    events_index.remove(url, [chain[-1]])            # the engine evicts the first turn's last block
    after = sched.place(req([*turn, 10, 11, 12]))
    assert after is not None and after.matched_tokens == 304


def tiered(tiers: dict[str, float]) -> tuple[Scheduler, EngineRegistry, PrefixIndex, dict[str, PrefixIndex]]:
    """The precise source with offload tiers (as ``app.py`` builds it), the default scoring."""
    settings = Settings(engines=[EngineSettings(**e) for e in urls(3)])
    registry = EngineRegistry(settings, httpx.AsyncClient())
    index = PrefixIndex()
    indexes = {tier: PrefixIndex() for tier in ("CPU", "STORAGE")}
    sched = Scheduler(registry, build_profile(settings.scheduling, TokenLedger(None).engine_room),
                      index=index, block_size=16, learn=False, topology=settings.topology,
                      tiers=indexes, tier_weights=tiers)
    return sched, registry, index, indexes


def test_a_prefix_offloaded_to_cpu_attracts_its_request_but_less_than_one_in_the_cache() -> None:
    weights = SchedulingSettings().prefix.tiers
    assert weights == {"CPU": 0.5, "STORAGE": 0.25}
    sched, reg, index, tiers = tiered(weights)
    chain = block_hashes(PROMPT, 16, chain_seed(MODEL))
    tiers["CPU"].add("http://e1:8000", chain)               # e1 offloaded the conversation to CPU
    reg.engines[1].inflight_tokens = reg.engines[1].token_budget // 4   # and is busier than the others
    placement = sched.place(req([*PROMPT, 5, 6]))
    assert placement is not None and placement.engine.url == "http://e1:8000"
    assert placement.matched_tokens == 0                    # the engine's own cache holds none of it

    index.add("http://e2:8000", chain)                      # e2 holds it in its KV cache: better
    placement = sched.place(req([*PROMPT, 7, 8]))
    assert placement is not None and placement.engine.url == "http://e2:8000"


def test_storage_counts_less_than_cpu_and_no_tiers_means_load_only() -> None:
    chain = block_hashes(PROMPT, 16, chain_seed(MODEL))
    sched, _reg, _index, tiers = tiered({"CPU": 0.5, "STORAGE": 0.25})
    tiers["STORAGE"].add("http://e0:8000", chain)
    tiers["CPU"].add("http://e1:8000", chain)
    placement = sched.place(req([*PROMPT, 1]))
    assert placement is not None and placement.engine.url == "http://e1:8000"

    # ``tiers: {}``: offloaded prefixes are not read, so the request goes by load (e0, e1 busier).
    sched, reg, _index, tiers = tiered({})
    tiers["CPU"].add("http://e1:8000", chain)
    for busy in reg.engines[:2]:
        busy.inflight_tokens = busy.token_budget // 4
    placement = sched.place(req([*PROMPT, 2]))
    assert placement is not None and placement.engine.url == "http://e2:8000"


@pytest.mark.parametrize(("cached", "runs", "expected"), [
    (0, {}, 0.0),
    (4, {"CPU": 10}, 0.5 * 6),                       # the CPU tier past the cache
    (4, {"CPU": 3}, 0.0),                            # a tier behind the cache adds nothing
    (2, {"CPU": 6, "STORAGE": 10}, 0.5 * 4 + 0.25 * 4),
    (2, {"CPU": 6, "STORAGE": 5}, 0.5 * 4),          # storage behind the CPU tier adds nothing
    (0, {"STORAGE": 8, "DISK": 20}, 0.25 * 8),       # a tier with no weight is not read
])
def test_each_block_counts_by_the_best_tier_holding_it(cached: int, runs: dict[str, int],
                                                       expected: float) -> None:
    from coordinator.pipeline.scheduling.prefix.memory import offloaded_blocks

    assert offloaded_blocks(cached, runs, {"CPU": 0.5, "STORAGE": 0.25}) == expected


def test_tier_weights_are_validated() -> None:
    from coordinator.config import PrefixIndexSettings

    assert PrefixIndexSettings(tiers={"cpu": 0.7, "storage": 0}).tiers == {"CPU": 0.7}
    for bad in ({"GPU": 0.5}, {"CPU": 1.5}, {"CPU": -0.1}):
        with pytest.raises(ValueError, match=r"tier|GPU"):
            PrefixIndexSettings(tiers=bad)


def test_deferred_learning_places_the_kv_affinity_workload_exactly_as_learning_at_once() -> None:
    """``perf.kv_affinity``'s conversations (8 tenants x 32 users x 8 turns) through two schedulers,
    one learning inside ``place`` and one whose lessons wait 0-5 decisions before a batch applies
    them (as ``soon`` on a busy event loop): the same engine for every request, the same index after."""
    import random

    from perf.kv_affinity import Workload, build_schedule

    schedule = build_schedule(Workload(tenants=8, users=32, turns=8, system_tokens=1500, turn_min=100,
                                       turn_max=200, think_s=1.6, ramp_s=6.0, seed=0))
    queued: list[Any] = []
    runs: dict[str, tuple[list[str], list[int], PrefixIndex]] = {}
    for mode in ("at_once", "deferred"):
        sched, _reg, index, _ = make(urls(4))
        if mode == "deferred":  # what app.py passes is ``soon``; here the test runs the batches
            sched.memory = PrefixMemory(index, None, learn=True, defer=queued.append)
        rng = random.Random(3)
        running: list[tuple[Any, int]] = []
        picks: list[str] = []
        matched: list[int] = []
        for i, turn in enumerate(schedule):
            if mode == "deferred" and queued and rng.random() < 0.4:
                queued.pop()()
            p = sched.place(SchedRequest(f"r{i}", MODEL, turn.prompt, 4))
            assert p is not None
            picks.append(p.engine.url)
            matched.append(p.matched_tokens)
            p.engine.inflight_tokens += len(turn.prompt)       # the engine is busy with it for a while
            running.append((p.engine, len(turn.prompt)))
            if len(running) > 12:
                done, tokens = running.pop(0)
                done.inflight_tokens -= tokens
        if mode == "deferred":
            assert queued, "the lessons must have waited for their batch"
        while queued:
            queued.pop()()
        runs[mode] = (picks, matched, index)
    (a_picks, a_matched, a_index), (d_picks, d_matched, d_index) = runs["at_once"], runs["deferred"]
    assert d_picks == a_picks and d_matched == a_matched
    assert sum(a_matched) > 0.5 * sum(len(t.prompt) for t in schedule)   # affinity did find prefixes
    assert {u: d_index.blocks(u) for u in d_index.engines()} == {u: a_index.blocks(u) for u in a_index.engines()}


# -- capabilities: a grammar needs an engine with a tokenizer -------------------------------------
GRAMMAR = frozenset({"tokenizer"})


def test_a_constrained_request_only_lands_on_engines_that_can_run_its_grammar() -> None:
    engines = [{"url": "http://e0:8000", "tokenizer": False},
               {"url": "http://e1:8000", "tokenizer": True},
               {"url": "http://e2:8000", "tokenizer": False}]
    sched, _reg, index, _ = make(engines, learn=False)
    index.add("http://e0:8000", block_hashes(PROMPT, 16, chain_seed(MODEL)))  # affinity pulls to e0
    for _ in range(4):
        placement = sched.place(req(PROMPT, needs=GRAMMAR))
        assert placement is not None and placement.engine.url == "http://e1:8000"
    plain = sched.place(req(PROMPT))
    assert plain is not None and plain.engine.url == "http://e0:8000"  # the others still take the rest
    assert sched.capable(MODEL, GRAMMAR)


def test_no_capable_engine_is_not_a_wait() -> None:
    """Capability is checked on the eligible set: an empty result is 'no engine can', never 'wait for
    room' (admission would hold the request until its timeout)."""
    sched, _reg, _index, _ = make(urls(2, tokenizer=False))
    assert not sched.capable(MODEL, GRAMMAR)
    with pytest.raises(NoHealthyEngine):
        sched.place(req(PROMPT, needs=GRAMMAR))
    assert not sched.has_other_engine(req(PROMPT, needs=GRAMMAR))


def test_a_capable_engine_that_is_down_means_503_not_a_client_error() -> None:
    sched, reg, _index, _ = make([{"url": "http://e0:8000", "tokenizer": True},
                                  {"url": "http://e1:8000", "tokenizer": False}])
    reg.engines[0].probe_ok = False
    reg.engines[1].probe_ok = True
    assert sched.capable(MODEL, GRAMMAR)  # exists: the request is fine, the fleet is not
    with pytest.raises(NoHealthyEngine):
        sched.place(req(PROMPT, needs=GRAMMAR))


def test_pd_with_grammar_capable_decode_engines_hands_off_to_a_capable_prefill_engine() -> None:
    engines = [{"url": "http://p0:8000", "role": "prefill", "tokenizer": False},
               {"url": "http://p1:8000", "role": "prefill", "tokenizer": True},
               {"url": "http://d0:8000", "role": "decode", "tokenizer": True}]
    sched, _reg, _index, _ = make(engines, pd_min=0)
    for _ in range(3):
        placement = sched.place(req(PROMPT, needs=GRAMMAR))
        assert placement is not None and placement.prefill is not None
        assert placement.prefill.url == "http://p1:8000" and placement.engine.url == "http://d0:8000"


def test_pd_without_a_capable_prefill_engine_prefills_on_the_decode_engine() -> None:
    engines = [{"url": "http://p0:8000", "role": "prefill", "tokenizer": False},
               {"url": "http://d0:8000", "role": "decode", "tokenizer": True}]
    sched, _reg, _index, metrics = make(engines, pd_min=0)
    placement = sched.place(req(PROMPT, needs=GRAMMAR))
    assert placement is not None and placement.prefill is None and placement.engine.url == "http://d0:8000"
    assert metrics.registry.get_sample_value("coordinator_pd_decisions_total", {"path": "decode_only"}) == 1


def test_pd_whose_decode_engines_cannot_run_a_grammar_sends_it_to_a_capable_union_engine() -> None:
    engines = [{"url": "http://p0:8000", "role": "prefill", "tokenizer": False},
               {"url": "http://d0:8000", "role": "decode", "tokenizer": False},
               {"url": "http://u0:8000", "role": "union", "tokenizer": True}]
    sched, _reg, _index, _ = make(engines, pd_min=0)
    placement = sched.place(req(PROMPT, needs=GRAMMAR))
    assert placement is not None and placement.prefill is None and placement.engine.url == "http://u0:8000"
    plain = sched.place(req(PROMPT))
    assert plain is not None and plain.prefill is not None  # unconstrained requests keep their P/D pair
    only_prefill = make([engines[0] | {"tokenizer": True}, engines[1]])[0]
    assert not only_prefill.capable(MODEL, GRAMMAR)  # a prefill engine alone never writes the output
