"""One token budget for a fleet of coordinators: what the Redis fleet ledger holds engines to.

Why: every coordinator process counts only what it admitted itself, so N replicas in front of the
same engines give each engine up to N times its budget, and the engines queue (and, on real vLLM,
preempt) what admission was meant to keep out. ``admission.fleet.backend: redis`` claims every
request over all processes (docs/operations.md, "Fleet budget").

Set-up, all in one run: ``--replicas`` coordinator processes (``python -m coordinator``), one real
``redis-server``, one render sidecar (real vLLM unless ``--render-url``), ``--engines`` simulated
engines in a child process with a fixed cost (``ttft_s`` + ``decode_s_per_token`` per token, at most
``--slots`` running at once, ``--stream-interval`` tokens per chunk; docs/simulator.md). Every
request costs the same: ``prompt_tokens`` token ids + ``max_tokens`` with ``ignore_eos``. Each
engine's budget is ``slots`` x that cost, so a single coordinator never sends an engine more than it
can run. A sampler reads every engine's own
``/sim/state`` every 10 ms: the requests it holds (running + waiting) x the cost is what it holds.

Phases:

1. *Capacity*: the Redis fleet, closed loop with many clients per replica; capacity = completed
   requests per second after a warm-up (also shown against the engines' nominal rate, slots x
   engines / service time).
2. *Overload, Redis fleet*: Poisson arrivals at ``--overload`` x capacity, spread over the replicas.
   Targets: no engine ever holds more than its budget + one request's tokens; goodput (requests
   completed in the window after a warm-up, per second) >= 0.95 of capacity.
3. *Overload, local ledgers*: the same arrivals with ``backend: local``: the overshoot the fleet
   ledger removes (up to ``replicas`` x the budget).

    python -m perf.fleet_admission [--replicas 3] [--duration 20] [--overload 3] [--render-url URL] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from perf._procs import CoordinatorProcess, RedisServer, render_sidecar, sim_engines
from perf._report import Progress, final_json, save_figure, write_report

NAME = "fleet_admission"
SERVED = "smollm2-135m-instruct"
VOCAB_SIZE = 49152
GOODPUT_TARGET = 0.95


class EngineSampler:
    """The most each engine held at once (running + waiting requests), read from the engines."""

    def __init__(self, urls: list[str], every_s: float = 0.01) -> None:
        self.urls = urls
        self.every_s = every_s
        self.peak = dict.fromkeys(urls, 0)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set():
                for url in self.urls:
                    state = client.get(f"{url}/sim/state").json()
                    self.peak[url] = max(self.peak[url], len(state["running"]) + len(state["waiting"]))
                self.samples += 1
                self._stop.wait(self.every_s)

    def __enter__(self) -> EngineSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def config(render_url: str, engines: list[str], budget: int, fleet: dict[str, Any]) -> dict[str, Any]:
    return {"render": {"url": render_url},
            "engines": [{"url": u, "max_inflight_tokens": budget} for u in engines],
            "models": [{"name": SERVED, "vocab_size": VOCAB_SIZE}],
            "admission": {"max_queue": 64, "queue_timeout_s": 10, "fleet": fleet},
            "engine_client": {"max_connections": 1024}}


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any], out: list[dict[str, Any]]) -> None:
    """One streamed completion; status 200 only when every chunk and ``[DONE]`` arrived (-1: the
    stream broke or ended with an error frame; 0: no answer)."""
    sent = time.monotonic()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            status = r.status_code
            if status == 200:
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                if not lines or lines[-1] != "data: [DONE]" or any('"error"' in ln for ln in lines):
                    status = -1
            else:
                await r.aread()
    except httpx.HTTPError:
        status = 0
    out.append({"sent": sent, "done": time.monotonic(), "status": status})


async def closed_loop(urls: list[str], body: dict[str, Any], clients: int, seconds: float
                      ) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    stop = time.monotonic() + seconds

    async def worker(url: str) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            while time.monotonic() < stop:
                await _one(client, url, body, out)

    await asyncio.gather(*(worker(urls[i % len(urls)]) for i in range(clients)))
    return out


async def warm_up(urls: list[str], body: dict[str, Any]) -> None:
    """One request through each coordinator before anything is measured: a process's first request
    pays for its first connections to the render sidecar and the engines. On a loaded 2-core machine
    that took seconds, and a capacity window that opened with those requests saw no completion."""
    out: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*(_one(client, url, body, out) for url in urls))
    failed = [o for o in out if o["status"] != 200]
    if failed:
        raise RuntimeError(f"a coordinator failed its warm-up request: {failed}")


async def open_loop(urls: list[str], body: dict[str, Any], rate: float, seconds: float, seed: int
                    ) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    tasks = []
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        start = time.monotonic()
        t, i = 0.0, 0
        while t < seconds:
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            tasks.append(asyncio.create_task(_one(client, urls[i % len(urls)], body, out)))
            t += rng.expovariate(rate)
            i += 1
        await asyncio.gather(*tasks)
    return out


def completed_per_s(outs: list[dict[str, Any]], window: tuple[float, float]) -> float:
    """Requests that completed inside the window, per second. By completion time, not arrival: at 3x
    the queues still hold many requests when arrivals stop, and counting them by arrival would credit
    the window with work done after it."""
    lo, hi = window
    return sum(1 for o in outs if o["status"] == 200 and lo <= o["done"] < hi) / (hi - lo)


def phase(coords: list[str], engines: list[str], body: dict[str, Any], *, rate: float, seconds: float,
          warmup_s: float, seed: int) -> dict[str, Any]:
    with EngineSampler(engines) as sampler:
        start = time.monotonic()
        outs = asyncio.run(open_loop(coords, body, rate, seconds, seed))
    window = (start + warmup_s, start + seconds)
    return {"goodput_rps": round(completed_per_s(outs, window), 3),
            "offered_rps": round(rate, 3), "sent": len(outs),
            "ok": sum(1 for o in outs if o["status"] == 200),
            "refused": sum(1 for o in outs if o["status"] in (429, 503)),
            "errors": sum(1 for o in outs if o["status"] not in (200, 429, 503)),
            "peak_requests": dict(sampler.peak), "samples": sampler.samples}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--slots", type=int, default=4, help="requests an engine runs at once")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--decode-s", type=float, default=0.02,
                    help="seconds per output token (at 0.01 a 2-core machine, not the fleet, limits goodput)")
    ap.add_argument("--ttft-s", type=float, default=0.05)
    ap.add_argument("--stream-interval", type=int, default=8,
                    help="tokens per streamed engine chunk (vLLM's --stream-interval); with 1 the 2-core "
                         "machine spent its time on derender and the engines' clocks slipped")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--overload", type=float, default=3.0)
    ap.add_argument("--render-url", default=None)
    ap.add_argument("--quick", action="store_true", help="a short smoke run (numbers not meaningful)")
    args = ap.parse_args(argv)
    if args.quick:
        # The capacity window must hold whole requests (1 s each): from 0.5 s to 3 s.
        args.duration, args.warmup, args.replicas = 6.0, 0.5, 2
    say = Progress(NAME)
    cost = args.prompt_tokens + args.max_tokens
    budget = args.slots * cost
    body = {"model": SERVED, "prompt": [random.Random(7).randrange(100, VOCAB_SIZE)
                                        for _ in range(args.prompt_tokens)],
            "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    sims = [{"model": SERVED, "seed": i, "ttft_s": args.ttft_s, "decode_s_per_token": args.decode_s,
             "max_concurrency": args.slots, "stream_interval": args.stream_interval}
            for i in range(args.engines)]
    with ExitStack() as stack:
        redis = RedisServer().start()
        stack.callback(redis.stop)
        render_url = stack.enter_context(render_sidecar(args.render_url, say))
        engines, _ = stack.enter_context(sim_engines(sims))
        results: dict[str, Any] = {}
        capacity = 0.0
        for backend in ("redis", "local"):
            fleet = {"backend": backend, "redis_url": redis.url, "namespace": uuid.uuid4().hex,
                     "expected_replicas": args.replicas}
            say(f"starting {args.replicas} coordinator processes ({backend} ledger)")
            with ExitStack() as coords_stack:
                cfg = config(render_url, engines, budget, fleet)
                coords = [coords_stack.enter_context(CoordinatorProcess(cfg)).url
                          for _ in range(args.replicas)]
                asyncio.run(warm_up(coords, body))
                if backend == "redis":
                    say("capacity: closed loop through the fleet")
                    start = time.monotonic()
                    outs = asyncio.run(closed_loop(coords, body, 4 * args.slots * args.engines,
                                                   args.duration / 2))
                    capacity = completed_per_s(outs, (start + args.warmup, start + args.duration / 2))
                    say(f"capacity {capacity:.2f} req/s")
                    if capacity <= 0:
                        raise RuntimeError("no request completed in the capacity phase (see the coordinator "
                                           "and engine logs)")
                rate = args.overload * capacity
                say(f"overload: {rate:.1f} req/s for {args.duration:.0f} s ({backend} ledger)")
                results[backend] = phase(coords, engines, body, rate=rate, seconds=args.duration,
                                         warmup_s=args.warmup, seed=11)
                say(f"{backend}: {results[backend]}")
    held = {b: max(r["peak_requests"].values()) * cost for b, r in results.items()}
    service_s = args.ttft_s + (args.max_tokens - 1) * args.decode_s  # one request on a simulated engine
    figures: dict[str, Any] = {
        "benchmark": NAME, "quick": args.quick, "replicas": args.replicas, "engines": args.engines,
        "request_tokens": cost, "engine_budget_tokens": budget, "capacity_rps": round(capacity, 3),
        "nominal_rps": round(args.engines * args.slots / service_s, 3),
        "redis_peak_engine_tokens": held["redis"], "local_peak_engine_tokens": held["local"],
        "redis_within_budget": held["redis"] <= budget + cost,
        "local_overshoot_x": round(held["local"] / budget, 2),
        "redis_goodput_ratio": round(results["redis"]["goodput_rps"] / capacity, 3) if capacity else None,
        "local_goodput_ratio": round(results["local"]["goodput_rps"] / capacity, 3) if capacity else None,
        "redis_errors": results["redis"]["errors"], "local_errors": results["local"]["errors"],
        "phases": results,
    }
    ratio = figures["redis_goodput_ratio"]
    figures["targets_met"] = bool(figures["redis_within_budget"] and ratio is not None
                                  and ratio >= GOODPUT_TARGET and figures["redis_errors"] == 0)
    out = write_report(NAME, figures, _markdown(figures))
    _plot(figures, out / "fleet_admission.png")
    say(f"report: {out / 'report.md'}")
    final_json({k: v for k, v in figures.items() if k != "phases"})


def _markdown(f: dict[str, Any]) -> str:
    r, loc = f["phases"]["redis"], f["phases"]["local"]
    return "\n".join([
        "# Fleet admission: one budget over coordinator replicas", "",
        f"{f['replicas']} coordinator processes, {f['engines']} simulated engines, every request "
        f"{f['request_tokens']} tokens, each engine's budget {f['engine_budget_tokens']} tokens "
        f"(budget + one request = {f['engine_budget_tokens'] + f['request_tokens']}). Capacity through the "
        f"fleet: {f['capacity_rps']} req/s (engines' nominal rate {f['nominal_rps']} req/s); overload phases "
        f"at {r['offered_rps']} req/s.", "",
        "| ledger | most tokens an engine held | x budget | goodput / capacity | ok | refused | errors |",
        "|---|---|---|---|---|---|---|",
        f"| redis (fleet) | {f['redis_peak_engine_tokens']} | "
        f"{f['redis_peak_engine_tokens'] / f['engine_budget_tokens']:.2f} | {f['redis_goodput_ratio']} | "
        f"{r['ok']} | {r['refused']} | {r['errors']} |",
        f"| local (per process) | {f['local_peak_engine_tokens']} | {f['local_overshoot_x']} | "
        f"{f['local_goodput_ratio']} | {loc['ok']} | {loc['refused']} | {loc['errors']} |", "",
        f"Targets (redis): within budget + one request: {f['redis_within_budget']}; goodput >= "
        f"{GOODPUT_TARGET} of capacity: {f['redis_goodput_ratio']}; met: {f['targets_met']}.", "",
        "![peak held per engine](fleet_admission.png)", ""])


def _plot(f: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = ["redis (fleet)", "local (per process)"]
    values = [f["redis_peak_engine_tokens"], f["local_peak_engine_tokens"]]
    ax.bar(names, values, color=["tab:green", "tab:red"])
    ax.axhline(f["engine_budget_tokens"], color="black", linestyle="--", label="engine budget")
    ax.axhline(f["engine_budget_tokens"] + f["request_tokens"], color="grey", linestyle=":",
               label="budget + one request")
    ax.set_ylabel("most tokens one engine held (sampled at the engine)")
    ax.set_title(f"{f['replicas']} coordinators at {f['phases']['redis']['offered_rps']} req/s")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
