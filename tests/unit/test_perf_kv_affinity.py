"""perf.kv_affinity's own logic (workload, oracle, pickers, figures) without a sidecar or engines."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from coordinator.pipeline.scheduling.request import SchedRequest
from coordinator.pipeline.scheduling.types import ScoringInput
from perf.kv_affinity import (
    BLOCK_SIZE,
    LeastLoadTiePicker,
    OracleScorer,
    Workload,
    _markdown,
    _plot,
    build_schedule,
    headline,
)
from token_engine.simulator import PrefixCache

WORK = Workload(tenants=2, users=6, turns=3, system_tokens=300, turn_min=100, turn_max=200,
                think_s=0.5, ramp_s=1.0, seed=7)


def test_schedule_is_seeded_time_ordered_and_each_turn_extends_the_last() -> None:
    schedule = build_schedule(WORK)
    assert schedule == build_schedule(WORK)
    assert len(schedule) == WORK.users * WORK.turns
    assert [t.at for t in schedule] == sorted(t.at for t in schedule)
    by_user: dict[int, list[Any]] = {}
    for t in schedule:
        by_user.setdefault(t.user, []).append(t)
    for turns in by_user.values():
        assert [t.turn for t in turns] == list(range(WORK.turns))
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.prompt[:len(prev.prompt)] == prev.prompt
            assert 100 <= len(nxt.prompt) - len(prev.prompt) <= 200
    first = {t.user: t.prompt for t in schedule if t.turn == 0}
    assert first[0][:280] == first[2][:280] != first[1][:280]  # users 0 and 2 share tenant 0's prompt


def engine(url: str, inflight_tokens: int = 0) -> Any:
    return SimpleNamespace(url=url, inflight_tokens=inflight_tokens)


def test_oracle_reads_the_true_cache_and_ties_go_to_the_least_loaded() -> None:
    prompt = list(range(100, 100 + 10 * BLOCK_SIZE))
    warm, cold = PrefixCache(BLOCK_SIZE, 64), PrefixCache(BLOCK_SIZE, 64)
    warm.insert(prompt[:6 * BLOCK_SIZE])
    scorer = OracleScorer({"a": cold, "b": warm})
    data = ScoringInput(SchedRequest("r", "m", prompt, 4), {}, BLOCK_SIZE)
    engines = [engine("a"), engine("b")]
    assert scorer(data, engines) == [0.0, 0.6]
    assert warm.stats.queries == 0                    # read only: no counters, no LRU change
    picker = LeastLoadTiePicker()
    assert picker([engine("a", 500), engine("b", 100)], [0.5, 0.5], data).url == "b"
    assert picker([engine("a", 0), engine("b", 100)], [0.1, 0.5], data).url == "b"


def result(hit: float, p90: float, imbalance: float) -> dict[str, Any]:
    return {"hit_rate": hit, "ttft_p50_ms": p90 / 2, "ttft_p90_ms": p90, "load_imbalance": imbalance,
            "errors": 0, "requests_per_engine": [3, 3, 3, 3], "prefill_imbalance": 1.0, "evictions": 0,
            "requests_per_s": 1.0}


def test_headline_checks_targets_per_variant_and_report_renders(tmp_path: Path) -> None:
    results = {"round_robin": result(0.5, 500.0, 1.0), "oracle": result(0.9, 60.0, 1.2),
               "affinity_approximate": result(0.88, 70.0, 1.5), "affinity_precise": result(0.85, 90.0, 1.1)}
    head = headline(results)
    assert head["affinity_approximate_hit_rate"] == 0.88 and head["round_robin_ttft_p90_ms"] == 500.0
    assert head["ttft_p90_gain_vs_rr"] == 7.14 and head["hit_rate_vs_oracle"] == 0.978
    assert head["targets_met"] is False               # imbalance 1.5 > 1.25
    assert head["precise_targets_met"] is True
    assert "unbounded_targets_met" not in head
    figures = {"workload": vars(WORK), "engine_model": {"capacity_blocks": 8, "slots": 1,
               "prefill_s_per_token": 0.0002, "decode_s_per_token": 0.005, "ttft_s": 0.01},
               "requests": 18, "closed_loop": False, "concurrency": 4, "max_tokens": 4,
               "working_set_blocks": 10, "policies": results}
    assert "| affinity_precise | 0.944 | 5.56 | 1.1 | True |" in _markdown(figures, head)
    _plot(figures, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
