"""What admission control buys at 3x the load the engines can serve.

Why: without admission every request is sent on, the engines queue them, and once the backlog is
longer than anyone's patience *every* request is late: goodput collapses although the engines are
100 % busy. Admission keeps the admitted work within what the engines can run now (token budgets),
lets a short queue cover the gap between a finish and the next arrival, and refuses the rest at once
(429) so clients can back off or go elsewhere.

Set-up: the real coordinator in-process (``EmbeddedCoordinator``), a real render sidecar, simulated
engines with a fixed cost (``ttft_s`` + ``decode_s_per_token`` per token after the first, at most
``max_concurrency`` running; docs/simulator.md "Cost and capacity model"). Streaming completions with
token-id prompts (cheap render) of ``prompt_tokens`` random ids and ``max_tokens`` output tokens.
Admission: each engine's ``max_inflight_tokens`` = ``max_concurrency`` x (prompt + max_tokens), so the
coordinator never sends an engine more than it can run at once.

Phases, all in one run (so every ratio compares like with like on a noisy machine):

1. *Uncongested TTFT* ``ttft0``: a few requests at low concurrency, p50.
2. *Capacity*: closed loop, 2 x slots clients back to back (the admission queue keeps every slot
   busy); capacity = clients / mean response time after a warm-up (Little's law).
3. *Overload, admission on*: Poisson arrivals at 3 x capacity. SLO: TTFT <= ``slo_factor`` x ttft0.
   ``max_queue`` = capacity x (SLO - ttft0) x ``--queue-fraction`` (0.5: by Little's law a full queue
   drains in half the slack) and ``queue_timeout_s`` = SLO - ttft0 (a waiter that can no longer make
   the SLO gets a 503 rather than a late first token).
4. *Overload, admission effectively off*: the same arrivals against a huge budget and queue.

Definitions: goodput = requests that *arrived* in the measured window (after a warm-up) and completed
successfully (every token, ``[DONE]``) with TTFT <= SLO, per second of window. goodput_ratio = goodput
at 3 x / capacity. Reject latency: client-side, send to the 429 response. Clients give up after
``client_timeout_s`` (their disconnect aborts the request), which also bounds the drain of phase 4.
leaked_budget = ``ledger.global_inflight`` + sum of ``engine.inflight_tokens`` once a phase drained.

Processes: the coordinator runs alone in this process; the simulated engines and the load generator
run in child processes. Sharing one interpreter (and its GIL, 5 ms switch interval) with four engine
servers and the client made every 429 wait for other threads and measured the harness, not the
coordinator.

    python -m perf.overload [--duration 25] [--overload 3.0] [--slo-factor 3] [--render-url URL] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import random
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from coordinator.config import (
    AdmissionSettings,
    EngineClientSettings,
    EngineSettings,
    ModelSettings,
    RenderSettings,
    Settings,
)
from coordinator.embedded import EmbeddedCoordinator
from perf._procs import render_sidecar, sim_engines
from perf._report import Progress, final_json, pct, save_figure, write_report

NAME = "overload"
SERVED = "smollm2-135m-instruct"
VOCAB_SIZE = 49152  # SmolLM2-135M-Instruct
GOODPUT_TARGET = 0.95
REJECT_P50_TARGET_MS = 5.0


@dataclass
class Shape:
    """The workload and the engines' cost; ``service_s`` is one request's time on an engine slot."""

    engines: int
    concurrency: int
    ttft_s: float
    decode_s: float
    prompt_tokens: int
    max_tokens: int

    @property
    def slots(self) -> int:
        return self.engines * self.concurrency

    @property
    def cost_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens

    @property
    def service_s(self) -> float:
        return self.ttft_s + (self.max_tokens - 1) * self.decode_s


@dataclass
class Outcome:
    """One client request; times are seconds, ``arrival``/``sent`` from the phase start."""

    arrival: float
    sent: float
    status: int                 # HTTP status; 0 when the client gave up or the transport failed
    kind: str                   # ok | rejected (429) | queue_timeout (503) | client_timeout | failed
    latency: float              # send → last byte (or the error response)
    ttft: float | None = None   # send → first token frame

    @property
    def ended(self) -> float:
        return self.sent + self.latency


# ---------------------------------------------------------------------------------------- client
class Client:
    """Streams one completion and classifies how it ended."""

    def __init__(self, url: str, shape: Shape, timeout_s: float, seed: int) -> None:
        self.url = f"{url}/v1/completions"
        self.shape = shape
        self.timeout_s = timeout_s
        self.rng = random.Random(seed)
        self.http = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=4096,
                                                                        max_keepalive_connections=512))

    def body(self) -> dict[str, Any]:
        # Fresh random ids: no prefix-cache hits, so every request costs the engine the same.
        prompt = [self.rng.randrange(1000, 40_000) for _ in range(self.shape.prompt_tokens)]  # < VOCAB_SIZE
        return {"model": SERVED, "prompt": prompt, "max_tokens": self.shape.max_tokens, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}

    async def one(self, t0: float, arrival: float) -> Outcome:
        body = self.body()
        start = time.perf_counter()
        sent = start - t0
        ttft: float | None = None
        status = 0
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.http.stream("POST", self.url, json=body) as r:
                    status = r.status_code
                    if status != 200:
                        await r.aread()
                        kind = {429: "rejected", 503: "queue_timeout"}.get(status, "failed")
                        return Outcome(arrival, sent, status, kind, time.perf_counter() - start)
                    done, completion = False, -1
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        frame = json.loads(line[6:])
                        if "error" in frame:
                            break
                        if frame.get("choices") and ttft is None:
                            ttft = time.perf_counter() - start
                        if frame.get("usage"):
                            completion = int(frame["usage"].get("completion_tokens", -1))
                    ok = done and completion == self.shape.max_tokens
                    return Outcome(arrival, sent, status, "ok" if ok else "failed",
                                   time.perf_counter() - start, ttft)
        except TimeoutError:
            return Outcome(arrival, sent, 0, "client_timeout", time.perf_counter() - start, ttft)
        except httpx.HTTPError:
            return Outcome(arrival, sent, status, "failed", time.perf_counter() - start, ttft)

    async def aclose(self) -> None:
        await self.http.aclose()


async def closed_loop(client: Client, workers: int, slots: int, duration_s: float,
                      service_s: float) -> list[Outcome]:
    """``workers`` clients, each sending its next request when the previous one ends. Each engine slot
    gets its own phase (worker i starts at (i mod slots) / slots of a service time): started together,
    the slots finish in waves and a fixed window counts a wave too many or too few."""
    out: list[Outcome] = []
    t0 = time.perf_counter()

    async def worker(i: int) -> None:
        await asyncio.sleep((i % slots) * service_s / slots)
        while time.perf_counter() - t0 < duration_s:
            out.append(await client.one(t0, time.perf_counter() - t0))

    await asyncio.gather(*(worker(i) for i in range(workers)))
    return out


async def open_loop(client: Client, rate: float, duration_s: float, seed: int) -> list[Outcome]:
    """Poisson arrivals at ``rate``/s: each request starts on schedule whatever the others do
    (late starts are recorded in ``sent`` - ``arrival``, the generator's own lag)."""
    rng = random.Random(seed)
    arrivals: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        arrivals.append(t)
        t += rng.expovariate(rate)
    t0 = time.perf_counter()
    tasks: list[asyncio.Task[Outcome]] = []
    for a in arrivals:
        delay = t0 + a - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(client.one(t0, a)))
    return list(await asyncio.gather(*tasks))


def load_calibration(url: str, shape: Shape, args: argparse.Namespace, n_idle: int
                     ) -> tuple[list[Outcome], list[Outcome]]:
    """Child process: uncongested requests, then the closed-loop capacity run."""
    return asyncio.run(_calibrate(url, shape, args, n_idle))


def load_open(url: str, shape: Shape, args: argparse.Namespace, rate: float, duration_s: float
              ) -> tuple[float, list[Outcome]]:
    """Child process: one open-loop phase; returns its start (``perf_counter`` is system-wide on
    Linux, so the parent can line up its samples) and the outcomes."""
    async def run() -> tuple[float, list[Outcome]]:
        client = Client(url, shape, args.client_timeout, args.seed + 1)
        try:
            await _batch(client, 4, 2)   # warm connections; not measured
            return time.perf_counter(), await open_loop(client, rate, duration_s, args.seed)
        finally:
            await client.aclose()
    return asyncio.run(run())


# ----------------------------------------------------------------------------------- coordinator
def coordinator_settings(render_url: str, engines: list[str], *, budget: int, max_queue: int,
                         queue_timeout_s: float) -> Settings:
    os.environ.pop("COORD_CONFIG", None)
    return Settings(
        render=RenderSettings(url=render_url),
        engines=[EngineSettings(url=u, max_inflight_tokens=budget) for u in engines],
        # The workload's random prompt ids lie in SmolLM2's vocabulary; say so (the stub render in the
        # quick smoke test has no model folder to learn it from).
        models=[ModelSettings(name=SERVED, vocab_size=VOCAB_SIZE)],
        admission=AdmissionSettings(max_queue=max_queue, queue_timeout_s=queue_timeout_s),
        # Enough engine connections that the no-admission run is limited by nothing but the engines.
        engine_client=EngineClientSettings(max_connections=8192),
    )


def leftovers(coord: EmbeddedCoordinator, engines: list[str], wait_s: float) -> dict[str, int]:
    """What a drained coordinator (and its engines) still hold; all zero unless something leaked."""
    coord.wait_idle(wait_s)
    deadline = time.monotonic() + wait_s
    while True:
        states = [httpx.get(f"{u}/sim/state", timeout=5).json() for u in engines]
        busy = sum(len(s["running"]) + len(s["waiting"]) for s in states)
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    c = coord.components
    return {"ledger_global_inflight": c.ledger.global_inflight,
            "engine_inflight_tokens": sum(e.inflight_tokens for e in c.registry.engines),
            "engine_inflight_requests": sum(e.inflight_requests for e in c.registry.engines),
            "queue_length": c.admission.queue_length, "coordinator_inflight": c.pipeline.inflight,
            "engine_side_running_or_waiting": busy}


def leaked_budget(left: dict[str, int]) -> int:
    return left["ledger_global_inflight"] + left["engine_inflight_tokens"]


# ------------------------------------------------------------------------------------- analysis
def ms(values: list[float], q: float) -> float | None:
    """Percentile in ms; None (JSON null, not NaN) when nothing was measured."""
    return round(pct([v * 1000 for v in values], q), 2) if values else None


def summarize(outs: list[Outcome], window: tuple[float, float], slo_s: float) -> dict[str, Any]:
    lo, hi = window
    inwin = [o for o in outs if lo <= o.arrival < hi]
    span = hi - lo
    kinds = {k: sum(1 for o in inwin if o.kind == k)
             for k in ("ok", "rejected", "queue_timeout", "client_timeout", "failed")}
    good = [o for o in inwin if o.kind == "ok" and o.ttft is not None and o.ttft <= slo_s]
    admitted = [o.ttft for o in inwin if o.status == 200 and o.ttft is not None]
    rejects = [o.latency for o in inwin if o.kind == "rejected"]
    timeouts = [o.latency for o in inwin if o.kind == "queue_timeout"]
    lag = [o.sent - o.arrival for o in inwin]
    return {
        "requests": len(inwin), "offered_rps": round(len(inwin) / span, 2), "outcomes": kinds,
        "goodput_rps": round(len(good) / span, 2),
        "completed_rps": round(kinds["ok"] / span, 2),
        "admitted_ttft_p50_ms": ms(admitted, 50), "admitted_ttft_p99_ms": ms(admitted, 99),
        "reject_latency_p50_ms": ms(rejects, 50), "reject_latency_p99_ms": ms(rejects, 99),
        "queue_timeout_latency_p50_ms": ms(timeouts, 50),
        "generator_lag_p99_ms": ms(lag, 99),
    }


def timeline(outs: list[Outcome], duration_s: float, slo_s: float,
             timeout_s: float) -> dict[str, list[Any]]:
    """Per 1-s arrival bin: goodput and TTFT of the requests that got through (a request that never saw
    a first token before the client gave up counts with TTFT = the client timeout, a lower bound)."""
    bins = math.ceil(duration_s)
    t: list[float] = []
    good: list[float] = []
    p50: list[float | None] = []
    p99: list[float | None] = []
    for b in range(bins):
        group = [o for o in outs if b <= o.arrival < b + 1]
        ttfts = [o.ttft if o.ttft is not None else timeout_s
                 for o in group if o.status == 200 or o.kind == "client_timeout"]
        t.append(b + 0.5)
        good.append(sum(1 for o in group if o.kind == "ok" and o.ttft is not None and o.ttft <= slo_s))
        p50.append(ms(ttfts, 50))
        p99.append(ms(ttfts, 99))
    return {"t": t, "goodput_rps": good, "ttft_p50_ms": p50, "ttft_p99_ms": p99}


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4, help="running requests per engine")
    ap.add_argument("--ttft-ms", type=float, default=100.0, help="engine time to first token")
    ap.add_argument("--decode-ms", type=float, default=20.0)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--overload", type=float, default=3.0, help="offered load as a multiple of capacity")
    ap.add_argument("--slo-factor", type=float, default=3.0, help="SLO: TTFT <= this x uncongested TTFT")
    ap.add_argument("--duration", type=float, default=25.0, help="seconds of overload, admission on")
    ap.add_argument("--off-duration", type=float, default=12.0, help="seconds of overload, admission off")
    ap.add_argument("--capacity-duration", type=float, default=12.0)
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds left out at the start of each phase")
    ap.add_argument("--queue-fraction", type=float, default=0.5,
                    help="max_queue = capacity x SLO slack x this (the share of the slack queueing may use)")
    ap.add_argument("--client-timeout", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--render-url", default=None, help="use this render sidecar instead of starting one")
    ap.add_argument("--quick", action="store_true", help="smoke run: small engines, phases of seconds")
    args = ap.parse_args(argv)
    if args.quick:
        args.engines, args.concurrency, args.ttft_ms, args.decode_ms, args.max_tokens = 2, 2, 50.0, 10.0, 16
        args.duration, args.off_duration, args.capacity_duration, args.warmup = 3.0, 2.0, 2.0, 0.5
        args.client_timeout = 1.5
    shape = Shape(args.engines, args.concurrency, args.ttft_ms / 1000, args.decode_ms / 1000,
                  args.prompt_tokens, args.max_tokens)
    say = Progress(NAME)

    with ExitStack() as stack:
        render_url = stack.enter_context(render_sidecar(args.render_url, say))
        # One event for the first token, one at the end: the derender calls stay cheap (2 per request).
        sim = {"model": SERVED, "mode": "random", "ttft_s": shape.ttft_s,
               "decode_s_per_token": shape.decode_s, "max_concurrency": shape.concurrency,
               "stream_interval": shape.max_tokens}
        engines, _ = stack.enter_context(sim_engines([{**sim, "seed": i} for i in range(shape.engines)]))
        pool = stack.enter_context(ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")))
        budget = shape.concurrency * shape.cost_tokens
        nominal = shape.slots / shape.service_s
        say(f"{shape.engines} simulated engines x {shape.concurrency} slots, {shape.service_s * 1000:.0f} ms "
            f"per request: nominal capacity {nominal:.1f} req/s; engine budget {budget} tokens")
        f = run_phases(args, shape, render_url, engines, pool, budget, nominal, say)

    out = write_report(NAME, f, _markdown(f))
    _plot(f, out / f"{NAME}.png")
    say(f"report: {out}/report.md, plot: {out}/{NAME}.png")
    on, off = f["admission_on"], f["admission_off"]
    final_json({"benchmark": NAME, "offered_x_capacity": args.overload,
                "capacity_rps": f["capacity_rps"], "slo_ttft_ms": f["slo_ttft_ms"],
                "goodput_ratio": f["goodput_ratio"], "admitted_ttft_p99_ms": on["admitted_ttft_p99_ms"],
                "reject_latency_p50_ms": on["reject_latency_p50_ms"], "leaked_budget": f["leaked_budget"],
                "no_admission_goodput_ratio": f["no_admission_goodput_ratio"],
                "no_admission_ttft_p99_ms": off["admitted_ttft_p99_ms"], "targets_met": f["targets_met"]})


def run_phases(args: argparse.Namespace, shape: Shape, render_url: str, engines: list[str],
               pool: ProcessPoolExecutor, budget: int, nominal: float, say: Progress) -> dict[str, Any]:
    f: dict[str, Any] = {"shape": {**asdict(shape), "service_ms": round(shape.service_s * 1000, 1),
                                   "slots": shape.slots, "engine_budget_tokens": budget},
                         "nominal_capacity_rps": round(nominal, 2), "overload_x": args.overload,
                         "slo_factor": args.slo_factor, "client_timeout_s": args.client_timeout,
                         "warmup_s": args.warmup, "quick": args.quick}
    drain_s = args.client_timeout + 5

    # Phases 1-2 on a coordinator with a roomy queue: nothing is refused while we calibrate.
    calib = coordinator_settings(render_url, engines, budget=budget, max_queue=4 * shape.slots,
                                 queue_timeout_s=60)
    n_idle = max(8, shape.slots)
    say(f"uncongested TTFT: {n_idle} requests at concurrency {max(2, shape.slots // 4)} after a warm-up; "
        f"then capacity: closed loop, {2 * shape.slots} clients for {args.capacity_duration:g} s")
    with EmbeddedCoordinator(calib) as coord:
        idle, cap_outs = pool.submit(load_calibration, coord.url, shape, args, n_idle).result()
        calib_left = leftovers(coord, engines, drain_s)
    ttft0 = statistics.median(o.ttft for o in idle if o.ttft is not None)
    say(f"  ttft0 p50 {ttft0 * 1000:.1f} ms")
    # Little's law for a closed system: throughput = clients / mean response time (the clients send
    # again at once). Unlike counting completions in a window it has no quantization error (every
    # request lasts about one service time, so a window holds a whole number of them per slot, +-1).
    w0 = min(args.warmup + shape.service_s, args.capacity_duration / 2)
    steady = [o for o in cap_outs if o.kind == "ok" and o.sent >= w0 and o.ended <= args.capacity_duration]
    capacity = 2 * shape.slots / statistics.fmean(o.latency for o in steady)
    counted = sum(1 for o in cap_outs if o.kind == "ok" and w0 <= o.ended <= args.capacity_duration) / (
        args.capacity_duration - w0)
    say(f"  capacity {capacity:.2f} req/s ({capacity / nominal:.1%} of nominal; window count "
        f"{counted:.2f}), {sum(o.kind != 'ok' for o in cap_outs)} not ok")

    slo = args.slo_factor * ttft0
    slack = slo - ttft0
    max_queue = max(1, int(capacity * slack * args.queue_fraction))
    rate = args.overload * capacity
    f.update({"ttft0_ms": round(ttft0 * 1000, 2), "capacity_rps": round(capacity, 2),
              "capacity_vs_nominal": round(capacity / nominal, 3),
              "capacity_window_count_rps": round(counted, 2), "slo_ttft_ms": round(slo * 1000, 1),
              "max_queue": max_queue, "queue_timeout_s": round(slack, 3), "offered_rps": round(rate, 2)})
    window = (args.warmup, args.duration)

    say(f"overload, admission on: Poisson {rate:.1f} req/s ({args.overload:g} x) for {args.duration:g} s; "
        f"SLO TTFT <= {slo * 1000:.0f} ms, max_queue {max_queue}, queue_timeout_s {slack:.3f}")
    tuned = coordinator_settings(render_url, engines, budget=budget, max_queue=max_queue,
                                 queue_timeout_s=slack)
    on_outs, on_left, on_samples = _overload(tuned, engines, pool, shape, args, rate, args.duration, drain_s)
    on = summarize(on_outs, window, slo)
    say(f"  goodput {on['goodput_rps']} req/s = {on['goodput_rps'] / capacity:.3f} x capacity; admitted TTFT "
        f"p99 {on['admitted_ttft_p99_ms']} ms; 429 p50 {on['reject_latency_p50_ms']} ms; {on['outcomes']}")

    say(f"overload, admission off (huge budget and queue): {rate:.1f} req/s for {args.off_duration:g} s")
    loose = coordinator_settings(render_url, engines, budget=10**9, max_queue=100_000, queue_timeout_s=3600)
    off_outs, off_left, off_samples = _overload(loose, engines, pool, shape, args, rate, args.off_duration,
                                                drain_s)
    off = summarize(off_outs, (args.warmup, args.off_duration), slo)
    say(f"  goodput {off['goodput_rps']} req/s = {off['goodput_rps'] / capacity:.3f} x capacity; TTFT p99 "
        f"{off['admitted_ttft_p99_ms']} ms; {off['outcomes']}")

    leaked = leaked_budget(calib_left) + leaked_budget(on_left) + leaked_budget(off_left)
    queue_left = calib_left["queue_length"] + on_left["queue_length"] + off_left["queue_length"]
    f.update({
        "admission_on": on, "admission_off": off,
        "leftovers": {"calibration": calib_left, "admission_on": on_left, "admission_off": off_left},
        "goodput_ratio": round(on["goodput_rps"] / capacity, 3),
        "no_admission_goodput_ratio": round(off["goodput_rps"] / capacity, 3),
        "leaked_budget": leaked, "queue_length_after": queue_left,
        "timeline_on": timeline(on_outs, args.duration, slo, args.client_timeout),
        "timeline_off": timeline(off_outs, args.off_duration, slo, args.client_timeout),
        "samples_on": on_samples, "samples_off": off_samples,
    })
    f["targets"] = {"goodput_ratio": f["goodput_ratio"] >= GOODPUT_TARGET,
                    "reject_latency_p50_ms": on["reject_latency_p50_ms"] is not None
                    and on["reject_latency_p50_ms"] <= REJECT_P50_TARGET_MS,
                    "leaked_budget": leaked == 0, "queue_empty": queue_left == 0}
    f["targets_met"] = all(f["targets"].values())
    return f


async def _calibrate(url: str, shape: Shape, args: argparse.Namespace, n_idle: int
                     ) -> tuple[list[Outcome], list[Outcome]]:
    client = Client(url, shape, args.client_timeout, args.seed)
    try:
        await _batch(client, 4, min(4, shape.slots))   # warm-up: connections, first render
        idle = await _batch(client, n_idle, max(2, shape.slots // 4))
        return idle, await closed_loop(client, 2 * shape.slots, shape.slots, args.capacity_duration,
                                       shape.service_s)
    finally:
        await client.aclose()


async def _batch(client: Client, n: int, conc: int) -> list[Outcome]:
    sem = asyncio.Semaphore(conc)
    t0 = time.perf_counter()

    async def one() -> Outcome:
        async with sem:
            return await client.one(t0, time.perf_counter() - t0)

    return list(await asyncio.gather(*(one() for _ in range(n))))


def _overload(settings: Settings, engines: list[str], pool: ProcessPoolExecutor, shape: Shape,
              args: argparse.Namespace, rate: float, duration_s: float, drain_s: float
              ) -> tuple[list[Outcome], dict[str, int], dict[str, list[float]]]:
    """One open-loop phase on a fresh coordinator (load from the child process); returns outcomes,
    what the coordinator held after draining, and its queue length and admitted tokens every 0.25 s."""
    samples: dict[str, list[float]] = {"t": [], "queue_length": [], "inflight_tokens": []}
    with EmbeddedCoordinator(settings) as coord:
        c = coord.components
        job = pool.submit(load_open, coord.url, shape, args, rate, duration_s)
        while not job.done():
            samples["t"].append(time.perf_counter())
            samples["queue_length"].append(c.admission.queue_length)
            samples["inflight_tokens"].append(sum(e.inflight_tokens for e in c.registry.engines))
            time.sleep(0.25)
        t0, outs = job.result()
        samples["t"] = [round(t - t0, 2) for t in samples["t"]]
        left = leftovers(coord, engines, drain_s)
    return outs, left, samples


def _markdown(f: dict[str, Any]) -> str:
    on, off, s = f["admission_on"], f["admission_off"], f["shape"]
    rows = ["| | admission on | admission off |", "|---|---|---|"]
    for key, label in (("offered_rps", "offered req/s"), ("goodput_rps", "goodput req/s (in SLO)"),
                       ("completed_rps", "completed req/s (any TTFT)"),
                       ("admitted_ttft_p50_ms", "admitted TTFT p50 ms"),
                       ("admitted_ttft_p99_ms", "admitted TTFT p99 ms"),
                       ("reject_latency_p50_ms", "429 latency p50 ms"),
                       ("reject_latency_p99_ms", "429 latency p99 ms"),
                       ("generator_lag_p99_ms", "load generator lag p99 ms")):
        rows.append(f"| {label} | {_cell(on[key])} | {_cell(off[key])} |")
    rows.append(f"| goodput / capacity | **{f['goodput_ratio']}** | {f['no_admission_goodput_ratio']} |")
    rows.append(f"| outcomes | {on['outcomes']} | {off['outcomes']} |")
    verdict = "met" if f["targets_met"] else "NOT met"
    return (
        f"# Overload: {f['overload_x']:g} x capacity\n\n"
        f"{s['engines']} simulated engines x {s['concurrency']} slots, {s['service_ms']} ms per request "
        f"({s['prompt_tokens']} prompt + {s['max_tokens']} output tokens); engine budget "
        f"{s['engine_budget_tokens']} tokens. Uncongested TTFT {f['ttft0_ms']} ms; SLO TTFT <= "
        f"{f['slo_ttft_ms']} ms ({f['slo_factor']:g} x). Capacity (closed loop, same run) "
        f"{f['capacity_rps']} req/s ({f['capacity_vs_nominal']:.0%} of nominal); offered "
        f"{f['offered_rps']} req/s. Admission: max_queue {f['max_queue']}, queue_timeout_s "
        f"{f['queue_timeout_s']}. Clients give up after {f['client_timeout_s']:g} s.\n\n"
        + "\n".join(rows)
        + f"\n\nTargets ({verdict}): {f['targets']}. leaked_budget {f['leaked_budget']}, queue after "
        f"{f['queue_length_after']}; leftovers {f['leftovers']}.\n\n![plot]({NAME}.png)\n")


def _cell(value: Any) -> str:
    return "n/a" if value is None else str(value)


def _plot(f: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4))
    on, off = f["timeline_on"], f["timeline_off"]
    left.plot(on["t"], on["goodput_rps"], marker=".", label="admission on")
    left.plot(off["t"], off["goodput_rps"], marker=".", label="admission off")
    left.axhline(f["capacity_rps"], color="grey", linestyle="--", linewidth=1, label="capacity (closed loop)")
    left.axhline(f["offered_rps"], color="grey", linestyle=":", linewidth=1, label="offered")
    left.set_xlabel("arrival time (s)")
    left.set_ylabel("requests/s completed within the SLO")
    left.set_title(f"goodput at {f['overload_x']:g} x capacity")
    left.legend(fontsize=8)
    for tl, name in ((on, "admission on"), (off, "admission off")):
        line = right.plot(tl["t"], tl["ttft_p99_ms"], marker=".", label=f"{name}: p99")[0]
        right.plot(tl["t"], tl["ttft_p50_ms"], linestyle="--", color=line.get_color(), label=f"{name}: p50")
    right.axhline(f["slo_ttft_ms"], color="red", linestyle="--", linewidth=1, label="SLO")
    right.axhline(f["client_timeout_s"] * 1000, color="grey", linestyle=":", linewidth=1,
                  label="clients give up (TTFT censored)")
    right.set_yscale("log")
    right.set_xlabel("arrival time (s)")
    right.set_ylabel("TTFT of admitted requests (ms)")
    right.set_title("time to first token")
    right.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
