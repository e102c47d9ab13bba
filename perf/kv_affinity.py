"""Does KV-cache affinity pay off? Prefix-cache hits and TTFT per routing policy on a shared-prefix chat load.

Workload (same seed → same token ids for every policy): ``--tenants`` system prompts of about
``--system-tokens`` tokens each; ``--users`` users, user ``u`` bound to tenant ``u % tenants``; every
turn appends ``--turn-tokens`` (min-max) new tokens to the user's conversation (the previous answer
plus the next question) and sends system prompt + whole conversation as a completions request
whose ``prompt`` is a list of token ids (render passes them through, so the workload controls the
ids exactly). Open loop on a fixed, seeded schedule: users start over ``--ramp-s`` and send a turn
every ``--think-s`` on average (uniform 0.5-1.5x); never more than ``--concurrency`` in flight, and a
turn never leaves before the answer to the previous one. (A closed loop, ``--closed-loop``, saturates
a 2-core machine: the harness's own CPU then dominates TTFT and flatters the slow policies.)

Engines: 4 simulated engines whose prefix cache is an LRU of ``--capacity-blocks`` 16-token blocks and
whose prefill time grows with uncached prompt tokens (``docs/simulator.md``, cost model), behind the
real coordinator (real render sidecar). One fresh coordinator and fresh engines per policy:
round-robin, least-load, affinity with the approximate and the precise (KV events) prefix index,
and a greedy "oracle" router that reads the simulators' caches. The engines run in a child process
(as in ``perf.overload``): sharing the coordinator's interpreter and GIL with four engine servers and
the client measured the harness, not the routing. The oracle asks that process over a pipe.

Reported per policy: the engines' own prefix-cache ``hit_rate`` (hit tokens / queried tokens),
client-side TTFT p50/p90 (first streamed chunk) and ``load_imbalance`` (max/mean requests per engine).
The oracle is *not* an upper bound (it is greedy: longest cached prefix now, blind to what its choice
evicts later); the true ceiling of the workload is computed from the schedule: every distinct block
computed once, an unlimited cache (``ceiling_hit_rate``, in blocks and in tokens).
``affinity_unbounded`` (opt-in) is the affinity scores with a plain max-score picker, to show what the
preset's bounded-load picker changes. ``affinity_workers`` runs the coordinator as a pod of
``POD_WORKERS`` worker processes (``python -m coordinator``) with the approximate index in the pod's KV
indexer, which every worker asks and teaches; ``affinity_workers_local`` is the same pod with an index
per worker (``scheduling.prefix.indexer.mode: local``), each learning only the requests it routed.

    python -m perf.kv_affinity [--users 32] [--turns 8] [--think-s 1.6] [--concurrency 16] [--seed 0]
        [--policies round_robin,...,oracle[,affinity_unbounded]] [--quick] [--render-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import httpx

from coordinator.config import (
    EngineSettings,
    ModelSettings,
    PrefixIndexSettings,
    RenderSettings,
    SchedulingSettings,
    Settings,
)
from coordinator.embedded import EmbeddedCoordinator
from coordinator.pipeline.scheduling.pickers import MaxScorePicker
from coordinator.pipeline.scheduling.types import E, EngineView, ScoringInput
from perf._procs import render_sidecar
from perf._report import Progress, final_json, save_figure, summary_ms, write_report
from token_engine.simulator import PrefixCache, SimConfig, SimulatedEngine
from token_engine.simulator.prefix_cache import block_hashes as sim_block_hashes

SERVED = "smollm2-135m-instruct"
ENGINES = 4
BLOCK_SIZE = 16
TOKEN_LO, TOKEN_HI = 17, 49152  # SmolLM2's non-special ids: the prompt stays plain token ids
POLICIES = ("round_robin", "least_load", "affinity_approximate", "affinity_precise", "oracle",
            "affinity_workers", "affinity_workers_local")
# Opt-in contrast: affinity scores without the load bound (max-score picker).
EXTRA_POLICIES = ("affinity_unbounded",)
# Last-line key prefix of each affinity variant whose targets are checked ("" = the default preset).
VARIANTS = (("", "affinity_approximate"), ("precise_", "affinity_precise"),
            ("unbounded_", "affinity_unbounded"), ("workers_", "affinity_workers"),
            ("workers_local_", "affinity_workers_local"))
# The pod variants: ``python -m coordinator`` with this many workers (approximate index), the index in
# the pod's indexer process (affinity_workers) or in each worker (affinity_workers_local).
POD_WORKERS = 4
# Targets from the issue, checked on the affinity policies.
TARGET_HIT_VS_ORACLE = 0.9
TARGET_P90_GAIN = 5.0
TARGET_IMBALANCE = 1.25


# --- workload ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    tenants: int
    users: int
    turns: int
    system_tokens: int
    turn_min: int
    turn_max: int
    think_s: float  # mean time between a user's turns (reading the answer, typing the next question)
    ramp_s: float   # users start their conversations uniformly over this window
    seed: int


@dataclass(frozen=True)
class Turn:
    user: int
    turn: int
    at: float  # seconds after the start of the run when the user sends it (open loop)
    prompt: list[int]


def build_schedule(w: Workload) -> list[Turn]:
    """Every request, in order of its send time; a fixed function of the seed.

    Each user starts at a uniform time in ``[0, ramp_s]`` and sends the next turn a uniform
    ``[0.5, 1.5] x think_s`` after the previous one. System prompts vary by ``±system_tokens // 15``
    tokens so their tails do not all end at the same block offset.
    """
    rng = random.Random(w.seed)
    spread = w.system_tokens // 15

    def tokens(n: int) -> list[int]:
        return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]

    systems = [tokens(w.system_tokens + rng.randint(-spread, spread)) for _ in range(w.tenants)]
    out: list[Turn] = []
    for u in range(w.users):
        at = rng.uniform(0, w.ramp_s)
        conv: list[int] = []
        for t in range(w.turns):
            conv = conv + tokens(rng.randint(w.turn_min, w.turn_max))
            out.append(Turn(u, t, round(at, 4), systems[u % w.tenants] + conv))
            at += rng.uniform(0.5, 1.5) * w.think_s
    return sorted(out, key=lambda t: (t.at, t.user))


def context_length(schedule: Sequence[Turn], max_tokens: int) -> int:
    """The engines' and render's ``max_model_len`` for a schedule: its longest prompt and answer, to a
    power of two (2,048 at least)."""
    longest = max(len(t.prompt) for t in schedule) + max_tokens
    return max(2048, 1 << (longest - 1).bit_length())


def working_set_blocks(schedule: Sequence[Turn]) -> int:
    """Distinct full blocks of the final prompts: what one cache would need to hit on everything."""
    last = {t.user: t.prompt for t in schedule}
    return len({h for p in last.values() for h in sim_block_hashes(p, BLOCK_SIZE)})


def ceiling(schedule: Sequence[Turn]) -> dict[str, Any]:
    """The best any router and cache could do: every distinct block computed once (unlimited cache,
    one engine). In blocks: 1 - distinct / sent. In tokens (comparable with the engines' hit rate,
    which counts tokens): only whole blocks can hit, so hits <= (sent - distinct blocks) x block size
    out of every prompt token sent."""
    sent = 0
    tokens = 0
    distinct: set[bytes] = set()
    for t in schedule:
        hashes = sim_block_hashes(t.prompt, BLOCK_SIZE)
        sent += len(hashes)
        tokens += len(t.prompt)
        distinct.update(hashes)
    return {"blocks_sent": sent, "distinct_blocks": len(distinct),
            "hit_rate_blocks": round(1 - len(distinct) / sent, 4) if sent else 0.0,
            "hit_rate_tokens": round((sent - len(distinct)) * BLOCK_SIZE / tokens, 4) if tokens else 0.0}


# --- oracle --------------------------------------------------------------------------------------

class CacheView(Protocol):
    def __contains__(self, block_hash: object) -> bool: ...


class OracleScorer:
    """Share of the prompt that each engine's simulator *really* holds (read from its ``PrefixCache``,
    or asked of the engines' process through a ``RemoteCache``).

    What a perfect prefix index would tell the router: no guessing (approximate) and no event lag
    (precise). Greedy, so not an upper bound on the hit rate (see ``ceiling``). It only reads (``in``),
    so the caches' LRU order is not disturbed.
    """

    name = "oracle"

    def __init__(self, caches: dict[str, CacheView]) -> None:
        self.caches = caches

    def __call__(self, data: ScoringInput, engines: Sequence[EngineView]) -> list[float]:
        hashes = sim_block_hashes(data.req.prompt_token_ids, BLOCK_SIZE, data.req.cache_salt)
        total = max(1, data.req.prompt_tokens)
        return [_cached_blocks(self.caches[e.url], hashes) * BLOCK_SIZE / total for e in engines]


def _cached_blocks(cache: CacheView, hashes: Sequence[bytes]) -> int:
    if isinstance(cache, RemoteCache):
        return cache.leading_blocks(hashes)
    n = 0
    for h in hashes:
        if h not in cache:
            break
        n += 1
    return n


class RemoteCache:
    """One engine's prefix cache in the engines' child process, asked over the shared pipe (one round
    trip per engine and decision; the lock serialises callers)."""

    def __init__(self, conn: Connection, lock: threading.Lock, index: int) -> None:
        self._conn, self._lock, self._index = conn, lock, index

    def __contains__(self, block_hash: object) -> bool:
        return isinstance(block_hash, bytes) and self.leading_blocks([block_hash]) == 1

    def leading_blocks(self, hashes: Sequence[bytes]) -> int:
        with self._lock:
            self._conn.send((self._index, list(hashes)))
            n: int = self._conn.recv()
        return n


def _serve_engines(configs: list[dict[str, Any]], conn: Connection) -> None:
    """Child process: the simulated engines, plus answers to the oracle's cache look-ups."""
    engines = [SimulatedEngine(SimConfig(**c)).start() for c in configs]
    caches: list[PrefixCache] = [e.app.state.sim.engine.prefix_cache for e in engines]
    conn.send([(e.url, e.state()["kv_events"]) for e in engines])
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        index, hashes = msg
        conn.send(_cached_blocks(caches[index], hashes))
    for e in engines:
        e.stop()


@dataclass(frozen=True)
class EngineHandle:
    url: str
    kv_events: dict[str, Any] | None
    cache: RemoteCache


@contextmanager
def engine_process(configs: list[SimConfig]) -> Iterator[list[EngineHandle]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_engines, args=([c.model_dump() for c in configs], child),
                       name="sim-engines", daemon=True)
    proc.start()
    lock = threading.Lock()
    try:
        if not parent.poll(60):
            raise RuntimeError("simulated engines did not start")
        started: list[tuple[str, dict[str, Any] | None]] = parent.recv()
        yield [EngineHandle(url, events, RemoteCache(parent, lock, i))
               for i, (url, events) in enumerate(started)]
    finally:
        with lock:
            parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.terminate()


class LeastLoadTiePicker:
    """Highest score; ties go to the engine with the fewest in-flight tokens, then round-robin."""

    name = "oracle_least_load"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def __call__(self, engines: Sequence[E], scores: Sequence[float], data: ScoringInput) -> E:
        best = max(scores)
        tied = [e for e, s in zip(engines, scores, strict=True) if s >= best - 1e-9]
        least = min(e.inflight_tokens for e in tied)
        calm = [e for e in tied if e.inflight_tokens == least]
        return calm[next(self._turn) % len(calm)]


# --- one policy ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineModel:
    capacity_blocks: int
    slots: int
    prefill_s_per_token: float
    decode_s_per_token: float
    ttft_s: float
    max_model_len: int
    offload_blocks: int = 0   # a CPU offload tier per engine (perf.offload_tiers)

    def sim_config(self, seed: int, kv_events: bool) -> SimConfig:
        return SimConfig(model=SERVED, mode="random", seed=seed, block_size=BLOCK_SIZE,
                         capacity_blocks=self.capacity_blocks, max_concurrency=self.slots,
                         offload_blocks=self.offload_blocks,
                         prefill_s_per_token=self.prefill_s_per_token,
                         decode_s_per_token=self.decode_s_per_token, ttft_s=self.ttft_s,
                         max_model_len=self.max_model_len,
                         kv_events_endpoint="tcp://*:0" if kv_events else None)


@dataclass
class Sample:
    ttft_s: float
    ok: bool
    total_s: float = 0.0  # due → last byte: Little's law turns the sum into mean requests in flight


def _settings(policy: str, render_url: str, sims: Sequence[EngineHandle], max_model_len: int) -> Settings:
    engines = []
    for s in sims:
        events = s.kv_events
        engines.append(EngineSettings(url=s.url, kv_events=events["endpoint"] if events else None))
    preset, source = {
        "round_robin": ("round_robin", "none"),
        "least_load": ("least_load", "none"),
        "affinity_approximate": ("affinity", "approximate"),
        "affinity_precise": ("affinity", "precise"),
        "oracle": ("least_load", "none"),  # scorers and picker replaced below
        "affinity_unbounded": ("affinity", "approximate"),  # picker replaced below
        "affinity_workers": ("affinity", "approximate"),
        "affinity_workers_local": ("affinity", "approximate"),
    }[policy]
    return Settings(render=RenderSettings(url=render_url), engines=engines,
                    models=[ModelSettings(name=SERVED, max_model_len=max_model_len)],
                    scheduling=SchedulingSettings(
                        policy=preset,  # type: ignore[arg-type]
                        prefix=PrefixIndexSettings(source=source,  # type: ignore[arg-type]
                                                   block_size=BLOCK_SIZE)))


def _handshake_kv_events(coord: EmbeddedCoordinator, sims: Sequence[EngineHandle]) -> None:
    """ZMQ slow joiner: reset each (empty) cache until the coordinator has seen its AllBlocksCleared,
    so no event of the measured run is published before the subscription is live."""
    precise = coord.components.precise
    assert precise is not None
    deadline = time.monotonic() + 15
    while True:
        pending = [s for s in sims if precise.subscribers[s.url].mirror.stats.clears == 0]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise RuntimeError("KV event subscriptions did not come up")
        for s in pending:
            httpx.post(f"{s.url}/sim/reset_prefix_cache", timeout=5)
        time.sleep(0.1)


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any], t0: float) -> Sample:
    """TTFT from ``t0`` (when the request was due) to the first streamed chunk with a choice."""
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return Sample(time.perf_counter() - t0, False, time.perf_counter() - t0)
        ttft = 0.0
        async for line in r.aiter_lines():
            if ttft or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:]).get("choices"):
                ttft = time.perf_counter() - t0
    return Sample(ttft, ttft > 0, time.perf_counter() - t0)


async def _drive(url: str, schedule: Sequence[Turn], closed_loop: bool, concurrency: int,
                 max_tokens: int, say: Callable[[str], None]) -> list[Sample]:
    """Send the schedule; a user's turn always waits for the answer to its previous one, as a person would.

    Open loop (default): each request is due at its ``at``, at most ``concurrency`` in flight, and TTFT
    counts from when it was due (waiting for the cap included, so a slow policy is not flattered by
    sending less). Closed loop: ``concurrency`` workers take the requests in schedule order as fast as
    they are answered; TTFT counts from sending.
    """
    done = {(t.user, t.turn): asyncio.Event() for t in schedule}
    samples: list[Sample] = []
    step = max(1, len(schedule) // 4)
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        async def send(t: Turn, due: float | None) -> None:
            if t.turn:
                await done[(t.user, t.turn - 1)].wait()
            t0 = time.perf_counter() if due is None else max(due, time.perf_counter())
            body = {"model": SERVED, "prompt": t.prompt, "max_tokens": max_tokens, "stream": True,
                    "ignore_eos": True}
            async with slots:
                try:
                    samples.append(await _one(client, url, body, t0))
                except httpx.HTTPError:
                    samples.append(Sample(0.0, False))
            done[(t.user, t.turn)].set()
            if len(samples) % step == 0:
                ok = [s.ttft_s for s in samples if s.ok]
                say(f"  {len(samples)}/{len(schedule)} done, TTFT p50 so far "
                    f"{summary_ms(ok)['p50_ms'] if ok else float('nan')} ms")

        slots = asyncio.Semaphore(concurrency)
        if not closed_loop:
            start = time.perf_counter()

            async def timed(t: Turn) -> None:
                await asyncio.sleep(max(0.0, start + t.at - time.perf_counter()))
                await send(t, start + t.at)

            await asyncio.gather(*(timed(t) for t in schedule))
        else:
            todo: Iterator[Turn] = iter(schedule)

            async def worker() -> None:
                for t in todo:  # one shared iterator: workers take requests in schedule order
                    await send(t, None)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples


@contextmanager
def pod_coordinator(policy: str, render_url: str, sims: Sequence[EngineHandle],
                    max_model_len: int) -> Iterator[str]:
    """``python -m coordinator`` with ``POD_WORKERS`` workers on the policy's settings; yields its URL."""
    import re
    import sys
    import tempfile

    import yaml

    from token_engine.process import ManagedProcess

    local = policy == "affinity_workers_local"
    config = {"render": {"url": render_url}, "engines": [{"url": s.url} for s in sims],
              "models": [{"name": SERVED, "max_model_len": max_model_len}],
              "server": {"workers": POD_WORKERS, "host": "127.0.0.1", "log_level": "warning"},
              "scheduling": {"policy": "affinity", "prefix": {
                  "source": "approximate", "block_size": BLOCK_SIZE,
                  "indexer": {"mode": "local" if local else "pod"}}}}
    folder = Path(tempfile.mkdtemp(prefix="kv-affinity-pod-"))
    (folder / "pod.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("COORD_")}
    process = ManagedProcess([sys.executable, "-m", "coordinator", "--config", str(folder / "pod.yaml"),
                              "--port", "0"], env=env, name="pod", log_path=folder / "pod.log", echo=False)
    process.start()
    try:
        line = process.wait_for_line(r"workers on http://127\.0\.0\.1:\d+", timeout=60)
        match = re.search(r":(\d+)\s*$", line or "")
        if match is None:
            raise RuntimeError(f"the pod did not start: {process.tail()}")
        url = f"http://127.0.0.1:{match.group(1)}"
        process.wait_http_ready(f"{url}/ready", timeout=120, interval=0.2)
        yield url
    finally:
        process.stop(timeout=20)


def _scraped(url: str, name: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    values = [s.value for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
              for s in fam.samples if s.name == name]
    return sum(values) / len(values) if values else None


def run_policy(policy: str, render_url: str, schedule: Sequence[Turn], closed_loop: bool,
               model: EngineModel, concurrency: int, max_tokens: int,
               say: Callable[[str], None]) -> dict[str, Any]:
    if policy.startswith("affinity_workers"):
        with engine_process([model.sim_config(i, False) for i in range(ENGINES)]) as sims, \
                pod_coordinator(policy, render_url, sims, model.max_model_len) as url:
            t0 = time.monotonic()
            samples = asyncio.run(_drive(f"{url}/v1/completions", schedule, closed_loop, concurrency,
                                         max_tokens, say))
            wall = time.monotonic() - t0
            states = [httpx.get(f"{s.url}/sim/state", timeout=10).json() for s in sims]
            index_hit = _scraped(url, "coordinator_prefix_hit_ratio")
        return _figures(policy, schedule, samples, states, index_hit, wall)
    with engine_process([model.sim_config(i, policy == "affinity_precise") for i in range(ENGINES)]) as sims:

        def prepare(coord: EmbeddedCoordinator) -> None:
            if policy == "oracle":
                profile = coord.components.scheduler.profile
                caches: dict[str, CacheView] = {s.url: s.cache for s in sims}
                profile.scorers = [(OracleScorer(caches), 1.0)]
                profile.picker = LeastLoadTiePicker()
                profile.policy = "oracle"
            elif policy == "affinity_unbounded":
                coord.components.scheduler.profile.picker = MaxScorePicker()

        run = drive_embedded(_settings(policy, render_url, sims, model.max_model_len), sims, schedule,
                             closed_loop, concurrency, max_tokens, say, precise=policy == "affinity_precise",
                             prepare=prepare)
    return _figures(policy, schedule, run.samples, run.states, run.index_hit, run.wall)


@dataclass
class EmbeddedRun:
    samples: list[Sample]
    states: list[dict[str, Any]]   # each engine's /sim/state after the run
    wall: float
    index_hit: float | None        # the coordinator's own prefix hit ratio


def drive_embedded(settings: Settings, sims: Sequence[EngineHandle], schedule: Sequence[Turn],
                   closed_loop: bool, concurrency: int, max_tokens: int, say: Callable[[str], None], *,
                   precise: bool,
                   prepare: Callable[[EmbeddedCoordinator], None] | None = None) -> EmbeddedRun:
    """The schedule through a coordinator embedded here (``prepare`` may swap its scorers or picker
    first; ``precise``: wait for its KV-event subscriptions), until it is idle again."""
    coord = EmbeddedCoordinator(settings)
    if prepare is not None:
        prepare(coord)
    with coord:
        if precise:
            _handshake_kv_events(coord, sims)
        t0 = time.monotonic()
        samples = asyncio.run(_drive(f"{coord.url}/v1/completions", schedule, closed_loop, concurrency,
                                     max_tokens, say))
        wall = time.monotonic() - t0
        coord.wait_idle()
        states = [httpx.get(f"{s.url}/sim/state", timeout=10).json() for s in sims]
        index_hit = coord.components.metrics.registry.get_sample_value("coordinator_prefix_hit_ratio")
    return EmbeddedRun(samples, states, wall, index_hit)


def _figures(policy: str, schedule: Sequence[Turn], samples: Sequence[Sample], states: list[dict[str, Any]],
             index_hit: float | None, wall: float) -> dict[str, Any]:
    caches_ = [st["prefix_cache"] for st in states]
    queries = sum(c["queries"] for c in caches_)
    hits = sum(c["hits"] for c in caches_)
    per_engine = [st["requests_total"] for st in states]
    uncached = [c["queries"] - c["hits"] for c in caches_]
    ttft = summary_ms([s.ttft_s for s in samples if s.ok])
    return {
        "hit_rate": round(hits / queries, 4) if queries else 0.0,
        "ttft_p50_ms": ttft["p50_ms"], "ttft_p90_ms": ttft["p90_ms"], "ttft": ttft,
        "load_imbalance": _imbalance(per_engine),
        "prefill_imbalance": _imbalance(uncached),
        "requests_per_engine": per_engine, "uncached_tokens_per_engine": uncached,
        "prompt_tokens_per_engine": [c["queries"] for c in caches_],
        "evictions": sum(c["evictions"] for c in caches_),
        "index_hit_rate": round(index_hit, 4) if index_hit is not None and policy.startswith("aff") else None,
        "errors": sum(not s.ok for s in samples), "wall_s": round(wall, 2),
        "requests_per_s": round(len(samples) / wall, 2),
        "mean_inflight": round(sum(s.total_s for s in samples) / wall, 2),
        "prompt_tokens_sent": sum(len(t.prompt) for t in schedule),
    }


def _imbalance(values: Sequence[int]) -> float:
    mean = statistics.fmean(values) if values else 0.0
    return round(max(values) / mean, 3) if mean else float("nan")


# --- figures, report, plot -----------------------------------------------------------------------

def headline(results: dict[str, dict[str, Any]], ceil: dict[str, Any] | None = None) -> dict[str, Any]:
    """The last-line JSON: per-policy figures, then the targets checked on each affinity variant run
    (unprefixed = the default ``affinity`` preset with the approximate index); with ``ceil``, the
    workload's ceiling and each affinity variant's hit rate as a share of it (tokens)."""
    out: dict[str, Any] = {"benchmark": "kv_affinity"}
    for p, res in results.items():
        for k in ("hit_rate", "ttft_p50_ms", "ttft_p90_ms", "load_imbalance"):
            out[f"{p}_{k}"] = res[k]
    if ceil is not None:
        out["ceiling_hit_rate_blocks"] = ceil["hit_rate_blocks"]
        out["ceiling_hit_rate_tokens"] = ceil["hit_rate_tokens"]
    rr, oracle = results.get("round_robin"), results.get("oracle")
    for prefix, p in VARIANTS:
        r = results.get(p)
        if r is None or rr is None or oracle is None:
            continue
        gain = round(rr["ttft_p90_ms"] / r["ttft_p90_ms"], 2) if r["ttft_p90_ms"] else float("nan")
        vs = round(r["hit_rate"] / oracle["hit_rate"], 3) if oracle["hit_rate"] else float("nan")
        out[f"{prefix}ttft_p90_gain_vs_rr"] = gain
        out[f"{prefix}hit_rate_vs_oracle"] = vs
        out[f"{prefix}imbalance"] = r["load_imbalance"]
        if ceil is not None and ceil["hit_rate_tokens"]:
            out[f"{prefix}hit_rate_vs_ceiling"] = round(r["hit_rate"] / ceil["hit_rate_tokens"], 3)
        out[f"{prefix}targets_met"] = bool(
            vs >= TARGET_HIT_VS_ORACLE and gain >= TARGET_P90_GAIN and r["load_imbalance"] <= TARGET_IMBALANCE
            and not r["errors"] and not rr["errors"])
    return out


def _markdown(f: dict[str, Any], head: dict[str, Any]) -> str:
    w, m = f["workload"], f["engine_model"]
    rows = ["| policy | hit rate | TTFT p50 (ms) | TTFT p90 (ms) | load imbalance | requests per engine | "
            "prefill imbalance | evictions | req/s | errors |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p, r in f["policies"].items():
        rows.append(f"| {p} | {r['hit_rate']} | {r['ttft_p50_ms']} | {r['ttft_p90_ms']} | "
                    f"{r['load_imbalance']} | {r['requests_per_engine']} | {r['prefill_imbalance']} | "
                    f"{r['evictions']} | {r['requests_per_s']} | {r['errors']} |")
    targets = [f"| variant | hit rate / oracle (≥ {TARGET_HIT_VS_ORACLE}) | TTFT p90 gain vs round-robin "
               f"(≥ {TARGET_P90_GAIN}) | load imbalance (≤ {TARGET_IMBALANCE}) | targets met |",
               "|---|---|---|---|---|"]
    for prefix, p in VARIANTS:
        if f"{prefix}targets_met" in head:
            targets.append(f"| {p} | {head[prefix + 'hit_rate_vs_oracle']} | "
                           f"{head[prefix + 'ttft_p90_gain_vs_rr']} | {head[prefix + 'imbalance']} | "
                           f"{head[prefix + 'targets_met']} |")
    ceil = f.get("ceiling")
    ceiling_line = "" if ceil is None else (
        f"\n\nCeiling of this workload (every distinct block computed once, unlimited cache): hit rate "
        f"{ceil['hit_rate_blocks']} in blocks (1 - {ceil['distinct_blocks']} distinct / "
        f"{ceil['blocks_sent']} sent), {ceil['hit_rate_tokens']} in tokens (comparable with the engines' "
        f"hit rates above). The "
        f"oracle is a greedy longest-cached-prefix router, not this bound.")
    return (f"# KV-cache affinity\n\n{w['users']} users over {w['tenants']} system prompts of ~"
            f"{w['system_tokens']} tokens, {w['turns']} turns of {w['turn_min']}-{w['turn_max']} new tokens, "
            f"{f['requests']} requests ({'closed loop' if f['closed_loop'] else 'open loop'}: users start "
            f"over {w['ramp_s']} s, one turn per ~{w['think_s']} s each; at most {f['concurrency']} in "
            f"flight), max_tokens {f['max_tokens']}, seed {w['seed']}. "
            f"{ENGINES} engines: {m['capacity_blocks']} blocks x {BLOCK_SIZE} tokens of prefix cache each "
            f"(working set {f['working_set_blocks']} blocks), {m['slots']} slots, prefill "
            f"{m['prefill_s_per_token'] * 1000} ms/token uncached, decode {m['decode_s_per_token'] * 1000} "
            f"ms/token, fixed TTFT {m['ttft_s'] * 1000} ms.\n\n" + "\n".join(rows)
            + ceiling_line + "\n\n" + "\n".join(targets) + "\n\n![plot](kv_affinity.png)\n")


def _plot(f: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pol = f["policies"]
    names = list(pol)
    labels = [n.replace("affinity_", "affinity\n").replace("_", " ") for n in names]
    xs = list(range(len(names)))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    a.bar(xs, [pol[n]["hit_rate"] for n in names], 0.6, color="tab:green")
    a.set_xticks(xs, labels, fontsize=8)
    a.set_ylim(0, 1)
    if f.get("ceiling"):
        a.axhline(f["ceiling"]["hit_rate_tokens"], color="grey", ls="--", lw=1, label="ceiling (tokens)")
        a.legend(fontsize=8)
    a.set_ylabel("engine prefix-cache hit rate (tokens)")
    a.set_title("prefix-cache hit rate")
    b.bar([x - 0.2 for x in xs], [pol[n]["ttft_p50_ms"] for n in names], 0.4, label="p50")
    b.bar([x + 0.2 for x in xs], [pol[n]["ttft_p90_ms"] for n in names], 0.4, label="p90")
    b.set_xticks(xs, labels, fontsize=8)
    b.set_ylabel("ms")
    b.set_title("time to first token (client)")
    b.legend()
    width = 0.8 / ENGINES
    for e in range(ENGINES):
        c.bar([x - 0.4 + width * (e + 0.5) for x in xs], [pol[n]["requests_per_engine"][e] for n in names],
              width, label=f"engine {e}")
    c.axhline(f["requests"] / ENGINES * TARGET_IMBALANCE, color="grey", ls="--", lw=1,
              label=f"{TARGET_IMBALANCE} x mean")
    c.set_xticks(xs, labels, fontsize=8)
    c.set_ylabel("requests")
    c.set_title("requests per engine")
    c.legend(fontsize=7)
    save_figure(fig, path)


# --- main ----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--turn-tokens", default="100-200", help="new tokens per turn, min-max")
    ap.add_argument("--think-s", type=float, default=1.6, help="mean time between a user's turns")
    ap.add_argument("--ramp-s", type=float, default=6.0, help="users start over this window")
    ap.add_argument("--closed-loop", action="store_true",
                    help="ignore send times: --concurrency workers send back to back")
    ap.add_argument("--concurrency", type=int, default=16, help="most requests in flight")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--capacity-blocks", type=int, default=1024, help="prefix cache per engine")
    ap.add_argument("--slots", type=int, default=4, help="requests an engine runs at once (the rest wait)")
    ap.add_argument("--prefill-ms", type=float, default=0.2, help="per uncached prompt token")
    ap.add_argument("--decode-ms", type=float, default=5.0)
    ap.add_argument("--ttft-ms", type=float, default=10.0, help="fixed engine cost before the first token")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma-separated, of {', '.join(POLICIES + EXTRA_POLICIES)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--render-url", help="use this running render sidecar (max_model_len ≥ the prompts)")
    ap.add_argument("--quick", action="store_true", help="tiny workload (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.tenants, args.users, args.turns, args.system_tokens, args.concurrency = 2, 6, 3, 300, 4
        args.capacity_blocks, args.think_s, args.ramp_s = 48, 0.3, 0.5
    lo, hi = (int(x) for x in args.turn_tokens.split("-"))
    policies = [p for p in args.policies.split(",") if p]
    unknown = set(policies) - set(POLICIES) - set(EXTRA_POLICIES)
    if unknown:
        ap.error(f"unknown policies {sorted(unknown)}; choose from {', '.join(POLICIES + EXTRA_POLICIES)}")
    say = Progress("kv_affinity")

    work = Workload(args.tenants, args.users, args.turns, args.system_tokens, lo, hi, args.think_s,
                    args.ramp_s, args.seed)
    schedule = build_schedule(work)
    max_model_len = context_length(schedule, args.max_tokens)
    model = EngineModel(args.capacity_blocks, args.slots, args.prefill_ms / 1000, args.decode_ms / 1000,
                        args.ttft_ms / 1000, max_model_len)
    ws = working_set_blocks(schedule)
    ceil = ceiling(schedule)
    say(f"{len(schedule)} requests, longest prompt {max(len(t.prompt) for t in schedule)} tokens, "
        f"working set {ws} blocks vs {args.capacity_blocks} per engine; ceiling hit rate "
        f"{ceil['hit_rate_tokens']} (tokens)")

    with ExitStack() as stack:
        render_url = stack.enter_context(render_sidecar(args.render_url, say, max_model_len=max_model_len))
        results: dict[str, dict[str, Any]] = {}
        for p in policies:
            say(f"{p}: fresh coordinator and {ENGINES} engines, {len(schedule)} requests")
            r = run_policy(p, render_url, schedule, args.closed_loop, model, args.concurrency,
                           args.max_tokens, say)
            results[p] = r
            say(f"{p}: hit rate {r['hit_rate']}, TTFT p50/p90 {r['ttft_p50_ms']}/{r['ttft_p90_ms']} ms, "
                f"imbalance {r['load_imbalance']} {r['requests_per_engine']}, errors {r['errors']}, "
                f"{r['wall_s']} s")

    figures: dict[str, Any] = {
        "workload": asdict(work), "engine_model": asdict(model), "engines": ENGINES, "block_size": BLOCK_SIZE,
        "requests": len(schedule), "concurrency": args.concurrency, "closed_loop": args.closed_loop,
        "max_tokens": args.max_tokens, "quick": args.quick,
        "working_set_blocks": ws, "ceiling": ceil, "policies": results,
    }
    head = headline(results, ceil)
    figures["headline"] = head
    out = write_report("kv_affinity", figures, _markdown(figures, head))
    _plot(figures, out / "kv_affinity.png")
    say(f"report: {out}/report.md, plot: {out}/kv_affinity.png")
    final_json(head)


if __name__ == "__main__":
    main()
