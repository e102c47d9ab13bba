"""How long one scheduling decision takes with a full prefix index (16 engines x 10,000 blocks each).

The scheduler runs synchronously on the coordinator's event loop (admission calls ``place`` for every
request and again for every queued waiter it retries), so its cost is paid per request and blocks all
other streams while it runs. Measured: ``Scheduler.place`` on a fresh ``SchedRequest`` (so the chained
block hashes are computed), with the production wiring: approximate prefix index with
``capacity_blocks`` = 10,000 so it stays full while ``learn`` adds every routed prompt, a ``Metrics``
object, static engine loads for the ``load`` scorer. Baselines in the same run and on identical
request streams: ``least_load`` and ``round_robin`` (same index configuration, as a config that only
changes ``policy`` gets), and ``round_robin`` without any index (``source: none``, the floor).

Workload (seeded): multi-turn conversations on 24 shared system prompts (popularity skewed). Each
request is a continuation of an earlier conversation (50 %: shares its whole indexed prefix), a new
conversation on a known system prompt (30 %: shares the system prompt, held by many engines) or cold
(20 %). The index is pre-filled with such conversations of 1-2k tokens until every engine holds its
capacity, then every routed request becomes part of the conversation pool.

    python -m perf.scheduler_latency [--decisions 4000] [--scaling-decisions 1000] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from coordinator.config import PrefixIndexSettings
from coordinator.contracts.hashing import NATIVE_CHAIN, block_hashes, chain_seed
from coordinator.pipeline.scheduling.prefix.index import NATIVE_INDEX, PrefixIndex
from coordinator.pipeline.scheduling.prefix.kv_events import NATIVE_MIRROR
from coordinator.pipeline.scheduling.request import SchedRequest
from coordinator.pipeline.scheduling.scheduler import Scheduler
from perf._indexer_intake import kv_intake_pod
from perf._report import Progress, final_json, save_figure, write_report
from perf._scheduler_scale import agent_scale, bench_scheduler, kv_intake, stats_ms

INTAKE_LATENESS_P99_MS = 5.0     # pod indexer: a due decision waits at most this for its worker's loop
INTAKE_LATENESS_P50_MS = 1.0
INTAKE_CPU_US_PER_BLOCK = 2.0    # over every process of the pod
INTAKE_WORKERS_RATIO = 1.2       # N workers' intake CPU over 1 worker's
NAME = "scheduler_latency"
MODEL = "smollm2-135m-instruct"
TARGET_P50_MS = 0.2
TARGET_RR_RATIO = 4.0      # affinity p50 at 2k tokens, as a multiple of round-robin's in the same run
SCALE_P50_MS, SCALE_P99_MS = 1.0, 3.0   # a decision at 100k tokens over 256 engines
PROMPT_TOKENS = 2048
SCALING_LENGTHS = (512, 2048, 8192)
MAX_TOKENS = 256
BLOCK = PrefixIndexSettings().block_size
IdArray = npt.NDArray[np.int32]
POOL_MAX = 4000
# (label, policy, index source); the first is the one the target applies to.
VARIANTS: tuple[tuple[str, str, str], ...] = (
    ("affinity", "affinity", "approximate"),
    ("least_load", "least_load", "approximate"),
    ("round_robin", "round_robin", "approximate"),
    ("round_robin_no_index", "round_robin", "none"),
)


class Workload:
    """A seeded stream of prompts; each variant gets its own copy so all see identical requests.

    Prompts are kept as int32 arrays (a pool of thousands of 2-8k-token prompts as Python int lists
    would take gigabytes) and handed to the scheduler as ``list[int]``, as they arrive from render."""

    def __init__(self, seed: int, n_systems: int = 24, system_tokens: tuple[int, int] = (256, 769),
                 pool_max: int = POOL_MAX) -> None:
        self.rng = np.random.default_rng(seed)
        self.systems = [self.tokens(int(self.rng.integers(*system_tokens))) for _ in range(n_systems)]
        self.pool_max = pool_max
        weights = 1.0 / np.arange(1, n_systems + 1)        # Zipf-like: a few system prompts dominate
        self.sys_p = weights / weights.sum()
        self.pool: list[IdArray] = []
        self.kinds = {"continuation": 0, "system": 0, "cold": 0}

    def tokens(self, n: int) -> IdArray:
        return self.rng.integers(100, 49_000, size=max(0, n), dtype=np.int32)

    def conversation(self, length: int) -> IdArray:
        sys_prompt = self.systems[int(self.rng.choice(len(self.systems), p=self.sys_p))]
        return np.concatenate([sys_prompt, self.tokens(length - len(sys_prompt))])

    def next(self, length: int) -> list[int]:
        """A continuation keeps a long indexed prefix (the earlier turns) and adds a new turn."""
        r = float(self.rng.random())
        if r < 0.5 and self.pool:
            self.kinds["continuation"] += 1
            base = self.pool[int(self.rng.integers(len(self.pool)))]
            keep = min(len(base), length - int(self.rng.integers(64, 257)))
            prompt = np.concatenate([base[:keep], self.tokens(length - keep)])
        elif r < 0.8:
            self.kinds["system"] += 1
            prompt = self.conversation(length)
        else:
            self.kinds["cold"] += 1
            prompt = self.tokens(length)
        self.remember(prompt)
        ids: list[int] = prompt.tolist()
        return ids

    def remember(self, prompt: IdArray) -> None:
        if len(self.pool) < self.pool_max:
            self.pool.append(prompt)
        else:
            self.pool[int(self.rng.integers(self.pool_max))] = prompt


@dataclass
class Variant:
    label: str
    scheduler: Scheduler
    workload: Workload
    samples_s: list[float]
    matched: list[int]
    cpu_s: list[float]
    learn_s: list[float]


def fill_index(engines: list[str], capacity: int, seed: int) -> tuple[PrefixIndex, list[IdArray]]:
    """Conversations of 1-2k tokens (1-3 turns each) added engine by engine until every engine holds
    ``capacity`` blocks; returns the index and the conversations (the pool requests continue)."""
    index = PrefixIndex(capacity_blocks=capacity, ttl_s=PrefixIndexSettings().ttl_s)
    wl = Workload(seed)
    seed_hash = chain_seed(MODEL)
    pool: list[IdArray] = []
    for url in engines:
        while index.blocks(url) < capacity:
            turns = int(wl.rng.integers(1, 4))
            lengths = sorted(int(x) for x in wl.rng.integers(1024, 2049, size=turns))
            prompt = wl.conversation(lengths[0])
            for n in lengths:
                prompt = np.concatenate([prompt, wl.tokens(n - len(prompt))])
                index.add(url, block_hashes(prompt.tolist(), BLOCK, seed_hash))
            pool.append(prompt)
    return index, pool


def build_variant(label: str, policy: str, source: str, n_engines: int, filled: PrefixIndex,
                  pool: list[IdArray], seed: int, http: httpx.AsyncClient) -> Variant:
    """The learning the scheduler defers is applied right after each timed decision and timed apart
    (``Variant.learn_s``)."""
    index = copy.deepcopy(filled) if source == "approximate" else None
    scheduler = bench_scheduler(n_engines, policy, index, http, seed)
    wl = Workload(seed)
    wl.pool = list(pool)
    return Variant(label, scheduler, wl, [], [], [], [])


def run_chunk(v: Variant, n: int, length: int) -> None:
    """Wall time is what the event loop loses; thread CPU time leaves out preemption by the other
    processes on a shared machine, so it is the steadier estimate of the code's own cost."""
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    for i in range(n):
        req = SchedRequest(request_id=f"{v.label}-{i}", model=MODEL, prompt_token_ids=v.workload.next(length),
                           max_tokens=MAX_TOKENS)
        t0, c0 = wall(), cpu()
        placement = v.scheduler.place(req)
        c1, t1 = cpu(), wall()
        v.scheduler.flush_learning()
        t2 = wall()
        v.samples_s.append((t1 - t0) / 1e9)
        v.cpu_s.append((c1 - c0) / 1e9)
        v.learn_s.append((t2 - t1) / 1e9)
        assert placement is not None
        v.matched.append(placement.matched_tokens)


def breakdown(index: PrefixIndex, engines: list[str], wl: Workload, n: int, length: int) -> dict[str, float]:
    """Where an affinity decision's time goes: hashing the prompt, matching it, learning it."""
    seed = chain_seed(MODEL)
    probe = copy.deepcopy(index)
    hashing: list[float] = []
    matching: list[float] = []
    learning: list[float] = []
    for i in range(n):
        prompt = wl.next(length)
        t0 = time.perf_counter_ns()
        hashes = block_hashes(prompt, BLOCK, seed)
        t1 = time.perf_counter_ns()
        probe.match(hashes)
        t2 = time.perf_counter_ns()
        probe.add(engines[i % len(engines)], hashes)
        t3 = time.perf_counter_ns()
        hashing.append((t1 - t0) / 1e9)
        matching.append((t2 - t1) / 1e9)
        learning.append((t3 - t2) / 1e9)
    return {"hash_p50_ms": stats_ms(hashing)["p50_ms"], "match_p50_ms": stats_ms(matching)["p50_ms"],
            "learn_p50_ms": stats_ms(learning)["p50_ms"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=10_000, help="indexed blocks per engine")
    ap.add_argument("--decisions", type=int, default=4000, help="timed decisions per policy at 2k tokens")
    ap.add_argument("--scaling-decisions", type=int, default=1000, help="per policy and prompt length")
    ap.add_argument("--chunk", type=int, default=100, help="decisions per policy before switching policy")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--scale-engines", type=int, default=256)
    ap.add_argument("--scale-tokens", type=int, default=100_000)
    ap.add_argument("--scale-capacity", type=int, default=8_000, help="indexed blocks per engine at scale")
    ap.add_argument("--scale-decisions", type=int, default=300)
    ap.add_argument("--intake-decisions", type=int, default=200)
    ap.add_argument("--intake-interval-ms", type=float, default=100.0, help="pause between decisions")
    ap.add_argument("--intake-batches-per-s", type=float, default=10.0, help="per engine")
    ap.add_argument("--intake-blocks-per-batch", type=int, default=16)
    ap.add_argument("--intake-workers", type=int, default=4, help="worker processes of the pod variant")
    ap.add_argument("--quick", action="store_true", help="smoke run: small index, few decisions")
    args = ap.parse_args(argv)
    if args.quick:
        args.engines, args.blocks, args.decisions, args.scaling_decisions, args.chunk = 4, 500, 200, 60, 20
        args.scale_engines, args.scale_tokens, args.scale_capacity, args.scale_decisions = 8, 8192, 1000, 40
        args.intake_decisions, args.intake_interval_ms = 30, 10.0
    say = Progress(NAME)

    engines = [f"http://engine-{i}:8000" for i in range(args.engines)]
    say(f"filling the prefix index: {args.engines} engines x {args.blocks} blocks (1-2k-token conversations)")
    filled, pool = fill_index(engines, args.blocks, args.seed)
    fill_blocks = [filled.blocks(u) for u in engines]
    say(f"index filled: {sum(fill_blocks)} blocks, {len(pool)} conversations")

    http = httpx.AsyncClient()   # the registry wants one; nothing is probed here
    variants = [build_variant(label, policy, source, args.engines, filled, pool, args.seed, http)
                for label, policy, source in VARIANTS]
    gc.collect()

    def measure(length: int, per_variant: int) -> dict[str, dict[str, float]]:
        for v in variants:
            run_chunk(v, min(args.chunk, per_variant), length)   # warm-up, discarded
            v.samples_s, v.matched, v.cpu_s, v.learn_s = [], [], [], []
        done = 0
        while done < per_variant:
            n = min(args.chunk, per_variant - done)
            for v in variants:   # interleaved: machine noise hits every policy alike
                run_chunk(v, n, length)
            done += n
        out: dict[str, dict[str, float]] = {}
        for v in variants:
            s = stats_ms(v.samples_s)
            cpu = stats_ms(v.cpu_s)
            s["cpu_p50_ms"], s["cpu_p99_ms"] = cpu["p50_ms"], cpu["p99_ms"]
            learn = stats_ms(v.learn_s)
            s["learn_p50_ms"], s["learn_p99_ms"] = learn["p50_ms"], learn["p99_ms"]
            s["hit_share"] = round(sum(1 for m in v.matched if m > 0) / len(v.matched), 3)
            s["matched_tokens_mean"] = round(statistics.fmean(v.matched), 1)
            out[v.label] = s
        return out

    say(f"timing {args.decisions} decisions per policy at {PROMPT_TOKENS} prompt tokens "
        f"({', '.join(v.label for v in variants)}, interleaved in chunks of {args.chunk})")
    main_run = measure(PROMPT_TOKENS, args.decisions)
    for label, s in main_run.items():
        say(f"  {label:22s} p50 {s['p50_ms']:.4f} ms  p99 {s['p99_ms']:.4f} ms  hits {s['hit_share']:.0%}")
    scaling: dict[str, dict[str, dict[str, float]]] = {}
    for length in SCALING_LENGTHS:
        say(f"scaling: {args.scaling_decisions} decisions per policy at {length} prompt tokens")
        scaling[str(length)] = measure(length, args.scaling_decisions)
        say("  " + ", ".join(f"{k} p50 {v['p50_ms']:.4f} ms" for k, v in scaling[str(length)].items()))
    aff = variants[0]
    assert aff.scheduler.index is not None
    say("breakdown of an affinity decision at 2k tokens (hash / match / learn)")
    parts = breakdown(aff.scheduler.index, engines, aff.workload, min(1000, args.decisions), PROMPT_TOKENS)
    end_blocks = [aff.scheduler.index.blocks(u) for u in engines]
    asyncio.run(http.aclose())
    variants.clear()   # free the 2k indexes before the big one
    del filled, pool
    gc.collect()
    scale = agent_scale(Workload, engines=args.scale_engines, capacity=args.scale_capacity,
                        tokens=args.scale_tokens, decisions=args.scale_decisions,
                        chunk=min(args.chunk, 50), seed=args.seed, say=say)
    sp = scale["parts"]
    say(f"  decision p50 {sp['decision']['p50_ms']:.3f} ms p99 {sp['decision']['p99_ms']:.3f} ms "
        f"(match {sp['match']['p50_ms']:.3f}, rest {sp['rest']['p50_ms']:.3f}); hashing it here too "
        f"{sp['decision_self_hashed']['p50_ms']:.3f} ms (hash {sp['hash']['p50_ms']:.3f}); "
        f"learn {sp['learn']['p50_ms']:.3f} ms; round_robin {sp['rr']['p50_ms']:.3f} ms")
    gc.collect()
    intake = kv_intake(Workload, engines=args.scale_engines, tokens=args.scale_tokens,
                       decisions=args.intake_decisions, interval_s=args.intake_interval_ms / 1000,
                       batches_per_s=args.intake_batches_per_s, blocks_per_batch=args.intake_blocks_per_batch,
                       seed=args.seed, say=say)
    def pod_run(workers: int, **variant: Any) -> dict[str, Any]:
        """The pod's intake with ``workers`` workers; ``variant``: a baseline's settings."""
        return kv_intake_pod(Workload, engines=args.scale_engines, tokens=args.scale_tokens,
                             decisions=args.intake_decisions, interval_s=args.intake_interval_ms / 1000,
                             batches_per_s=args.intake_batches_per_s,
                             blocks_per_batch=args.intake_blocks_per_batch, seed=args.seed, workers=workers,
                             say=say, **variant)

    pod = {str(n): pod_run(n) for n in (1, args.intake_workers)}
    pure = pod_run(1, pure_python=True)
    woken = pod_run(1, gather_ms=0.0)   # the baseline of gathered wake-ups: a wake-up per batch
    libzmq = pod_run(1, reader="libzmq")   # the baseline of our own ZMTP reader: libzmq's SUB sockets
    small_pages = pod_run(1, huge_pages=False)   # the baseline of huge pages: the tables on 4 KiB pages
    one, many = pod["1"], pod[str(args.intake_workers)]
    pod_targets = {
        "lateness_p99": one["busy_lateness_p99_ms"] <= INTAKE_LATENESS_P99_MS
        and many["busy_lateness_p99_ms"] <= INTAKE_LATENESS_P99_MS,
        "lateness_p50": one["busy_lateness_p50_ms"] <= INTAKE_LATENESS_P50_MS
        and many["busy_lateness_p50_ms"] <= INTAKE_LATENESS_P50_MS,
        "cpu_per_block": one["intake_cpu_us_per_block"] <= INTAKE_CPU_US_PER_BLOCK,
        "workers_cpu_ratio": many["intake_cpu_us_per_block"]
        <= INTAKE_WORKERS_RATIO * one["intake_cpu_us_per_block"],
        "every_block_applied": all(r["applied_blocks"] == r["published_blocks"] and r["gaps"] == 0
                                   for r in pod.values()),
    }

    a, rr, ll = main_run["affinity"], main_run["round_robin"], main_run["least_load"]
    figures: dict[str, Any] = {
        "engines": args.engines, "blocks_per_engine": args.blocks, "prompt_tokens": PROMPT_TOKENS,
        "max_tokens": MAX_TOKENS, "decisions": args.decisions, "quick": args.quick,
        "index_blocks_after_fill": {"min": min(fill_blocks), "max": max(fill_blocks)},
        "index_blocks_after_run": {"min": min(end_blocks), "max": max(end_blocks)},
        "request_mix": aff.workload.kinds, "policies": main_run, "scaling": scaling,
        "affinity_breakdown": parts,
        "affinity_vs_rr_p50_ratio": round(a["p50_ms"] / rr["p50_ms"], 3),
        "affinity_vs_least_load_p50_ratio": round(a["p50_ms"] / ll["p50_ms"], 3),
        "target_p50_ms": TARGET_P50_MS, "target_rr_ratio": TARGET_RR_RATIO,
        "target_met": a["p50_ms"] / rr["p50_ms"] <= TARGET_RR_RATIO,
        "scale": scale, "intake": intake, "intake_pod": pod, "intake_pod_targets": pod_targets,
        "intake_workers_cpu_ratio": round(many["intake_cpu_us_per_block"]
                                          / max(0.01, one["intake_cpu_us_per_block"]), 2),
        "intake_pod_pure_python": pure, "native_extensions": NATIVE_CHAIN and NATIVE_INDEX and NATIVE_MIRROR,
        "intake_native_vs_pure_ratio": round(one["intake_cpu_us_per_block"]
                                             / max(0.01, pure["intake_cpu_us_per_block"]), 2),
        "intake_pod_per_batch_wakeups": woken,
        "intake_gathered_vs_per_batch_ratio": round(one["intake_cpu_us_per_block"]
                                                    / max(0.01, woken["intake_cpu_us_per_block"]), 2),
        "intake_pod_libzmq": libzmq,
        "intake_own_reader_vs_libzmq_ratio": round(one["intake_cpu_us_per_block"]
                                                   / max(0.01, libzmq["intake_cpu_us_per_block"]), 2),
        "intake_pod_small_pages": small_pages,
        "intake_huge_vs_small_pages_ratio": round(one["intake_cpu_us_per_block"]
                                                  / max(0.01, small_pages["intake_cpu_us_per_block"]), 2),
        "scale_target": {"p50_ms": SCALE_P50_MS, "p99_ms": SCALE_P99_MS},
        "scale_target_met": (scale["parts"]["decision"]["p50_ms"] <= SCALE_P50_MS
                             and scale["parts"]["decision"]["p99_ms"] <= SCALE_P99_MS),
    }
    out = write_report(NAME, figures, _markdown(figures))
    _plot(figures, out / f"{NAME}.png")
    say(f"report: {out}/report.md, plot: {out}/{NAME}.png")
    final_json({"benchmark": NAME, "engines": args.engines, "blocks_per_engine": args.blocks,
                "prompt_tokens": PROMPT_TOKENS, "p50_ms": a["p50_ms"], "p99_ms": a["p99_ms"],
                "cpu_p50_ms": a["cpu_p50_ms"], "cpu_p99_ms": a["cpu_p99_ms"],
                "rr_p50_ms": rr["p50_ms"], "least_load_p50_ms": ll["p50_ms"],
                "rr_no_index_p50_ms": main_run["round_robin_no_index"]["p50_ms"],
                "affinity_vs_rr_p50_ratio": figures["affinity_vs_rr_p50_ratio"],
                "affinity_p50_ms_8k": scaling["8192"]["affinity"]["p50_ms"],
                "target_rr_ratio": TARGET_RR_RATIO, "target_met": figures["target_met"],
                "scale_engines": scale["engines"], "scale_tokens": scale["prompt_tokens"],
                "scale_p50_ms": sp["decision"]["p50_ms"], "scale_p99_ms": sp["decision"]["p99_ms"],
                "scale_cpu_p99_ms": sp["decision_cpu"]["p99_ms"], "scale_rr_p99_ms": sp["rr"]["p99_ms"],
                "scale_self_hashed_p50_ms": sp["decision_self_hashed"]["p50_ms"],
                "scale_learn_p50_ms": sp["learn"]["p50_ms"], "scale_rr_p50_ms": sp["rr"]["p50_ms"],
                "scale_target_met": figures["scale_target_met"],
                "intake_busy_vs_idle_decision_p50": intake["busy_vs_idle_decision_p50"],
                "intake_busy_lateness_p99_ms": intake["busy_lateness_p99_ms"],
                "intake_cpu_us_per_block": intake["intake_cpu_us_per_block"],
                "pod_intake_lateness_p99_ms": one["busy_lateness_p99_ms"],
                "pod_intake_lateness_p50_ms": one["busy_lateness_p50_ms"],
                "pod_intake_cpu_us_per_block": one["intake_cpu_us_per_block"],
                "pod_indexer_cpu_us_per_block": one["indexer_cpu_us_per_block"],
                f"pod_intake_{args.intake_workers}_workers_cpu_us_per_block": many["intake_cpu_us_per_block"],
                "pod_intake_workers_cpu_ratio": figures["intake_workers_cpu_ratio"],
                "pod_intake_pure_python_cpu_us_per_block": pure["intake_cpu_us_per_block"],
                "pod_intake_native_vs_pure_ratio": figures["intake_native_vs_pure_ratio"],
                "pod_intake_per_batch_wakeups_cpu_us_per_block": woken["intake_cpu_us_per_block"],
                "pod_intake_gathered_vs_per_batch_ratio": figures["intake_gathered_vs_per_batch_ratio"],
                "pod_intake_libzmq_cpu_us_per_block": libzmq["intake_cpu_us_per_block"],
                "pod_intake_own_reader_vs_libzmq_ratio": figures["intake_own_reader_vs_libzmq_ratio"],
                "pod_intake_small_pages_cpu_us_per_block": small_pages["intake_cpu_us_per_block"],
                "pod_intake_huge_vs_small_pages_ratio": figures["intake_huge_vs_small_pages_ratio"],
                "pod_intake_targets": pod_targets})


def _markdown(f: dict[str, Any]) -> str:
    rows = ["| policy (index) | p50 ms | p90 ms | p99 ms | mean ms | CPU p50 / p99 ms | "
            "p50 ratio to affinity | decisions with a prefix hit |", "|---|---|---|---|---|---|---|---|"]
    a50 = f["policies"]["affinity"]["p50_ms"]
    for label, s in f["policies"].items():
        rows.append(f"| {label} | {s['p50_ms']:.4f} | {s['p90_ms']:.4f} | {s['p99_ms']:.4f} | "
                    f"{s['mean_ms']:.4f} | {s['cpu_p50_ms']:.4f} / {s['cpu_p99_ms']:.4f} | "
                    f"{s['p50_ms'] / a50:.2f} | {s['hit_share']:.0%} |")
    scale = ["| prompt tokens | " + " | ".join(f"{k} p50 / p99 ms" for k in f["policies"]) + " |",
             "|---" * (len(f["policies"]) + 1) + "|"]
    for length, per in f["scaling"].items():
        scale.append(f"| {length} | " + " | ".join(f"{v['p50_ms']:.3f} / {v['p99_ms']:.3f}"
                                                   for v in per.values()) + " |")
    b = f["affinity_breakdown"]
    verdict = "met" if f["target_met"] else "NOT met"
    learn = f["policies"]["affinity"]
    sc, it = f["scale"], f["intake"]
    sp = sc["parts"]
    split = ["| part | p50 ms | p90 ms | p99 ms |", "|---|---|---|---|"]
    names = {"decision": "**decision** (hashes from render: match + rest)",
             "decision_cpu": "decision, thread CPU time (what preemption does not inflate)",
             "decision_self_hashed": "decision, the coordinator hashing (hash + match + rest)",
             "hash": "hash in the coordinator (once per request)",
             "match": "match (index + pending lessons)", "rest": "rest: filters, scorers, picker, metrics",
             "learn": "learn (after the decision, batched)", "rr": "round_robin decision (no index)",
             "rr_cpu": "round_robin decision, thread CPU time"}
    for k, label in names.items():
        split.append(f"| {label} | {sp[k]['p50_ms']:.3f} | {sp[k]['p90_ms']:.3f} | {sp[k]['p99_ms']:.3f} |")
    scale_verdict = "met" if f["scale_target_met"] else "NOT met"
    ib, ii = it["busy"], it["idle"]
    return (f"# Scheduler decision latency\n\n{f['engines']} engines x {f['blocks_per_engine']} indexed "
            f"blocks (approximate index, capacity {f['blocks_per_engine']}, learning on), "
            f"{f['decisions']} decisions per policy at {f['prompt_tokens']} prompt tokens, fresh request "
            f"each time (hashing included; learning applied after each decision and timed apart).\n\n"
            f"Target affinity p50 ≤ {f['target_rr_ratio']}x round_robin: **{verdict}** "
            f"(affinity p50 {a50:.4f} ms, {f['affinity_vs_rr_p50_ratio']}x round_robin; learning after it "
            f"p50 {learn['learn_p50_ms']:.4f} ms, p99 {learn['learn_p99_ms']:.4f} ms).\n\n"
            + "\n".join(rows) + "\n\nPrompt length:\n\n" + "\n".join(scale)
            + f"\n\nAffinity at 2k tokens, by part (p50): hash {b['hash_p50_ms']:.4f} ms, match "
            f"{b['match_p50_ms']:.4f} ms, learn {b['learn_p50_ms']:.4f} ms (learning a prompt on another "
            f"engine than the one holding it: mostly new blocks).\n\n"
            f"Index blocks per engine after fill {f['index_blocks_after_fill']}, after the run "
            f"{f['index_blocks_after_run']}; request mix {f['request_mix']}.\n\n"
            f"## At agent scale: {sc['engines']} engines, {sc['prompt_tokens']}-token prompts\n\n"
            f"Approximate index full at {sc['capacity_blocks']} blocks per engine "
            f"({sc['index_blocks']['total']:,} blocks, ~{sc['index_bytes'] / 2**20:,.0f} MiB estimated, "
            f"{sc['bytes_per_block']} bytes a block); "
            f"{sc['decisions']} decisions per policy; {sc['hit_share']:.0%} of affinity decisions found a "
            f"prefix (mean {sc['matched_tokens_mean']:,.0f} tokens).\n\n"
            f"Target decision p50 ≤ {f['scale_target']['p50_ms']} ms and p99 ≤ "
            f"{f['scale_target']['p99_ms']} ms: "
            f"**{scale_verdict}** ({sc['decision_vs_rr_p50_ratio']}x round_robin).\n\n" + "\n".join(split)
            + f"\n\n## KV-event intake from {it['engines']} engines\n\n"
            f"Precise source over real ZMQ, one publisher socket per engine (vLLM's wire format), "
            f"{it['offered_blocks_per_s']:,} blocks/s offered, stored and as many removed (every engine's "
            f"cache is filled first: the steady state); a decision at {it['prompt_tokens']} tokens "
            f"{it['interval_ms']:.0f} ms after the last one "
            f"(lateness: how long a due decision waits for the event loop).\n\n"
            "| publishers | decision p50 / p99 ms | lateness p50 / p99 ms | blocks applied/s "
            "| CPU (cores) |\n"
            "|---|---|---|---|---|\n"
            f"| idle | {ii['decision']['p50_ms']:.3f} / {ii['decision']['p99_ms']:.3f} | "
            f"{ii['lateness']['p50_ms']:.3f} / {ii['lateness']['p99_ms']:.3f} | "
            f"{ii['blocks_applied_per_s']:,} | {ii['cpu_share']:.2f} |\n"
            f"| busy | {ib['decision']['p50_ms']:.3f} / {ib['decision']['p99_ms']:.3f} | "
            f"{ib['lateness']['p50_ms']:.3f} / {ib['lateness']['p99_ms']:.3f} | "
            f"{ib['blocks_applied_per_s']:,} | {ib['cpu_share']:.2f} |\n\n"
            f"Busy/idle decision p50: {it['busy_vs_idle_decision_p50']}x; intake CPU "
            f"{it['intake_cpu_us_per_block']} µs per stored block (its removal included); "
            f"sequence gaps {it['gaps']} "
            f"({it['missed_batches']} batches missed).\n\n" + _pod_markdown(f)
            + f"\n\n![plot]({NAME}.png)\n")


def _pod_markdown(f: dict[str, Any]) -> str:
    """The same intake with the pod's KV indexer (docs/scheduling.md, "The pod's KV index")."""
    it, pod, ok = f["intake"], f["intake_pod"], f["intake_pod_targets"]
    rows = ["| where the index lives | workers | busy decision p50 / p99 ms | busy lateness p50 / p99 ms | "
            "intake CPU µs per block (all processes) | of which the indexer | blocks published / applied | "
            "gaps | matches unanswered |", "|---|---|---|---|---|---|---|---|---|"]
    ib = it["busy"]
    rows.append(f"| in the worker (local) | 1 | {ib['decision']['p50_ms']:.3f} / "
                f"{ib['decision']['p99_ms']:.3f} | "
                f"{ib['lateness']['p50_ms']:.3f} / {ib['lateness']['p99_ms']:.3f} | "
                f"{it['intake_cpu_us_per_block']} | n/a | {it['published_blocks']:,} / n/a | {it['gaps']} "
                "| n/a |")
    woken = f["intake_pod_per_batch_wakeups"]
    named = [*((f"pod indexer process, feeds gathered every {r['gather_ms']:g} ms, read by {r['reader']}",
                n, r) for n, r in pod.items()),
             ("pod indexer process, pure Python (baseline)", "1", f["intake_pod_pure_python"]),
             ("pod indexer process, a wake-up per batch (baseline, `gather_ms: 0`)", "1", woken),
             ("pod indexer process, feeds read by libzmq (baseline, `reader: libzmq`)", "1",
              f["intake_pod_libzmq"]),
             ("pod indexer process, tables on 4 KiB pages (baseline, `huge_pages: false`)", "1",
              f["intake_pod_small_pages"])]
    for where, n, r in named:
        b = r["busy"]
        rows.append(f"| {where} | {n} | {b['decision']['p50_ms']:.3f} / "
                    f"{b['decision']['p99_ms']:.3f} | "
                    f"{b['lateness']['p50_ms']:.3f} / {b['lateness']['p99_ms']:.3f} | "
                    f"{r['intake_cpu_us_per_block']} | {r['indexer_cpu_us_per_block']} | "
                    f"{r['published_blocks']:,} / {r['applied_blocks']:,} | "
                    f"{r['gaps']} | {b['unanswered']} |")

    def met(key: str) -> str:
        return "met" if ok[key] else "**NOT met**"

    return ("### With the pod's KV indexer\n\nThe feeds and the index in an indexer process; each worker "
            "asks "
            "it before placing (the decision time includes that round trip). Intake CPU is busy minus idle "
            "over the indexer and every worker, the phases in turn (idle, busy, idle, busy, idle), each busy "
            "phase against the idle ones on either side.\n\n" + "\n".join(rows) + "\n\n"
            f"Targets: busy lateness p99 ≤ {INTAKE_LATENESS_P99_MS} ms {met('lateness_p99')}; p50 ≤ "
            f"{INTAKE_LATENESS_P50_MS} ms {met('lateness_p50')}; intake ≤ {INTAKE_CPU_US_PER_BLOCK} µs per "
            f"block {met('cpu_per_block')}; {max(map(int, pod))} workers ≤ {INTAKE_WORKERS_RATIO}x the "
            f"intake CPU of 1 ({f['intake_workers_cpu_ratio']}x) {met('workers_cpu_ratio')}; every published "
            f"block applied, no gaps {met('every_block_applied')}. With the C extensions (block hashes, "
            f"the index's tables, the mirror's translation table; built: {f['native_extensions']}) the pod's "
            "intake costs "
            f"{f['intake_native_vs_pure_ratio']}x its pure-Python cost (`LLMC_PURE_PYTHON=1`), and with "
            "the feeds' wake-ups gathered (`scheduling.prefix.gather_ms`) "
            f"{f['intake_gathered_vs_per_batch_ratio']}x "
            "its cost with a wake-up per batch, and with the feeds read by our own ZMTP reader "
            f"(`scheduling.prefix.reader: zmtp`) {f['intake_own_reader_vs_libzmq_ratio']}x its cost with "
            "libzmq's SUB sockets, and with the index's tables on transparent huge pages "
            f"(`scheduling.prefix.huge_pages`) {f['intake_huge_vs_small_pages_ratio']}x its cost on 4 KiB "
            "pages, all measured in this run. The engines publish out of step, "
            "each at its own phase of the period, as a real fleet does.")


def _plot(f: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right, third) = plt.subplots(1, 3, figsize=(16, 4.2))
    labels = list(f["policies"])
    xs = range(len(labels))
    left.bar([x - 0.2 for x in xs], [f["policies"][k]["p50_ms"] for k in labels], 0.4, label="p50")
    left.bar([x + 0.2 for x in xs], [f["policies"][k]["p99_ms"] for k in labels], 0.4, label="p99")
    left.axhline(f["target_p50_ms"], color="red", linestyle="--", linewidth=1, label="p50 target")
    left.set_xticks(list(xs), [k.replace("_no_index", "\n(no index)") for k in labels], fontsize=8)
    left.set_yscale("log")
    left.set_ylabel("ms per decision (log)")
    left.set_title(f"{f['engines']} engines x {f['blocks_per_engine']} blocks, "
                   f"{f['prompt_tokens']}-token prompts")
    left.legend()
    lengths = [int(x) for x in f["scaling"]]
    for k in labels:
        right.plot(lengths, [f["scaling"][str(n)][k]["p50_ms"] for n in lengths], marker="o", label=k)
    right.axhline(f["target_p50_ms"], color="red", linestyle="--", linewidth=1)
    right.set_xscale("log", base=2)
    right.set_xticks(lengths, [str(n) for n in lengths])
    right.set_xlabel("prompt tokens")
    right.set_yscale("log")
    right.set_ylabel("p50 ms per decision (log)")
    right.set_title("decision time vs prompt length")
    right.legend(fontsize=8)
    it, pod = f["intake"], f["intake_pod"]
    names = ["local\n1 worker", *(f"pod indexer\n{n} worker{'s' * (n != '1')}" for n in pod)]
    lateness = [it["busy_lateness_p99_ms"], *(r["busy_lateness_p99_ms"] for r in pod.values())]
    cpu = [it["intake_cpu_us_per_block"], *(r["intake_cpu_us_per_block"] for r in pod.values())]
    xs3 = range(len(names))
    third.bar([x - 0.2 for x in xs3], lateness, 0.4, label="busy lateness p99 (ms)")
    third.bar([x + 0.2 for x in xs3], cpu, 0.4, label="intake CPU µs per block")
    third.axhline(INTAKE_LATENESS_P99_MS, color="red", linestyle="--", linewidth=1, label="lateness target")
    third.axhline(INTAKE_CPU_US_PER_BLOCK, color="purple", linestyle=":", linewidth=1, label="CPU target")
    third.set_yscale("log")
    third.set_xticks(list(xs3), names, fontsize=8)
    third.set_title(f"KV-event intake, {it['engines']} engines")
    third.legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
