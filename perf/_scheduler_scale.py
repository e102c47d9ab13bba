"""perf.scheduler_latency at agent scale: hundreds of engines, 100k-token prompts, KV events from all.

Two measurements, each with its baseline in the same run:

* ``agent_scale``: affinity decisions on 100k-token prompts over a full approximate index of
  hundreds of engines, split into hash / match / the rest (scorers, picker, metrics) and learning
  (applied after the decision, as the app does), beside round-robin without an index. The decision
  is timed with the prompt's hashes from render (what our sidecar sends) and with the coordinator
  hashing them itself (vLLM's own render server, the local-tokenizer fallback).
* ``kv_intake``: the precise source fed by hundreds of engines' KV events over real ZMQ (a child
  process publishes vLLM's wire format on one PUB socket per engine) while decisions run on the
  event loop; decision time and lateness (start - intended start) with the publishers idle and busy.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import httpx
import msgspec
import numpy as np

from coordinator.config import EngineSettings, PrefixIndexSettings, SchedulingSettings, Settings
from coordinator.contracts.hashing import block_hashes, chain_seed
from coordinator.observability.metrics import Metrics
from coordinator.pipeline.admission.budget import TokenLedger
from coordinator.pipeline.engines.registry import EngineRegistry
from coordinator.pipeline.scheduling.prefix.index import PrefixIndex
from coordinator.pipeline.scheduling.prefix.remote import RemoteIndex
from coordinator.pipeline.scheduling.prefix.source import PreciseIndexSource
from coordinator.pipeline.scheduling.request import SchedRequest
from coordinator.pipeline.scheduling.scheduler import Scheduler, build_profile
from perf._report import pct

MODEL = "smollm2-135m-instruct"
BLOCK = PrefixIndexSettings().block_size
Say = Callable[[str], None]


def stats_ms(samples_s: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in samples_s]
    return {"p50_ms": round(pct(ms, 50), 4), "p90_ms": round(pct(ms, 90), 4), "p99_ms": round(pct(ms, 99), 4),
            "mean_ms": round(statistics.fmean(ms), 4), "n": len(ms)}


def bench_scheduler(n_engines: int, policy: str, index: PrefixIndex | None, http: httpx.AsyncClient,
                    seed: int, pending: PrefixIndex | None = None,
                    remote: RemoteIndex | None = None) -> Scheduler:
    """The production wiring (registry from ``Settings``, ``build_profile``, metrics) over
    ``n_engines`` with static, seeded loads. ``index`` alone: the approximate source, learning;
    with ``pending``: the precise one. As in the app, what a decision teaches the index is applied
    after it; the caller does it with ``flush_learning`` (and times it apart)."""
    os.environ.pop("COORD_CONFIG", None)
    settings = Settings(engines=[EngineSettings(url=f"http://engine-{i}:8000") for i in range(n_engines)],
                        scheduling=SchedulingSettings(policy=policy))  # type: ignore[arg-type]
    registry = EngineRegistry(settings, http)
    loads = np.random.default_rng(seed + 1)
    for e in registry.engines:   # static load so the load scorer has something to compare
        e.inflight_tokens = int(loads.uniform(0, 0.6) * e.token_budget)
        e.inflight_requests = max(1, e.inflight_tokens // 2500)
    profile = build_profile(settings.scheduling, TokenLedger(None).engine_room)
    return Scheduler(registry, profile, index=index, block_size=BLOCK,
                     learn=index is not None and pending is None, topology=settings.topology,
                     metrics=Metrics(), pending=pending, defer=lambda work: None, remote=remote)


def agent_scale(workload_cls: Any, *, engines: int, capacity: int, tokens: int, decisions: int, chunk: int,
                seed: int, say: Say) -> dict[str, Any]:
    """Affinity vs round-robin at ``tokens``-token prompts over ``engines`` x ``capacity`` blocks."""
    urls = [f"http://engine-{i}:8000" for i in range(engines)]
    wl = workload_cls(seed, n_systems=16, system_tokens=(2000, 8001), pool_max=256)
    index = PrefixIndex(capacity_blocks=capacity, ttl_s=PrefixIndexSettings().ttl_s)
    hseed = chain_seed(MODEL)
    say(f"agent scale: filling {engines} engines x {capacity} blocks with {tokens}-token conversations")
    t0 = time.perf_counter()
    for n, url in enumerate(urls):
        while index.blocks(url) < capacity:
            prompt = wl.conversation(tokens)
            index.add(url, block_hashes(prompt.tolist(), BLOCK, hseed))
            wl.remember(prompt)
        if n % max(1, engines // 8) == 0:
            say(f"  {n + 1}/{engines} engines filled ({time.perf_counter() - t0:.0f}s)")
    http = httpx.AsyncClient()
    aff = bench_scheduler(engines, "affinity", index, http, seed)
    rr = bench_scheduler(engines, "round_robin", None, http, seed)
    names = ("decision", "decision_cpu", "hash", "decision_self_hashed", "match", "rest", "learn", "rr",
             "rr_cpu")
    parts: dict[str, list[float]] = {k: [] for k in names}
    matched: list[int] = []
    say(f"agent scale: {decisions} decisions per policy at {tokens} prompt tokens, interleaved")
    done = 0
    wall, cpu = time.perf_counter_ns, time.thread_time_ns  # CPU: what preemption does not inflate
    while done < decisions:
        n = min(chunk, decisions - done)
        for _ in range(n):
            prompt = wl.next(tokens)
            req = SchedRequest("a", MODEL, prompt, 256)
            a = wall()
            req.block_hashes = block_hashes(prompt, BLOCK, hseed)
            b, cb = wall(), cpu()
            placed = aff.place(req)
            c, cc = wall(), cpu()
            aff.flush_learning()
            d = wall()
            m0 = wall()
            aff.memory.lookup(req.block_hashes)   # the match alone, timed apart (read-only)
            m1 = wall()
            assert placed is not None
            matched.append(placed.matched_tokens)
            parts["hash"].append((b - a) / 1e9)
            parts["decision"].append((c - b) / 1e9)            # hashes from render (our sidecar)
            parts["decision_cpu"].append((cc - cb) / 1e9)
            parts["decision_self_hashed"].append((c - a) / 1e9)  # the coordinator hashes them itself
            parts["match"].append((m1 - m0) / 1e9)
            parts["rest"].append(max(0.0, (c - b - (m1 - m0)) / 1e9))
            parts["learn"].append((d - c) / 1e9)
        for _ in range(n):
            req = SchedRequest("r", MODEL, wl.next(tokens), 256)
            a, ca = wall(), cpu()
            assert rr.place(req) is not None
            parts["rr_cpu"].append((cpu() - ca) / 1e9)
            parts["rr"].append((wall() - a) / 1e9)
        done += n
        say(f"  {done}/{decisions}")
    asyncio.run(http.aclose())
    stats = {k: stats_ms(v) for k, v in parts.items()}
    blocks = [index.blocks(u) for u in urls]
    return {"engines": engines, "capacity_blocks": capacity, "prompt_tokens": tokens, "decisions": decisions,
            "parts": stats, "hit_share": round(sum(1 for m in matched if m > 0) / len(matched), 3),
            "matched_tokens_mean": round(float(np.mean(matched)), 1),
            "index_blocks": {"min": min(blocks), "max": max(blocks), "total": sum(blocks)},
            "index_bytes": index.approx_bytes(),
            "bytes_per_block": round(index.approx_bytes() / max(1, sum(blocks)), 1),
            "decision_vs_rr_p50_ratio": round(stats["decision"]["p50_ms"] / stats["rr"]["p50_ms"], 2)}


# --- KV-event intake ------------------------------------------------------------------------------

def _publish(n_engines: int, batches_per_s: float, blocks_per_batch: int, keep_blocks: int,
             conn: Connection) -> None:
    """Child process: one PUB socket per engine, vLLM's ``[topic, seq, KVEventBatch]`` messages; each
    engine keeps prefilling a conversation (BlockStored runs continuing its chain) and evicts its
    oldest blocks past ``keep_blocks`` (BlockRemoved), at ``batches_per_s`` batches per engine.
    Commands: ``go``, ``pause``, ``stop``, and ``fill``: as fast as it can, every engine's blocks up to
    ``keep_blocks`` (no eviction yet), so that the measured phases are the steady state, where each
    batch's stored blocks are matched by as many removals."""
    import zmq

    from coordinator.contracts.kv_events import BlockRemoved, BlockStored, KVEventBatch

    ctx = zmq.Context()
    socks, endpoints = [], []
    for _ in range(n_engines):
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.SNDHWM, 100_000)
        port = s.bind_to_random_port("tcp://127.0.0.1")
        socks.append(s)
        endpoints.append(f"tcp://127.0.0.1:{port}")
    conn.send(endpoints)
    enc = msgspec.msgpack.Encoder()
    rng = np.random.default_rng(1)
    seqs = [0] * n_engines
    parents: list[bytes | int | None] = [None] * n_engines
    held: list[list[bytes | int]] = [[] for _ in range(n_engines)]
    next_hash = [1 + i * 10**12 for i in range(n_engines)]
    publishing, sent_blocks = False, 0
    period = 1.0 / batches_per_s

    def publish(i: int, evict: bool) -> None:
        nonlocal sent_blocks
        s = socks[i]
        tokens = rng.integers(100, 49_000, size=blocks_per_batch * BLOCK).tolist()
        hashes: list[bytes | int] = list(range(next_hash[i], next_hash[i] + blocks_per_batch))
        next_hash[i] += blocks_per_batch
        # vLLM's shapes (BlockPool): a run's extra keys one per block (None without salt, LoRA or
        # media), its KV cache group; an eviction one event per block.
        events: list[Any] = [BlockStored(
            block_hashes=hashes, parent_block_hash=parents[i], token_ids=tokens, block_size=BLOCK,
            lora_id=None, medium="GPU", lora_name=None, extra_keys=[None] * len(hashes), group_idx=0)]
        parents[i] = hashes[-1]
        held[i] += hashes
        if evict and len(held[i]) > keep_blocks:
            gone, held[i] = held[i][:blocks_per_batch], held[i][blocks_per_batch:]
            events += [BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0) for h in gone]
        if rng.random() < 0.02:   # a new conversation now and then: a root run
            parents[i] = None
        payload = enc.encode(KVEventBatch(ts=time.time(), events=events))
        s.send_multipart([b"", seqs[i].to_bytes(8, "big"), payload])
        seqs[i] += 1
        sent_blocks += blocks_per_batch

    # Engines are not in step: each publishes at its own phase of the period, so batches arrive spread
    # over it (as from a real fleet) rather than all 256 at once, which would let one wake-up of the
    # subscriber serve them all.
    step = period / n_engines
    due, turn = time.perf_counter(), 0
    while True:
        if conn.poll(0 if publishing else 0.05):
            cmd = conn.recv()
            if cmd == "stop":
                conn.send(sent_blocks)
                break
            if cmd == "fill":   # every engine's cache full, at once: from here on each batch evicts
                while len(held[0]) + blocks_per_batch <= keep_blocks:
                    for i in range(n_engines):
                        publish(i, evict=False)
            publishing = cmd == "go"
            conn.send(sent_blocks)
            due = time.perf_counter()
        if not publishing:
            continue
        while due <= time.perf_counter():
            publish(turn, evict=True)
            turn = (turn + 1) % n_engines
            due += step
        time.sleep(max(0.0, due - time.perf_counter()))
    for s in socks:
        s.close(linger=0)
    ctx.term()


async def timed_decisions(sched: Scheduler, prompts: list[list[int]], hashed: list[list[int]],
                          interval_s: float, label: str) -> tuple[list[float], list[float]]:
    """One decision per prompt, each ``interval_s`` after the last one ended: its time (with the pod
    indexer's round trip when the scheduler asks one, ``prefetch``) and its lateness, how long it
    waited for the event loop once due (the intake's batches, the previous decision's learning)."""
    loop = asyncio.get_running_loop()
    took: list[float] = []
    late: list[float] = []
    for k, prompt in enumerate(prompts):
        due = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        began = loop.time()
        req = SchedRequest(f"{label}-{k}", MODEL, prompt, 256, block_hashes=hashed[k])
        t0 = time.perf_counter()
        await sched.prefetch(req)
        assert sched.place(req) is not None
        took.append(time.perf_counter() - t0)
        late.append(max(0.0, began - due))
        loop.call_soon(sched.flush_learning)
    return took, late


def kv_intake(workload_cls: Any, *, engines: int, tokens: int, decisions: int, interval_s: float,
              batches_per_s: float, blocks_per_batch: int, seed: int, say: Say) -> dict[str, Any]:
    """Decisions on the event loop while ``engines`` publishers stream KV events into the index."""
    assert decisions > 0
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=_publish, args=(engines, batches_per_s, blocks_per_batch, 4096, child), daemon=True)
    proc.start()
    endpoints: list[str] = parent.recv()
    try:
        return asyncio.run(_intake_run(workload_cls, endpoints, parent, tokens, decisions, interval_s,
                                       batches_per_s, blocks_per_batch, seed, say))
    finally:
        if proc.is_alive():
            parent.send("stop")
            parent.recv()
        proc.join(10)


async def _intake_run(workload_cls: Any, endpoints: list[str], control: Connection, tokens: int,
                      decisions: int, interval_s: float, batches_per_s: float, blocks_per_batch: int,
                      seed: int, say: Say) -> dict[str, Any]:
    engines = len(endpoints)
    http = httpx.AsyncClient()
    index = PrefixIndex(capacity_blocks=PrefixIndexSettings().capacity_blocks)
    pending = PrefixIndex(ttl_s=PrefixIndexSettings().pending_ttl_s)
    sched = bench_scheduler(engines, "affinity", index, http, seed, pending=pending)
    source = PreciseIndexSource(index, lambda url: MODEL, BLOCK,
                                gather_s=PrefixIndexSettings().gather_ms / 1000)
    for i, ep in enumerate(endpoints):
        await source.attach(f"http://engine-{i}:8000", ep)
    await asyncio.sleep(1.0)  # ZMQ subscriptions settle before anything is published
    wl = workload_cls(seed, n_systems=16, system_tokens=(2000, 8001), pool_max=64)
    hseed = chain_seed(MODEL)
    loop = asyncio.get_running_loop()

    def stored() -> int:
        return sum(s.mirror.stats.blocks_stored for s in source.subscribers.values())

    # Made before, with their hashes (render sends them): not on the loop's clock. Every phase replays
    # the same prompts, after an unmeasured first round that opens their conversations: fresh slices
    # of the workload cost differently (how many prompts open conversations, how long the chains
    # are), and busy is set against idle.
    prompts = [wl.next(tokens) for _ in range(decisions)]
    hashed = [block_hashes(p, BLOCK, hseed) for p in prompts]

    async def phase(label: str) -> dict[str, Any]:
        first, start, cpu0 = stored(), loop.time(), time.process_time()
        took, late = await timed_decisions(sched, prompts, hashed, interval_s, label)
        elapsed = loop.time() - start
        cpu = (time.process_time() - cpu0) / elapsed   # share of a core this process used
        applied = stored() - first
        say(f"  {label}: decision p50 {stats_ms(took)['p50_ms']:.3f} ms, lateness p99 "
            f"{stats_ms(late)['p99_ms']:.2f} ms, {applied / elapsed:,.0f} blocks/s applied")
        return {"decision": stats_ms(took), "lateness": stats_ms(late), "cpu_share": round(cpu, 3),
                "blocks_applied_per_s": round(applied / elapsed)}

    say(f"kv intake: {engines} engines over ZMQ, {decisions} decisions at {tokens} tokens every "
        f"{interval_s * 1000:.0f} ms, publishers idle then busy (each engine's cache full first)")
    control.send("fill")
    filled = control.recv()
    for _ in range(1500):   # at most 5 minutes: a lost batch shows as a gap below, not a hang
        if stored() >= filled:
            break
        await asyncio.sleep(0.2)
    say(f"  filled: {filled:,} blocks applied")
    await phase("warm-up")
    idle = await phase("idle")
    control.send("go")
    sent0 = control.recv()
    await asyncio.sleep(1.0)   # reach a steady state
    busy = await phase("busy")
    control.send("pause")
    sent1 = control.recv()
    await asyncio.sleep(0.5)
    gaps = sum(s.gaps for s in source.subscribers.values())
    missed = sum(s.missed for s in source.subscribers.values())
    await source.stop_all()
    await http.aclose()
    offered = engines * batches_per_s * blocks_per_batch
    return {"engines": engines, "prompt_tokens": tokens, "decisions": decisions,
            "interval_ms": interval_s * 1000,
            "offered_blocks_per_s": round(offered), "published_blocks": sent1 - sent0,
            "idle": idle, "busy": busy, "gaps": gaps, "missed_batches": missed,
            "busy_vs_idle_decision_p50": round(busy["decision"]["p50_ms"] / idle["decision"]["p50_ms"], 2),
            "busy_lateness_p99_ms": busy["lateness"]["p99_ms"],
            "intake_cpu_us_per_block": round((busy["cpu_share"] - idle["cpu_share"]) * 1e6
                                             / max(1, busy["blocks_applied_per_s"]), 2)}
