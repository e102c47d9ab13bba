"""perf.scheduler_latency's intake section with the pod's KV indexer (``scheduling.prefix.indexer: pod``).

The same workload as ``_scheduler_scale.kv_intake`` (a child process publishes vLLM's wire format on one
PUB socket per engine), but the KV-event feeds and the index live in an indexer process, and 1 or N
worker processes make the decisions: each asks the indexer before placing (``Scheduler.prefetch``),
as the app does. A decision's time includes that round trip; its lateness is how long a due decision
waited for its worker's event loop. The intake's CPU is counted over every process of the pod (the
indexer and each worker, busy minus idle), per block the indexer applied.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import socket
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import psutil

from coordinator.config import FeedReader, PrefixIndexSettings, SchedulingSettings, Settings
from coordinator.contracts.hashing import block_hashes, chain_seed
from coordinator.contracts.indexer import HEAD_SIZE, Stats, Status, decode_reply, frame, frame_size
from coordinator.pipeline.scheduling.prefix.remote import RemoteIndex
from perf._scheduler_scale import BLOCK, MODEL, Say, _publish, bench_scheduler, stats_ms, timed_decisions

_DEFAULTS = PrefixIndexSettings()


def _indexer(address: str, conn: Connection, prefix: PrefixIndexSettings) -> None:
    """Child: the pod's indexer process under ``prefix`` (the precise source)."""
    from coordinator.indexer.process import serve

    os.environ.pop("COORD_CONFIG", None)
    settings = Settings(scheduling=SchedulingSettings(prefix=prefix))
    asyncio.run(serve(settings, [address], started=conn.send))


def status(address: str) -> Stats:
    """The indexer's ``Stats``, asked on a plain blocking socket (the orchestrator has no event loop)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(address.removeprefix("unix:"))
        s.sendall(frame(Status(1)))
        head = _read(s, HEAD_SIZE)
        reply = decode_reply(_read(s, frame_size(head)))
    assert isinstance(reply, Stats)
    return reply


def _read(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("the indexer closed the connection")
        out += chunk
    return out


def _worker(address: str, endpoints: list[str], conn: Connection, workload_cls: Any, tokens: int,
            decisions: int, interval_s: float, seed: int) -> None:
    """Child: one coordinator worker's decisions against the indexer, one phase per command."""
    asyncio.run(_worker_run(address, endpoints, conn, workload_cls, tokens, decisions, interval_s, seed))


async def _worker_run(address: str, endpoints: list[str], conn: Connection, workload_cls: Any, tokens: int,
                      decisions: int, interval_s: float, seed: int) -> None:
    up = asyncio.Event()
    remote = RemoteIndex(address, timeout_s=PrefixIndexSettings().indexer.timeout_s,
                         on_change=lambda now_up: up.set() if now_up else None)
    remote.start()
    await up.wait()
    http = httpx.AsyncClient()
    sched = bench_scheduler(len(endpoints), "affinity", None, http, seed, remote=remote)
    for i, endpoint in enumerate(endpoints):  # every worker sends the feeds, as the app's do
        remote.attach(f"http://engine-{i}:8000", endpoint, MODEL, None)
    wl = workload_cls(seed, n_systems=16, system_tokens=(2000, 8001), pool_max=64)
    hseed = chain_seed(MODEL)
    conn.send("ready")
    prompts: list[list[int]] = []
    hashed: list[list[int]] = []
    while True:
        command = await asyncio.to_thread(conn.recv)   # "prepare" or "stop"
        if command == "stop":
            break
        # The prompts are made and hashed before the first phase is measured ("prepare"), and every
        # phase replays them: a phase is set against its neighbours, and with a fresh slice of the
        # workload each, one slice's decisions cost a third more than another's at 4 workers (how
        # many of its prompts open conversations, how long its chains are), as much as the intake.
        if not prompts:
            prompts = [wl.next(tokens) for _ in range(decisions)]
            hashed = [block_hashes(p, BLOCK, hseed) for p in prompts]
        conn.send("prepared")
        label = await asyncio.to_thread(conn.recv)
        unanswered = remote.unanswered
        took, late = await timed_decisions(sched, prompts, hashed, interval_s, label)
        conn.send({"took": took, "late": late, "unanswered": remote.unanswered - unanswered})
    await remote.aclose()
    await http.aclose()


def kv_intake_pod(workload_cls: Any, *, engines: int, tokens: int, decisions: int, interval_s: float,
                  batches_per_s: float, blocks_per_batch: int, seed: int, workers: int,
                  say: Say, pure_python: bool = False, rounds: int = 2,
                  gather_ms: float = _DEFAULTS.gather_ms, reader: FeedReader = _DEFAULTS.reader,
                  huge_pages: bool = _DEFAULTS.huge_pages) -> dict[str, Any]:
    """Decisions of ``workers`` processes while ``engines`` publishers stream KV events into the pod's
    indexer; idle and busy in turn, ``rounds`` busy phases of ``decisions / rounds`` decisions each.
    ``pure_python``: the pod's processes run without the C extensions (``LLMC_PURE_PYTHON=1``, the
    baseline). ``gather_ms``, ``reader``, ``huge_pages``: the indexer's ``scheduling.prefix`` settings of
    those names."""
    if pure_python:
        os.environ["LLMC_PURE_PYTHON"] = "1"     # spawned children read it when they import
    try:
        prefix = PrefixIndexSettings(source="precise", gather_ms=gather_ms, reader=reader,
                                     huge_pages=huge_pages)
        return _kv_intake_pod(workload_cls, engines=engines, tokens=tokens, decisions=decisions,
                              interval_s=interval_s, batches_per_s=batches_per_s,
                              blocks_per_batch=blocks_per_batch, seed=seed, workers=workers, say=say,
                              rounds=rounds, prefix=prefix)
    finally:
        os.environ.pop("LLMC_PURE_PYTHON", None)


def _kv_intake_pod(workload_cls: Any, *, engines: int, tokens: int, decisions: int, interval_s: float,
                   batches_per_s: float, blocks_per_batch: int, seed: int, workers: int,
                   say: Say, rounds: int, prefix: PrefixIndexSettings) -> dict[str, Any]:
    decisions = max(10, decisions // rounds)   # per phase
    ctx = mp.get_context("spawn")
    folder = tempfile.mkdtemp(prefix="indexer-bench-")
    address = f"unix:{Path(folder) / 'indexer.sock'}"
    pub_parent, pub_child = ctx.Pipe()
    publisher = ctx.Process(target=_publish, args=(engines, batches_per_s, blocks_per_batch, 4096, pub_child),
                            daemon=True)
    publisher.start()
    endpoints: list[str] = pub_parent.recv()
    ix_parent, ix_child = ctx.Pipe()
    indexer = ctx.Process(target=_indexer, args=(address, ix_child, prefix), daemon=True)
    indexer.start()
    ix_parent.recv()
    links, procs = [], []
    for _ in range(workers):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(address, endpoints, child, workload_cls, tokens, decisions,
                                                 interval_s, seed), daemon=True)
        proc.start()
        links.append(parent)
        procs.append(proc)
    try:
        for link in links:
            assert link.recv() == "ready"
        time.sleep(1.0)   # ZMQ subscriptions settle before anything is published
        pod = [psutil.Process(indexer.pid), *(psutil.Process(p.pid) for p in procs)]

        def cpu() -> list[float]:
            """Each process's CPU seconds: the indexer's first."""
            return [sum(p.cpu_times()[:2]) for p in pod]

        def phase(label: str) -> dict[str, Any]:
            for link in links:
                link.send("prepare")
            for link in links:
                assert link.recv() == "prepared"
            first, cpu0, t0 = status(address).blocks_stored, cpu(), time.perf_counter()
            for link in links:
                link.send(label)
            results = [link.recv() for link in links]
            elapsed = time.perf_counter() - t0
            used = [after - before for after, before in zip(cpu(), cpu0, strict=True)]
            return {"took": [t for r in results for t in r["took"]],
                    "late": [t for r in results for t in r["late"]], "elapsed": elapsed,
                    "cpu_share": sum(used) / elapsed, "indexer_cpu_share": used[0] / elapsed,
                    "applied": status(address).blocks_stored - first,
                    "unanswered": sum(r["unanswered"] for r in results)}

        def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
            elapsed = float(sum(r["elapsed"] for r in runs))

            def share(key: str) -> float:
                return round(float(sum(r[key] * r["elapsed"] for r in runs)) / elapsed, 3)

            return {"decision": stats_ms([t for r in runs for t in r["took"]]),
                    "lateness": stats_ms([t for r in runs for t in r["late"]]),
                    "cpu_share": share("cpu_share"), "indexer_cpu_share": share("indexer_cpu_share"),
                    "blocks_applied_per_s": round(sum(r["applied"] for r in runs) / elapsed),
                    "unanswered": sum(r["unanswered"] for r in runs)}

        def publishers(cmd: str) -> int:
            pub_parent.send(cmd)
            sent: int = pub_parent.recv()
            time.sleep(1.0)   # "go": reach a steady state; "pause": let the indexer drain what is queued
            return sent

        say(f"kv intake, pod indexer{' (pure Python)' * (os.environ.get('LLMC_PURE_PYTHON') == '1')}: "
            f"{engines} engines over ZMQ, {workers} worker(s) x {decisions} "
            f"decisions at {tokens} tokens every {interval_s * 1000:.0f} ms per phase, publishers idle and "
            f"busy in turn ({rounds} busy phases, each between two idle ones), feeds gathered every "
            f"{prefix.gather_ms:g} ms, read by {prefix.reader}, tables on "
            f"{'huge' if prefix.huge_pages else '4 KiB'} pages")
        # Every engine's cache full first, so that each measured batch evicts as much as it stores.
        pub_parent.send("fill")
        published = pub_parent.recv()
        until = time.monotonic() + 300
        while status(address).blocks_stored < published and time.monotonic() < until:
            time.sleep(0.2)
        say(f"  filled: {published:,} blocks applied")
        # Then one unmeasured busy spell: the first evictions grow every engine's translation table
        # once (a rehash and its fresh pages, ~0.2 s of CPU for 256 engines), a cost of the fleet's
        # first minute, not of each block; counted in the first busy phase it read as +0.2 us a block.
        cpu0 = sum(cpu())
        sent0 = publishers("go")
        published += publishers("pause") - sent0
        say(f"  warm-up: the first evictions took {sum(cpu()) - cpu0:.2f} s of the pod's CPU")
        # And one unmeasured idle phase of decisions: the first time round, the prompts open their
        # conversations, whose lessons index whole new chains.
        phase("warm-up")
        # Idle and busy phases in turn, each busy phase set against the mean of the idle phases on either
        # side: the processes' own CPU drifts from one phase to the next, and a drift that is steady
        # over the run cancels out this way.
        idles, busies = [phase("idle")], []
        for _ in range(rounds):
            sent0 = publishers("go")
            busies.append(phase("busy"))
            published += publishers("pause") - sent0
            idles.append(phase("idle"))
        intake = [b["cpu_share"] - (i0["cpu_share"] + i1["cpu_share"]) / 2
                  for b, i0, i1 in zip(busies, idles, idles[1:], strict=False)]
        own = [b["indexer_cpu_share"] - (i0["indexer_cpu_share"] + i1["indexer_cpu_share"]) / 2
               for b, i0, i1 in zip(busies, idles, idles[1:], strict=False)]
        idle, busy = pooled(idles), pooled(busies)
        for label, r in (("idle", idle), ("busy", busy)):
            say(f"  {label} ({workers} worker{'s' * (workers > 1)}, indexer process): decision p50 "
                f"{r['decision']['p50_ms']:.3f} ms, lateness p99 {r['lateness']['p99_ms']:.2f} ms, "
                f"{r['blocks_applied_per_s']:,} blocks/s applied, {r['cpu_share']:.2f} cores")
        rate = max(1, busy["blocks_applied_per_s"])
        final = status(address)
        offered = engines * batches_per_s * blocks_per_batch
        return {"engines": engines, "workers": workers, "gather_ms": prefix.gather_ms,
                "reader": prefix.reader, "huge_pages": prefix.huge_pages,
                "prompt_tokens": tokens,
                "decisions": decisions,
                "interval_ms": interval_s * 1000, "offered_blocks_per_s": round(offered),
                "published_blocks": published, "idle": idle, "busy": busy, "gaps": final.gaps,
                "applied_blocks": final.blocks_stored,
                "phases": [{"label": label, "cpu_share": round(r["cpu_share"], 3),
                            "indexer_cpu_share": round(r["indexer_cpu_share"], 3),
                            "blocks_applied_per_s": round(r["applied"] / r["elapsed"])}
                           for label, r in [("idle", idles[0]),
                                            *(x for b, i in zip(busies, idles[1:], strict=True)
                                              for x in (("busy", b), ("idle", i)))]],
                "busy_vs_idle_decision_p50": round(busy["decision"]["p50_ms"]
                                                   / idle["decision"]["p50_ms"], 2),
                "busy_lateness_p99_ms": busy["lateness"]["p99_ms"],
                "busy_lateness_p50_ms": busy["lateness"]["p50_ms"],
                "intake_cpu_us_per_block": round(statistics.fmean(intake) * 1e6 / rate, 2),
                "intake_cpu_share": round(statistics.fmean(intake), 3),
                # the same, the indexer process alone (the rest: the workers' decisions slowed by it)
                "indexer_cpu_us_per_block": round(statistics.fmean(own) * 1e6 / rate, 2)}
    finally:
        for link in links:
            link.send("stop")
        for proc in procs:
            proc.join(10)
        if publisher.is_alive():
            pub_parent.send("stop")
            pub_parent.recv()
        publisher.join(10)
        if indexer.pid is not None and indexer.is_alive():
            os.kill(indexer.pid, signal.SIGTERM)
        indexer.join(10)
