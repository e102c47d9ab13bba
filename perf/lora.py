"""Many LoRA adapters on one fleet: residency-aware routing against round robin with load on demand.

Why: a request for an adapter its engine does not hold waits for a load (reading the weights, a LoRA
slot) before its first token, and an engine runs at most ``--max-loras`` adapters at once (vLLM defers
the others). Round robin spreads every adapter over every engine, so engines keep loading and
unloading; the coordinator's lora scorer keeps each adapter where it is held (docs/lora.md).

Set-up, one run: ``--engines`` simulated engines (vLLM's adapter API and ``max_loras`` deferral,
``--load-ms`` per load, ``--max-loras`` slots each; docs/simulator.md) in a child process, a real render
sidecar (unless ``--render-url``), and one coordinator process per policy, each with fresh engines:
``affinity`` (the default: prefix + load + lora scorers) and ``round_robin`` (the same loader, so
adapters still load on demand, but placement ignores residency). Load: Poisson arrivals at ``--rate``
for ``--duration`` seconds; each request names one of ``--adapters`` adapters drawn from a Zipf law
(exponent ``--zipf``; the same seeded sequence for both policies) and sends that adapter's shared
prompt prefix (``--prefix-tokens``, as a system prompt per fine-tune) plus a unique tail, streamed.

Reported per policy: adapter loads per 1,000 requests (the coordinator's
``coordinator_lora_loads_total{result="loaded"}``; the engines' own weight reads beside it), TTFT
p50/p90/p99 at the client, and the engines' prefix-cache hit rate against the oracle's (every request
after its adapter's first finds the whole shared prefix). Targets (docs/benchmarks.md): loads ≤ 0.2 x
round robin's, TTFT p90 ≥ 3 x better, hit rate within 10 % of the oracle's.

    python -m perf.lora [--engines 8] [--adapters 50] [--rate 25] [--duration 40] [--render-url URL] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from perf import _report
from perf._procs import SERVED, CoordinatorProcess, render_config, render_sidecars, sim_engines
from perf._report import Progress, final_json, pct, save_figure, write_report

NAME = "lora"
POLICIES = ("affinity", "round_robin")
TARGET_LOADS = 0.2      # residency's loads per 1,000 requests at most this times round robin's
TARGET_TTFT = 3.0       # round robin's TTFT p90 at least this times residency's
TARGET_HIT = 0.9        # residency's prefix hit rate at least this times the oracle's
BLOCK = 16              # the simulated engines' KV block (the coordinator's prefix.block_size too)


@dataclass
class Outcome:
    adapter: str
    ttft_s: float | None
    status: int


@dataclass
class Run:
    policy: str
    seconds: float
    outcomes: list[Outcome] = field(default_factory=list)
    loads: float = 0.0
    engine_weight_reads: int = 0
    hits: float = 0.0
    queries: float = 0.0
    deferred_peak: int = 0

    def summary(self, oracle_hit_rate: float) -> dict[str, Any]:
        ok = [o for o in self.outcomes if o.status == 200 and o.ttft_s is not None]
        ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
        n = len(self.outcomes)
        hit_rate = self.hits / self.queries if self.queries else 0.0
        return {"policy": self.policy, "requests": n, "ok": len(ok),
                "failed": n - len(ok), "seconds": round(self.seconds, 1),
                "loads": self.loads, "loads_per_1000": round(1000 * self.loads / max(1, n), 1),
                "engine_weight_reads_per_1000": round(1000 * self.engine_weight_reads / max(1, n), 1),
                "ttft_p50_ms": round(pct(ttft, 50) * 1000, 1), "ttft_p90_ms": round(pct(ttft, 90) * 1000, 1),
                "ttft_p99_ms": round(pct(ttft, 99) * 1000, 1),
                "prefix_hit_rate": round(hit_rate, 3), "oracle_hit_rate": round(oracle_hit_rate, 3)}


def zipf_sequence(n: int, adapters: int, exponent: float, seed: int) -> list[int]:
    """``n`` adapter indices, index ``k`` drawn with weight 1 / (k + 1) ** exponent."""
    weights = [1.0 / (k + 1) ** exponent for k in range(adapters)]
    return random.Random(seed).choices(range(adapters), weights=weights, k=n)


def prefix_of(adapter: int, tokens: int) -> list[int]:
    rng = random.Random(10_000 + adapter)
    return [rng.randrange(1000, 40_000) for _ in range(tokens)]


def body(adapter: int, i: int, prefix_tokens: int, tail_tokens: int, max_tokens: int) -> dict[str, Any]:
    tail = [40_000 + (i * 7 + j) % 9000 for j in range(tail_tokens)]
    return {"model": f"adapter-{adapter}", "prompt": prefix_of(adapter, prefix_tokens) + tail,
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}


def oracle_hit_rate(sequence: list[int], prefix_tokens: int, tail_tokens: int, warmup: int = 0) -> float:
    """Every request after its adapter's first finds the adapter's whole shared prefix (full blocks);
    counted over the requests after the first ``warmup`` (which still make adapters seen)."""
    seen: set[int] = set(sequence[:warmup])
    hits = 0
    measured = sequence[warmup:]
    for a in measured:
        if a in seen:
            hits += prefix_tokens // BLOCK * BLOCK
        seen.add(a)
    return hits / (max(1, len(measured)) * (prefix_tokens + tail_tokens))


async def one(client: httpx.AsyncClient, url: str, payload: dict[str, Any], out: list[Outcome]) -> None:
    sent = time.monotonic()
    first: float | None = None
    status = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=payload) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.monotonic()
                if '"error"' in line:
                    status = -1
    except httpx.HTTPError:
        status = 0
    out.append(Outcome(payload["model"], None if first is None else first - sent, status))


async def drive(url: str, bodies: list[dict[str, Any]], rate: float,
                seed: int) -> tuple[list[Outcome], float]:
    """Open loop: Poisson arrivals at ``rate``, one body each, in order."""
    out: list[Outcome] = []
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        t0 = time.monotonic()
        at = 0.0
        tasks = []
        for payload in bodies:
            at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            tasks.append(asyncio.create_task(one(client, url, payload, out)))
        await asyncio.gather(*tasks)
        return out, time.monotonic() - t0


def metric_sum(text: str, family: str, **labels: str) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in (family, f"{family}_total") and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def engine_configs(n: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    return [{"model": SERVED, "seed": i, "enable_lora": True, "max_loras": args.max_loras,
             "lora_load_s": args.load_ms / 1000, "decode_s_per_token": args.decode_ms / 1000,
             "prefill_s_per_token": 0.0001, "stream_interval": args.max_tokens, "block_size": BLOCK,
             "capacity_blocks": 65536, "max_logprobs": 20} for i in range(n)]


def coordinator_config(policy: str, render_url: str, urls: list[str], adapters: int) -> dict[str, Any]:
    named = [{"name": f"adapter-{k}", "path": f"sim:adapter-{k}"} for k in range(adapters)]
    return {"render": render_config([render_url]),
            "models": [{"name": SERVED, "vocab_size": 49152, "max_model_len": 2048, "adapters": named}],
            "engines": [{"url": u} for u in urls], "engine_client": {"health_interval_s": 1.0},
            "scheduling": {"policy": policy, "prefix": {"block_size": BLOCK}},
            "resilience": {"retries": 2}}


def run_policy(policy: str, args: argparse.Namespace, render_url: str, sequence: list[int],
               say: Progress, out_dir: Path) -> Run:
    bodies = [body(a, i, args.prefix_tokens, args.tail_tokens, args.max_tokens)
              for i, a in enumerate(sequence)]
    warm, measured = bodies[:args.warmup], bodies[args.warmup:]
    with ExitStack() as stack:
        urls, _ = stack.enter_context(sim_engines(engine_configs(args.engines, args)))
        config = coordinator_config(policy, render_url, urls, args.adapters)
        log_path = out_dir / f"coordinator-{policy}.log"
        coord = stack.enter_context(CoordinatorProcess(config, log_path=log_path))
        say(f"{policy}: {len(warm)} warm-up requests, then {len(measured)} measured, at {args.rate}/s "
            f"over {args.engines} engines")
        asyncio.run(drive(coord.url, warm, args.rate, args.seed + 1))
        before = counts(coord.url, urls)
        outcomes, seconds = asyncio.run(drive(coord.url, measured, args.rate, args.seed))
        after = counts(coord.url, urls)
        delta = {k: after[k] - before[k] for k in after}
        return Run(policy, seconds, outcomes, loads=delta["loads"], engine_weight_reads=int(delta["reads"]),
                   hits=delta["hits"], queries=delta["queries"])


def counts(coord_url: str, urls: list[str]) -> dict[str, float]:
    """Loads the coordinator asked for; the engines' own weight reads and prefix-cache tokens."""
    text = httpx.get(f"{coord_url}/metrics", timeout=30).text
    out = {"loads": metric_sum(text, "coordinator_lora_loads", result="loaded"), "reads": 0.0, "hits": 0.0,
           "queries": 0.0}
    for u in urls:
        state = httpx.get(f"{u}/sim/state", timeout=30).json()
        out["reads"] += float(state["loras"]["weight_loads"])
        out["hits"] += float(state["prefix_cache"]["hits"])
        out["queries"] += float(state["prefix_cache"]["queries"])
    return out


def plot(runs: dict[str, Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for policy, run in runs.items():
        ttft = sorted(o.ttft_s * 1000 for o in run.outcomes if o.ttft_s is not None)
        if ttft:
            a.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=policy,
                   color={"affinity": "tab:blue", "round_robin": "tab:orange"}.get(policy))
    a.set_xscale("log")
    a.set_xlabel("TTFT (ms, log)")
    a.set_ylabel("fraction of requests")
    a.set_title("TTFT CDF")
    a.legend()
    colors = {"affinity": "tab:blue", "round_robin": "tab:orange"}
    for k, (policy, run) in enumerate(runs.items()):
        n = max(1, len(run.outcomes))
        b.bar([2 * k, 2 * k + 0.8], [1000 * run.loads / n, 1000 * run.engine_weight_reads / n], width=0.7,
              color=colors.get(policy, "tab:gray"))
    b.set_xticks([x for k in range(len(runs)) for x in (2 * k, 2 * k + 0.8)],
                 [f"{p}\n{what}" for p in runs for what in ("loads", "weight reads")], fontsize=8)
    b.set_ylabel("per 1,000 requests")
    b.set_title("adapter loads")
    save_figure(fig, path)


def headline(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    res, rr = summaries["affinity"], summaries["round_robin"]
    loads_ratio = res["loads_per_1000"] / rr["loads_per_1000"] if rr["loads_per_1000"] else float("nan")
    ttft_ratio = rr["ttft_p90_ms"] / res["ttft_p90_ms"] if res["ttft_p90_ms"] else float("nan")
    oracle = res["oracle_hit_rate"]
    hit_vs_oracle = res["prefix_hit_rate"] / oracle if oracle else float("nan")
    failed = res["failed"] + rr["failed"]
    return {"benchmark": NAME, "loads_ratio": round(loads_ratio, 3), "ttft_p90_ratio": round(ttft_ratio, 2),
            "hit_vs_oracle": round(hit_vs_oracle, 3), "failed": failed,
            "targets_met": bool(loads_ratio <= TARGET_LOADS and ttft_ratio >= TARGET_TTFT
                                and hit_vs_oracle >= TARGET_HIT and failed == 0)}


HEADER = ("| policy | requests | failed | loads / 1k | engine weight reads / 1k | TTFT p50 ms | p90 ms "
          "| p99 ms | prefix hit rate | oracle |\n|---|---|---|---|---|---|---|---|---|---|")


def markdown(args: argparse.Namespace, summaries: dict[str, dict[str, Any]], head: dict[str, Any]) -> str:
    rows = "\n".join(
        f"| {s['policy']} | {s['requests']} | {s['failed']} | {s['loads_per_1000']} | "
        f"{s['engine_weight_reads_per_1000']} | {s['ttft_p50_ms']} | {s['ttft_p90_ms']} | "
        f"{s['ttft_p99_ms']} | "
        f"{s['prefix_hit_rate']} | {s['oracle_hit_rate']} |" for s in summaries.values())
    return f"""# LoRA routing: residency-aware vs round robin

{args.engines} simulated engines (max_loras {args.max_loras}, {args.load_ms:g} ms per load, the engine stalled
meanwhile), {args.adapters} adapters drawn by Zipf({args.zipf}), {args.rate} requests/s: {args.warmup} warm-up
requests, then {args.duration:g} s measured; prompts of {args.prefix_tokens} shared + {args.tail_tokens} own
tokens, {args.max_tokens} output tokens.

{HEADER}
{rows}

- loads, residency / round robin: **{head['loads_ratio']}** (target ≤ {TARGET_LOADS})
- TTFT p90, round robin / residency: **{head['ttft_p90_ratio']}** (target ≥ {TARGET_TTFT})
- prefix hit rate, residency / oracle: **{head['hit_vs_oracle']}** (target ≥ {TARGET_HIT})
- targets met: **{head['targets_met']}**

![TTFT and loads](lora.png)
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=50)
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--rate", type=float, default=25.0, help="requests per second (Poisson)")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per policy")
    ap.add_argument("--load-ms", type=float, default=250.0, help="simulated ms to load one adapter")
    ap.add_argument("--decode-ms", type=float, default=4.0, help="simulated ms per output token")
    ap.add_argument("--prefix-tokens", type=int, default=128)
    ap.add_argument("--tail-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=250, help="requests sent first and not measured")
    ap.add_argument("--render-url", help="a running render sidecar instead of starting one")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 engines, 6 adapters, 3 s")
    args = ap.parse_args(argv)
    if args.quick:
        args.engines, args.adapters, args.duration, args.rate = 2, 6, 3.0, 8.0
        args.max_loras, args.warmup = 2, 8
    say = Progress(NAME)
    out_dir = _report.OUT_ROOT / NAME
    out_dir.mkdir(parents=True, exist_ok=True)
    total = args.warmup + int(args.rate * args.duration)
    sequence = zipf_sequence(total, args.adapters, args.zipf, args.seed)
    oracle = oracle_hit_rate(sequence, args.prefix_tokens, args.tail_tokens, args.warmup)
    runs: dict[str, Run] = {}
    with ExitStack() as stack:
        render_url = args.render_url
        if render_url is None:
            render_url = str(stack.enter_context(render_sidecars(1, say, log_dir=out_dir))[0].url)
        for policy in POLICIES:
            runs[policy] = run_policy(policy, args, render_url, sequence, say, out_dir)
            s = runs[policy].summary(oracle)
            say(f"{policy}: loads/1k {s['loads_per_1000']}, TTFT p90 {s['ttft_p90_ms']} ms, "
                f"hit rate {s['prefix_hit_rate']} (oracle {s['oracle_hit_rate']}), failed {s['failed']}")
    summaries = {p: r.summary(oracle) for p, r in runs.items()}
    head = headline(summaries)
    plot(runs, out_dir / "lora.png")
    figures = {**head, "quick": args.quick, "runs": list(summaries.values()),
               "config": {k: v for k, v in vars(args).items()}}
    write_report(NAME, figures, markdown(args, summaries, head))
    final_json(head)


if __name__ == "__main__":
    main()
