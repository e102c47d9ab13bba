"""Fairness between tenants: a light tenant next to one offering ten times its load at 3x capacity.

Why: tenants share the engines, and without a rule the heaviest one decides everybody's latency. The
admission queue keeps one line per tenant and admits by weighted fair queuing on tokens
(coordinator/pipeline/admission/controller.py); this measures what that buys against one shared line
(plain FIFO, what the coordinator did before tenants), on real processes.

Set-up, all in one run: one coordinator process (``python -m coordinator``) whose config names two
tenants, A and B, each with its own API key and equal weights; one real render sidecar (unless
``--render-url``); ``--engines`` simulated engines in a child process with fixed costs (``ttft_s`` +
``decode_s_per_token`` per token after the first; docs/simulator.md), ``--stream-interval`` tokens per
chunk. Requests: ``prompt_tokens`` fixed token ids + ``max_tokens`` with ``ignore_eos``, streamed,
``max_tokens`` drawn uniformly from +- ``--spread`` around its mean (0: every request the same, which
keeps the engines' releases in lockstep waves: slots filled together finish together). Each engine's
budget is ``slots`` x the mean request's tokens, so the coordinator sends it about ``slots`` requests
and the rest waits in the admission queue. The load generators run in child processes,
one per tenant (A's heavy traffic must not delay the event loop that times B): Poisson arrivals (open
loop), the tenant's key as a Bearer token, TTFT = send to the first streamed chunk.

Phases:

1. *Capacity*: closed loop after a warm-up, completed requests per second.
2. *B alone* at its rate, B = total / (ratio + 1) x capacity (3/11 of capacity at 3x and 10:1).
3. *Mixed, two tenants*: A at ``ratio`` x B's rate, together ``--load`` x capacity.
4. *Mixed, one tenant*: the same arrivals with both keys in one tenant (the FIFO baseline).

Targets (phase 3): B's TTFT p90 <= 1.5 x its p90 alone, and each tenant's goodput (requests completed
in the window after the warm-up, per second; a 429 or 503 is not goodput) within 10 % of its max-min
fair share of what the engines delivered to the same arrivals through one FIFO line (the one-tenant
run; the closed-loop capacity drifts 10-20 % between runs here), the shares computed from the
arrivals actually sent. Where the
time goes comes from the coordinator's own request log (JSON lines, ``x-request-id`` set by the
client): render, admission wait, engine to first chunk, first derender, and what lies outside the
coordinator; its ``/metrics`` give the admission wait histogram and per-tenant refusals per phase.

    python -m perf.fairness [--duration 40] [--load 3] [--ratio 10] [--slots 16] [--spread 0.5]
                            [--render-url URL] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import random
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

import perf._report
from perf._procs import CoordinatorProcess, render_sidecars, sidecar_pid, sim_engines, tree_cpu_s
from perf._report import Progress, final_json, pct, save_figure, write_report

NAME = "fairness"
SERVED = "smollm2-135m-instruct"
VOCAB_SIZE = 49152
TTFT_TARGET = 1.5
SHARE_TOLERANCE = 0.10
KEYS = {"A": "fairness-key-a", "B": "fairness-key-b"}


# ------------------------------------------------------------------------------------------ shares
def max_min_shares(demands: dict[str, float], weights: dict[str, float], capacity: float) -> dict[str, float]:
    """Max-min fair shares by water-filling: a tenant asking less than its weighted part of what is left
    gets all it asks; the rest is split again among the others by weight."""
    shares = dict.fromkeys(demands, 0.0)
    left, active = capacity, set(demands)
    while active and left > 1e-12:
        total_w = sum(weights[t] for t in active)
        satisfied = {t for t in active if demands[t] - shares[t] <= left * weights[t] / total_w}
        if not satisfied:
            for t in active:
                shares[t] += left * weights[t] / total_w
            break
        for t in satisfied:
            left -= demands[t] - shares[t]
            shares[t] = demands[t]
        active -= satisfied
    return shares


# ---------------------------------------------------------------------------------- load generator
@dataclass
class Load:
    """One tenant's traffic in one phase; runs in a worker process (picklable)."""

    url: str
    key: str
    tenant: str
    prefix: str                 # request ids are ``{prefix}-{n}``: the coordinator's log names them
    body: dict[str, Any]
    seconds: float
    start_at: float             # time.monotonic() (system-wide) at which every worker starts
    seed: int = 0
    rate: float | None = None   # Poisson arrivals per second; None: closed loop of ``clients``
    clients: int = 0
    spread: int = 0             # each request's max_tokens drawn from body's +- this (uniform)

    def next_body(self, rng: random.Random) -> dict[str, Any]:
        if not self.spread:
            return self.body
        return {**self.body, "max_tokens": self.body["max_tokens"] + rng.randint(-self.spread, self.spread)}


async def _one(client: httpx.AsyncClient, load: Load, body: dict[str, Any], rid: str, scheduled: float,
               out: list[dict[str, Any]]) -> None:
    """One streamed completion: status 200 only when every chunk and ``[DONE]`` arrived (-1: the stream
    broke or carried an error frame; 0: no answer); ``first`` is when the first chunk arrived."""
    sent = time.monotonic()
    first: float | None = None
    headers = {"authorization": f"Bearer {load.key}", "x-request-id": rid}
    try:
        async with client.stream("POST", f"{load.url}/v1/completions", json=body, headers=headers) as r:
            status = r.status_code
            if status == 200:
                last, broken = "", False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if first is None and line != "data: [DONE]":
                        first = time.monotonic()
                    broken = broken or '"error"' in line
                    last = line
                if broken or last != "data: [DONE]":
                    status = -1
            else:
                await r.aread()
    except httpx.HTTPError:
        status = 0
    out.append({"rid": rid, "scheduled": scheduled, "sent": sent, "first": first, "done": time.monotonic(),
                "status": status})


async def _generate(load: Load) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await asyncio.sleep(max(0.0, load.start_at - time.monotonic()))
        stop = load.start_at + load.seconds
        n = 0
        rng, lengths = random.Random(load.seed), random.Random(load.seed + 1000)
        if load.rate is None:
            async def worker(w: int) -> None:
                nonlocal n
                while time.monotonic() < stop:
                    n += 1
                    body = load.next_body(lengths)
                    await _one(client, load, body, f"{load.prefix}-{n}", time.monotonic(), out)

            await asyncio.gather(*(worker(w) for w in range(load.clients)))
            return out
        tasks = []
        t = rng.expovariate(load.rate)
        while t < load.seconds:
            at = load.start_at + t
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            n += 1
            tasks.append(asyncio.create_task(_one(client, load, load.next_body(lengths), f"{load.prefix}-{n}",
                                                  at, out)))
            t += rng.expovariate(load.rate)
        await asyncio.gather(*tasks)
    return out


def run_load(load: Load) -> dict[str, Any]:
    """Worker process entry point: the outcomes and the CPU seconds this load generator spent."""
    cpu = time.process_time()
    outs = asyncio.run(_generate(load))
    return {"outs": outs, "cpu_s": time.process_time() - cpu}


def _warm() -> None:
    time.sleep(0.5)  # both workers spawn and import before the first timed phase


# ---------------------------------------------------------------------------------------- analysis
def summarize(outs: list[dict[str, Any]], window: tuple[float, float]) -> dict[str, Any]:
    """One tenant in one phase. Goodput counts completions inside the window (by completion time: at 3x
    the queue still holds requests when arrivals stop); TTFT and outcomes cover requests sent in it."""
    lo, hi = window
    sent = [o for o in outs if lo <= o["scheduled"] < hi]
    statuses = Counter(o["status"] for o in sent)
    ttft = [o["first"] - o["sent"] for o in sent if o["status"] == 200 and o["first"] is not None]
    lag = [o["sent"] - o["scheduled"] for o in sent]
    return {"sent": len(sent), "offered_rps": round(len(sent) / (hi - lo), 3),
            "goodput_rps": round(sum(1 for o in outs if o["status"] == 200 and lo <= o["done"] < hi)
                                 / (hi - lo), 3),
            "ok": statuses[200], "http_429": statuses[429], "http_503": statuses[503],
            "errors": sum(n for s, n in statuses.items() if s not in (200, 429, 503)),
            "ttft_p50_ms": _ms(pct(ttft, 50)), "ttft_p90_ms": _ms(pct(ttft, 90)),
            "ttft_p99_ms": _ms(pct(ttft, 99)), "send_lag_p99_ms": _ms(pct(lag, 99)),
            "ttft_s": sorted(round(x, 4) for x in ttft)}


def _ms(seconds: float) -> float | None:
    return None if math.isnan(seconds) else round(seconds * 1000, 1)


PARTS = ("render", "admission_wait", "engine", "first_derender", "outside")


def breakdown(log_path: Path, outs: list[dict[str, Any]], window: tuple[float, float]) -> dict[str, Any]:
    """Where the TTFT of the window's completed requests went, from the coordinator's ``request`` log
    events: render, admission wait, engine (to its first chunk), first derender (to the first event
    written) and outside (client TTFT minus the coordinator's first event: HTTP, the load generator).
    Means add up to the mean TTFT; p90s show the tail."""
    lo, hi = window
    client_ttft = {o["rid"]: o["first"] - o["sent"] for o in outs
                   if lo <= o["scheduled"] < hi and o["status"] == 200 and o["first"] is not None}
    parts: dict[str, list[float]] = {p: [] for p in PARTS}
    sized: list[tuple[int, float]] = []
    for line in log_path.read_text(errors="replace").splitlines():
        if not line.startswith("{") or '"request"' not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        rid = rec.get("request_id")
        if rid not in client_ttft or rec.get("first_event_ms") is None:
            continue
        render = rec.get("render_ms") or 0.0
        wait = rec.get("queue_delay_ms") or 0.0
        engine_first = rec.get("first_engine_chunk_ms") or rec["first_event_ms"]
        parts["render"].append(render)
        parts["admission_wait"].append(wait)
        parts["engine"].append(engine_first - render - wait)
        parts["first_derender"].append(rec["first_event_ms"] - engine_first)
        parts["outside"].append(client_ttft[rid] * 1000 - rec["first_event_ms"])
        sized.append((rec.get("completion_tokens") or 0, wait))
    n = len(parts["render"])
    return {"requests": n, **{p: {"mean_ms": round(sum(v) / n, 1) if n else None,
                                  "p50_ms": _round(pct(v, 50)), "p90_ms": _round(pct(v, 90))}
                              for p, v in parts.items()},
            "admission_wait_by_size": _by_size(sized)}


def _by_size(sized: list[tuple[int, float]]) -> list[dict[str, Any]]:
    """Admission wait per quarter of the requests by output tokens: whether large requests wait longer
    (a freed gap too small for the next waiter goes to a smaller request further back)."""
    sized.sort()
    out = []
    for q in range(4):
        part = sized[q * len(sized) // 4:(q + 1) * len(sized) // 4]
        if part:
            waits = [w for _, w in part]
            out.append({"tokens": [part[0][0], part[-1][0]], "p50_ms": _round(pct(waits, 50)),
                        "p90_ms": _round(pct(waits, 90))})
    return out


def _round(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 1)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The coordinator's /metrics as {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def admission_counters(before: dict[tuple[str, tuple[tuple[str, str], ...]], float],
                       after: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, Any]:
    """What admission did during a phase: the wait histogram (mean, bucket holding the p90) and each
    tenant's admitted tokens and refusals by reason."""
    def delta(name: str, labels: dict[str, str] | None = None) -> float:
        key = (name, tuple(sorted((labels or {}).items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    count = delta("coordinator_queue_wait_seconds_count")
    buckets = sorted((float(dict(lb)["le"]), after[(n, lb)] - before.get((n, lb), 0.0))
                     for n, lb in after if n == "coordinator_queue_wait_seconds_bucket")
    p90_le = next((le for le, c in buckets if count and c >= 0.9 * count), None)
    tenants: dict[str, dict[str, float]] = {}
    for name, labels in after:
        lab = dict(labels)
        if name == "coordinator_tenant_admitted_tokens_total":
            tenants.setdefault(lab["tenant"], {})["admitted_tokens"] = delta(name, lab)
        elif name == "coordinator_tenant_rejected_total":
            tenants.setdefault(lab["tenant"], {})[f"rejected_{lab['reason']}"] = delta(name, lab)
    return {"admitted": delta("coordinator_admitted_total"),
            "queue_wait_mean_ms": round(delta("coordinator_queue_wait_seconds_sum") / count * 1000, 1)
            if count else None,
            "queue_wait_p90_le_s": p90_le, "tenants": tenants}


# ------------------------------------------------------------------------------------------- phases
def _machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy (every process, other users' included)."""
    import psutil

    t = psutil.cpu_times()
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))


@dataclass
class Rig:
    """What every phase needs: the worker pool, the request body, the phase windows, and the processes
    whose CPU each phase reports (on 2 cores a saturated machine, not admission, can set the TTFT)."""

    pool: ProcessPoolExecutor
    body: dict[str, Any]
    spread: int
    warmup_s: float
    pids: dict[str, int | None]
    cpu: dict[str, float] | None = None

    def run(self, loads: list[Load]) -> dict[str, list[dict[str, Any]]]:
        """The loads at once, one worker each; ``self.cpu``: cores each process used meanwhile."""
        wall, busy = time.monotonic(), _machine_busy_s()
        before = {name: tree_cpu_s(pid) for name, pid in self.pids.items()}
        futures = {load.tenant: self.pool.submit(run_load, load) for load in loads}
        results = {tenant: f.result() for tenant, f in futures.items()}
        wall = time.monotonic() - wall
        cpu: dict[str, float] = {}
        for name, pid in self.pids.items():
            now, then = tree_cpu_s(pid), before[name]
            if now is not None and then is not None:
                cpu[name] = round((now - then) / wall, 2)
        for tenant, r in results.items():
            cpu[f"load_generator_{tenant}"] = round(r["cpu_s"] / wall, 2)
        cpu["machine_busy"] = round((_machine_busy_s() - busy) / wall, 2)
        self.cpu = cpu
        return {tenant: r["outs"] for tenant, r in results.items()}

    def open_loop(self, url: str, name: str, rates: dict[str, float], seconds: float,
                  log_path: Path) -> dict[str, Any]:
        """Poisson arrivals per tenant, each with its own key; the phase's summary per tenant."""
        start = time.monotonic() + 1.0
        before = scrape(url)
        outs = self.run([Load(url, KEYS[t], t, f"{name}-{t}", self.body, seconds, start, seed=17 + i,
                              rate=rate, spread=self.spread)
                         for i, (t, rate) in enumerate(sorted(rates.items()))])
        after = scrape(url)
        window = (start + self.warmup_s, start + seconds)
        result: dict[str, Any] = {"seconds": seconds, "warmup_s": self.warmup_s, "cpu_cores": self.cpu,
                                  "admission": admission_counters(before, after), "tenants": {}}
        for t, o in outs.items():
            result["tenants"][t] = {**summarize(o, window), "ttft_breakdown": breakdown(log_path, o, window)}
        return result


def coordinator_config(render_url: str, engines: list[str], budget: int, members: list[dict[str, Any]],
                       *, max_queue: int, queue_timeout_s: float) -> dict[str, Any]:
    return {"server": {"log_level": "info", "log_format": "json"},  # the request events: TTFT breakdown
            "render": {"url": render_url},
            "engines": [{"url": u, "max_inflight_tokens": budget} for u in engines],
            "models": [{"name": SERVED, "vocab_size": VOCAB_SIZE}],
            "admission": {"max_queue": max_queue, "queue_timeout_s": queue_timeout_s},
            "tenants": {"members": members},
            "engine_client": {"max_connections": 1024}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--slots", type=int, default=16, help="requests of the mean size an engine runs at once")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96, help="output tokens of the mean request")
    ap.add_argument("--spread", type=float, default=0.5,
                    help="each request's max_tokens uniform in max_tokens x (1 +- this); 0: every request "
                    "the same (fixed costs keep the engines' releases in lockstep waves)")
    ap.add_argument("--stream-interval", type=int, default=8,
                    help="engine tokens per streamed chunk (vLLM's --stream-interval; the first token is "
                    "sent alone); at 1, a derender call per token for every stream makes the 2-core machine, "
                    "not the engines, the limit")
    ap.add_argument("--ttft-s", type=float, default=0.1, help="engine time to first token")
    ap.add_argument("--decode-s", type=float, default=0.02, help="engine seconds per output token")
    ap.add_argument("--load", type=float, default=3.0, help="A + B offered, as a multiple of capacity")
    ap.add_argument("--ratio", type=float, default=10.0, help="A's rate / B's rate")
    ap.add_argument("--queue-s", type=float, default=2.0,
                    help="max_queue = nominal capacity x this (a full queue drains in about this long)")
    ap.add_argument("--queue-timeout", type=float, default=15.0, help="admission.queue_timeout_s")
    ap.add_argument("--capacity-duration", type=float, default=15.0)
    ap.add_argument("--alone-duration", type=float, default=30.0)
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of each mixed phase")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds left out at the start of each phase")
    ap.add_argument("--render-url", default=None, help="use this render sidecar instead of starting one")
    ap.add_argument("--quick", action="store_true", help="a short smoke run (numbers not meaningful)")
    args = ap.parse_args(argv)
    if args.quick:
        args.slots, args.max_tokens, args.ttft_s, args.decode_s = 4, 16, 0.05, 0.01
        args.capacity_duration, args.alone_duration, args.duration, args.warmup = 2.5, 2.5, 3.0, 0.5
    say = Progress(NAME)
    out_dir = perf._report.OUT_ROOT / NAME
    out_dir.mkdir(parents=True, exist_ok=True)
    cost = args.prompt_tokens + args.max_tokens          # the mean request's cost
    spread = round(args.spread * args.max_tokens)
    budget = args.slots * cost
    slots = args.engines * args.slots
    service_s = args.ttft_s + (args.max_tokens - 1) * args.decode_s  # the mean request's engine time
    nominal = slots / service_s
    # With spread, the budget (the engine's KV, in effect) sets how many run: the engine itself never queues.
    concurrency = math.ceil(budget / (args.prompt_tokens + args.max_tokens - spread))
    max_queue = max(8, round(nominal * args.queue_s))
    body = {"model": SERVED, "prompt": [random.Random(7).randrange(100, VOCAB_SIZE)
                                        for _ in range(args.prompt_tokens)],
            "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    sims = [{"model": SERVED, "seed": i, "ttft_s": args.ttft_s, "decode_s_per_token": args.decode_s,
             "max_concurrency": concurrency, "stream_interval": args.stream_interval}
            for i in range(args.engines)]
    two_tenants = [{"name": t, "api_keys": [KEYS[t]], "weight": 1.0} for t in ("A", "B")]
    one_tenant = [{"name": "shared", "api_keys": [KEYS["A"], KEYS["B"]], "weight": 1.0}]
    phases: dict[str, Any] = {}
    with ExitStack() as stack:
        pool = stack.enter_context(ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")))
        for f in [pool.submit(_warm) for _ in range(2)]:
            f.result()
        pids: dict[str, int | None] = {}
        if args.render_url:
            render_url = args.render_url
        else:
            sidecar = stack.enter_context(render_sidecars(1, say))[0]
            render_url, pids["render_sidecar"] = sidecar.url, sidecar_pid(sidecar)
        engines, pids["engines"] = stack.enter_context(sim_engines(sims))
        rig = Rig(pool, body, spread, args.warmup, pids)
        logs = {"tenants": out_dir / "coordinator-tenants.log", "one_tenant": out_dir / "coordinator-one.log"}
        for path in logs.values():
            path.unlink(missing_ok=True)

        def coordinator(members: list[dict[str, Any]], log: Path) -> CoordinatorProcess:
            cfg = coordinator_config(render_url, engines, budget, members, max_queue=max_queue,
                                     queue_timeout_s=args.queue_timeout)
            return CoordinatorProcess(cfg, log)

        say(f"coordinator with tenants A and B (equal weights); {args.engines} engines x {args.slots} slots, "
            f"{service_s:.2f} s per request, max_queue {max_queue}")
        with coordinator(two_tenants, logs["tenants"]) as c:
            pids["coordinator"] = c.pid
            clients = min(2 * slots, slots + max_queue)
            say(f"capacity: closed loop, {clients} clients, {args.capacity_duration:.0f} s")
            start = time.monotonic() + 1.0
            outs = rig.run([Load(c.url, KEYS["A"], "A", "capacity", body, args.capacity_duration, start,
                                        clients=clients, spread=spread)])["A"]
            capacity = summarize(outs, (start + min(args.warmup, args.capacity_duration / 3),
                                        start + args.capacity_duration))["goodput_rps"]
            capacity_cpu = rig.cpu
            say(f"capacity {capacity:.2f} req/s (nominal {nominal:.2f}); cores used: {capacity_cpu}")
            if capacity <= 0:
                raise RuntimeError(f"no request completed in the capacity phase (see {logs['tenants']})")
            rate_b = args.load * capacity / (args.ratio + 1)
            rates = {"A": args.ratio * rate_b, "B": rate_b}
            say(f"B alone at {rate_b:.2f} req/s for {args.alone_duration:.0f} s")
            phases["alone"] = rig.open_loop(c.url, "alone", {"B": rate_b}, args.alone_duration,
                                            logs["tenants"])
            _say_phase(say, "alone", phases["alone"])
            say(f"mixed, two tenants: A {rates['A']:.1f} + B {rate_b:.2f} req/s for {args.duration:.0f} s")
            phases["mixed"] = rig.open_loop(c.url, "mixed", rates, args.duration, logs["tenants"])
            _say_phase(say, "mixed", phases["mixed"])
        say("coordinator with both keys in one tenant (FIFO baseline)")
        with coordinator(one_tenant, logs["one_tenant"]) as c:
            pids["coordinator"] = c.pid
            say(f"mixed, one tenant: A {rates['A']:.1f} + B {rate_b:.2f} req/s for {args.duration:.0f} s")
            phases["baseline"] = rig.open_loop(c.url, "baseline", rates, args.duration, logs["one_tenant"])
            _say_phase(say, "baseline", phases["baseline"])

    figures = _figures(args, phases, capacity=capacity, nominal=nominal, service_s=service_s, cost=cost,
                       budget=budget, max_queue=max_queue, rates=rates)
    figures["capacity_cpu_cores"] = capacity_cpu
    out = write_report(NAME, figures, _markdown(figures))
    _plot(figures, out / "fairness.png")
    say(f"report: {out / 'report.md'}")
    final_json({k: v for k, v in figures.items() if k not in ("phases", "parameters", "capacity_cpu_cores")})


def _say_phase(say: Progress, name: str, phase: dict[str, Any]) -> None:
    for t, s in phase["tenants"].items():
        say(f"  {name} {t}: offered {s['offered_rps']} req/s, goodput {s['goodput_rps']} req/s, TTFT p50 "
            f"{s['ttft_p50_ms']} ms p90 {s['ttft_p90_ms']} ms, 429 {s['http_429']}, 503 {s['http_503']}, "
            f"errors {s['errors']}, admission wait p90 {s['ttft_breakdown']['admission_wait']['p90_ms']} ms")
    say(f"  {name}: cores used {phase['cpu_cores']}")


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _figures(args: argparse.Namespace, phases: dict[str, Any], *, capacity: float, nominal: float,
             service_s: float, cost: int, budget: int, max_queue: int,
             rates: dict[str, float]) -> dict[str, Any]:
    alone_b = phases["alone"]["tenants"]["B"]
    weights = {"A": 1.0, "B": 1.0}
    per_run: dict[str, Any] = {}
    # What the engines delivered under these very arrivals through one FIFO line (the baseline run):
    # the closed-loop capacity is measured with another load and drifts by 10-20 % between runs on a
    # small machine, which would show up as a tenant "over" or "under" its share.
    delivered = sum(phases["baseline"]["tenants"][t]["goodput_rps"] for t in ("A", "B"))
    for run in ("mixed", "baseline"):
        tenants = phases[run]["tenants"]
        shares = max_min_shares({t: tenants[t]["offered_rps"] for t in ("A", "B")}, weights, delivered)
        per_run[run] = {
            "b_ttft_p90_ratio": _ratio(tenants["B"]["ttft_p90_ms"], alone_b["ttft_p90_ms"]),
            "shares_rps": {t: round(v, 3) for t, v in shares.items()},
            "goodput_vs_share": {t: _ratio(tenants[t]["goodput_rps"], shares[t]) for t in ("A", "B")},
        }
    mixed = per_run["mixed"]
    ttft_ok = mixed["b_ttft_p90_ratio"] is not None and mixed["b_ttft_p90_ratio"] <= TTFT_TARGET
    share_ok = all(r is not None and abs(r - 1) <= SHARE_TOLERANCE
                   for r in mixed["goodput_vs_share"].values())
    b_mixed = phases["mixed"]["tenants"]["B"]["ttft_breakdown"]
    b_alone = alone_b["ttft_breakdown"]
    growth = {p: round((b_mixed[p]["mean_ms"] or 0.0) - (b_alone[p]["mean_ms"] or 0.0), 1) for p in PARTS}
    return {
        "benchmark": NAME, "quick": args.quick,
        "capacity_rps": round(capacity, 3), "nominal_rps": round(nominal, 3),
        "delivered_rps": round(delivered, 3),
        "mixed_vs_baseline_total": _ratio(
            sum(phases["mixed"]["tenants"][t]["goodput_rps"] for t in ("A", "B")), delivered),
        "offered_a_rps": round(rates["A"], 3), "offered_b_rps": round(rates["B"], 3),
        "b_alone_ttft_p50_ms": alone_b["ttft_p50_ms"], "b_alone_ttft_p90_ms": alone_b["ttft_p90_ms"],
        "b_mixed_ttft_p50_ms": phases["mixed"]["tenants"]["B"]["ttft_p50_ms"],
        "b_mixed_ttft_p90_ms": phases["mixed"]["tenants"]["B"]["ttft_p90_ms"],
        "b_ttft_p90_ratio": mixed["b_ttft_p90_ratio"],
        "baseline_b_ttft_p90_ratio": per_run["baseline"]["b_ttft_p90_ratio"],
        "goodput_vs_share_a": mixed["goodput_vs_share"]["A"],
        "goodput_vs_share_b": mixed["goodput_vs_share"]["B"],
        "baseline_goodput_vs_share_a": per_run["baseline"]["goodput_vs_share"]["A"],
        "baseline_goodput_vs_share_b": per_run["baseline"]["goodput_vs_share"]["B"],
        "mixed_429": {t: phases["mixed"]["tenants"][t]["http_429"] for t in ("A", "B")},
        "mixed_503": {t: phases["mixed"]["tenants"][t]["http_503"] for t in ("A", "B")},
        "errors": sum(s["errors"] for p in phases.values() for s in p["tenants"].values()),
        "b_ttft_growth_mean_ms": growth, "b_ttft_dominant_growth": max(growth, key=lambda p: growth[p]),
        "ttft_target_met": ttft_ok, "share_target_met": share_ok, "targets_met": ttft_ok and share_ok,
        "parameters": {
            "engines": args.engines, "slots": args.slots, "ttft_s": args.ttft_s,
            "decode_s_per_token": args.decode_s, "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens, "spread_tokens": round(args.spread * args.max_tokens),
            "stream_interval": args.stream_interval, "request_tokens": cost, "service_s": round(service_s, 3),
            "engine_budget_tokens": budget, "max_queue": max_queue, "queue_timeout_s": args.queue_timeout,
            "load_x_capacity": args.load, "ratio": args.ratio, "capacity_duration_s": args.capacity_duration,
            "alone_duration_s": args.alone_duration, "mixed_duration_s": args.duration,
            "warmup_s": args.warmup},
        "runs": per_run, "phases": phases,
    }


def _markdown(f: dict[str, Any]) -> str:
    p, ph = f["parameters"], f["phases"]
    out_tokens = (f"{p['max_tokens'] - p['spread_tokens']}-{p['max_tokens'] + p['spread_tokens']} (uniform)"
                  if p["spread_tokens"] else str(p["max_tokens"]))
    rows = []
    for label, run, tenant in (("B alone", "alone", "B"), ("mixed, tenants: A", "mixed", "A"),
                               ("mixed, tenants: B", "mixed", "B"), ("mixed, one tenant: A", "baseline", "A"),
                               ("mixed, one tenant: B", "baseline", "B")):
        s = ph[run]["tenants"][tenant]
        share = f["runs"].get(run, {}).get("shares_rps", {}).get(tenant)
        vs = f["runs"].get(run, {}).get("goodput_vs_share", {}).get(tenant)
        cells = [label, s["offered_rps"], s["goodput_rps"], "-" if share is None else share,
                 "-" if vs is None else vs, s["ttft_p50_ms"], s["ttft_p90_ms"], s["ttft_p99_ms"], s["ok"],
                 s["http_429"], s["http_503"], s["errors"]]
        rows.append("| " + " | ".join(str(c) for c in cells) + " |")
    parts = []
    for label, run in (("B alone", "alone"), ("B mixed, tenants", "mixed"),
                       ("B mixed, one tenant", "baseline")):
        b = ph[run]["tenants"]["B"]["ttft_breakdown"]
        parts.append(f"| {label} | {b['requests']} | " + " | ".join(
            f"{b[x]['mean_ms']} / {b[x]['p90_ms']}" for x in PARTS) + " |")
    cpu_runs = [("capacity", f.get("capacity_cpu_cores") or {})] + [
        (run, ph[run]["cpu_cores"] or {}) for run in ("alone", "mixed", "baseline")]
    cpu_names = sorted({n for _, c in cpu_runs for n in c}, key=lambda n: (n == "machine_busy", n))
    cpu_rows = ["| " + " | ".join([run, *(str(c.get(n, "-")) for n in cpu_names)]) + " |"
                for run, c in cpu_runs]
    adm = []
    for label, run in (("mixed, tenants", "mixed"), ("mixed, one tenant", "baseline")):
        a = ph[run]["admission"]
        adm.append(f"| {label} | {a['queue_wait_mean_ms']} | {a['queue_wait_p90_le_s']} | "
                   f"{json.dumps(a['tenants'], sort_keys=True)} |")
    return "\n".join([
        "# Fairness between tenants: a light tenant next to one offering 10x its load", "",
        f"One coordinator process, {p['engines']} simulated engines x {p['slots']} slots of the mean request "
        f"({p['ttft_s'] * 1000:g} ms TTFT + {p['max_tokens'] - 1} x {p['decode_s_per_token'] * 1000:g} ms "
        f"decode = {p['service_s']} s), requests of {p['prompt_tokens']} prompt ids + {out_tokens} output "
        f"tokens (`ignore_eos`), streamed {p['stream_interval']} tokens per chunk, each engine's budget "
        f"{p['engine_budget_tokens']} tokens ({p['slots']} x {p['request_tokens']}), "
        f"max_queue {p['max_queue']}, queue_timeout_s {p['queue_timeout_s']:g}. Capacity (closed loop, same "
        f"run) {f['capacity_rps']} req/s (nominal {f['nominal_rps']}). Offered: A {f['offered_a_rps']} + B "
        f"{f['offered_b_rps']} req/s ({p['load_x_capacity']:g} x capacity, {p['ratio']:g}:1), Poisson, "
        f"{p['mixed_duration_s']:g} s per mixed phase, {p['alone_duration_s']:g} s for B alone, the first "
        f"{p['warmup_s']:g} s left out. Shares: max-min fair shares, from the arrivals sent, of what the "
        f"engines delivered to the same arrivals through one FIFO line (the one-tenant run: "
        f"{f['delivered_rps']} req/s); the two-tenant run delivered {f['mixed_vs_baseline_total']} of that "
        f"in total.", "",
        "| phase | offered req/s | goodput req/s | share req/s | goodput / share | TTFT p50 ms | p90 ms | "
        "p99 ms | ok | 429 | 503 | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|", *rows, "",
        f"B's TTFT p90, mixed / alone: **{f['b_ttft_p90_ratio']}** with tenants (target <= {TTFT_TARGET}), "
        f"{f['baseline_b_ttft_p90_ratio']} with one tenant. Goodput / share with tenants: A "
        f"**{f['goodput_vs_share_a']}**, B **{f['goodput_vs_share_b']}** (target within "
        f"{SHARE_TOLERANCE:.0%}); "
        f"with one tenant: A {f['baseline_goodput_vs_share_a']}, B {f['baseline_goodput_vs_share_b']}. "
        f"Targets met: TTFT {f['ttft_target_met']}, shares {f['share_target_met']}.", "",
        "Where B's TTFT goes (mean / p90 ms; from the coordinator's request log: render, admission wait, "
        "engine to its first chunk, first derender, outside the coordinator = client TTFT minus the "
        "coordinator's first event):", "",
        "| run | requests | " + " | ".join(PARTS) + " |", "|---|---|" + "---|" * len(PARTS), *parts, "",
        f"Growth of B's mean TTFT from alone to mixed, per part (ms): {f['b_ttft_growth_mean_ms']}; largest: "
        f"{f['b_ttft_dominant_growth']}.", "",
        "B's admission wait in the mixed run with tenants, per quarter of its requests by output tokens: "
        + "; ".join(f"{q['tokens'][0]}-{q['tokens'][1]} tokens p50 {q['p50_ms']} ms p90 {q['p90_ms']} ms"
                    for q in ph["mixed"]["tenants"]["B"]["ttft_breakdown"]["admission_wait_by_size"])
        + ".", "",
        "Admission during the mixed phases (coordinator /metrics; wait over all tenants; per-tenant admitted "
        "tokens and refusals by reason):", "",
        "| run | wait mean ms | wait p90 bucket (s) | per tenant |", "|---|---|---|---|", *adm, "",
        "CPU cores used per phase (CPU seconds / wall seconds; `machine_busy` counts every process on the "
        "machine, so what exceeds the rest is other work):", "",
        "| phase | " + " | ".join(cpu_names) + " |", "|---|" + "---|" * len(cpu_names), *cpu_rows, "",
        "![fairness](fairness.png)", ""])


def _plot(f: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ph = f["phases"]
    fig, (cdf, bars, parts) = plt.subplots(1, 3, figsize=(16, 4.6))
    for label, run, color in (("B alone", "alone", "tab:green"), ("B mixed, tenants", "mixed", "tab:blue"),
                              ("B mixed, one tenant (FIFO)", "baseline", "tab:red")):
        xs = [x * 1000 for x in ph[run]["tenants"]["B"]["ttft_s"]]
        if xs:
            cdf.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label, color=color)
    if f["b_alone_ttft_p90_ms"]:
        cdf.axvline(TTFT_TARGET * f["b_alone_ttft_p90_ms"], color="black", linestyle="--",
                    label=f"{TTFT_TARGET} x B alone p90")
    cdf.axhline(0.9, color="grey", linestyle=":")
    cdf.set_xscale("log")
    cdf.set_xlabel("B's TTFT (ms, client side)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("B's TTFT")
    cdf.legend(fontsize=8)

    width = 0.38
    for i, (run, label, color) in enumerate((("mixed", "tenants", "tab:blue"),
                                             ("baseline", "one tenant (FIFO)", "tab:red"))):
        xs = [j + (i - 0.5) * width for j in range(2)]
        bars.bar(xs, [ph[run]["tenants"][t]["goodput_rps"] for t in ("A", "B")], width, label=label,
                 color=color)
        shares = f["runs"][run]["shares_rps"]
        for x, t in zip(xs, ("A", "B"), strict=True):
            bars.hlines(shares[t], x - width / 2, x + width / 2, color="black",
                        label="max-min share" if i == 0 and t == "A" else None)
    bars.set_xticks([0, 1], ["A", "B"])
    bars.set_ylabel("goodput (completed req/s)")
    bars.set_title(f"goodput per tenant (delivered through one line: {f['delivered_rps']} req/s)")
    bars.legend(fontsize=8)

    # Linear scale for alone vs tenants (stacked parts only add up on a linear axis); the FIFO
    # baseline, an order of magnitude longer, goes in the title.
    runs = [("alone", "B alone"), ("mixed", "B mixed, tenants")]
    bottom = [0.0] * len(runs)
    colors = ("tab:purple", "tab:orange", "tab:green", "tab:cyan", "tab:grey")
    for part, color in zip(PARTS, colors, strict=True):
        heights = [ph[r]["tenants"]["B"]["ttft_breakdown"][part]["mean_ms"] or 0.0 for r, _ in runs]
        parts.bar([lab for _, lab in runs], heights, bottom=bottom, label=part, color=color)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    base = ph["baseline"]["tenants"]["B"]["ttft_breakdown"]
    total = sum(base[p]["mean_ms"] or 0.0 for p in PARTS)
    parts.set_ylabel("mean ms")
    parts.set_title(f"where B's TTFT goes (mean); one tenant: {total:.0f} ms,\n"
                    f"{base['admission_wait']['mean_ms']} ms of it admission wait", fontsize=10)
    parts.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
