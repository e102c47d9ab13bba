"""What storing Responses costs a request, and whether chained turns still find their KV.

Why: with ``store`` (OpenAI's default) every answer is written to the store before it goes out, and a
follow-up naming ``previous_response_id`` reads the conversation back before render. Both sit on the
request's path, so they must cost little beside the rest (render, scheduling, the engine); and a
follow-up rebuilt from the store must render to the same tokens as the conversation sent whole, so
it lands on the engine holding its prefix.

Set-up, one run: ``--engines`` simulated engines (``--prefill-ms`` per uncached prompt token) in a
child process, the real render sidecar, and one coordinator process per variant with fresh engines:
``stateless`` (``store: false``; the client sends the whole conversation every turn: the baseline),
``sqlite`` (the default store, a file) and ``redis`` (a real ``redis-server``), the last two chaining
turns with ``previous_response_id``. Load: ``--conversations`` conversations at once (the
concurrency), each ``--turns`` turns in a row; ``--conversations`` x ``--turns`` requests per variant.

Reported per variant: request latency p50/p90 at the client; the store's own time per request (the
coordinator's ``coordinator_response_store_seconds``: every get and put, summed per request, and
each operation's p50 from the histogram); the engines' prefix-cache hit rate over follow-up turns
(their own counters) beside the oracle's (each follow-up finds its previous prompt's full blocks).
Targets (docs/benchmarks.md): store time per request p50 at most 2 ms for both stores; follow-up hit
rate at least 0.9 of the oracle's. The client-side p50 difference to ``stateless`` is reported too;
on a 2-core machine running everything it is mostly noise.

    python -m perf.responses_store [--engines 4] [--conversations 32] [--turns 31] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from perf import _report
from perf._procs import (
    CoordinatorProcess,
    RedisServer,
    render_config,
    render_sidecars,
    sidecar_pid,
    sim_cache_counts,
    sim_engines,
    tree_cpu_s,
)
from perf._report import Progress, final_json, pct, save_figure, write_report

NAME = "responses_store"
SERVED = "smollm2-135m-instruct"
VARIANTS = ("stateless", "sqlite", "redis")
TARGET_STORE_MS = 2.0   # the store's time per request, p50
TARGET_HIT = 0.9        # follow-ups' prefix hit rate over the oracle's
BLOCK = 16
OPENING = " ".join(f"Fact {i}: lighthouse number {i} stands on a rock and its lamp turns all night."
                   for i in range(12))


@dataclass
class Run:
    variant: str
    latencies: list[float] = field(default_factory=list)
    failed: int = 0
    hits: float = 0.0
    queries: float = 0.0
    oracle_hits: float = 0.0
    store: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    cpu_ms: dict[str, float] = field(default_factory=dict)   # CPU per answered request, by process

    def summary(self) -> dict[str, Any]:
        lat = self.latencies
        return {"variant": self.variant, "requests": len(lat) + self.failed, "failed": self.failed,
                "latency_p50_ms": round(pct(lat, 50) * 1000, 2),
                "latency_p90_ms": round(pct(lat, 90) * 1000, 2),
                "throughput_rps": round(len(lat) / self.seconds, 1) if self.seconds else 0.0,
                "followup_hit_rate": round(self.hits / self.queries, 3) if self.queries else 0.0,
                "oracle_hit_rate": round(self.oracle_hits / self.queries, 3) if self.queries else 0.0,
                **{f"cpu_ms_{k}": v for k, v in self.cpu_ms.items()}, **self.store}


async def conversation(client: httpx.AsyncClient, url: str, k: int, variant: str, args: argparse.Namespace,
                       run: Run, prompts: dict[int, list[int]]) -> None:
    """One conversation's turns in a row. ``prompts[k]``: its prompt lengths, turn by turn."""
    history: list[dict[str, Any]] = []
    previous: str | None = None
    for t in range(args.turns):
        text = f"Conversation {k}. {OPENING}" if t == 0 else f"Go on about fact {t}."
        said = {"role": "user", "content": text}
        body: dict[str, Any] = {"model": SERVED, "max_output_tokens": args.max_tokens, "temperature": 0,
                                "ignore_eos": True}
        if variant == "stateless":
            body.update(store=False, input=[*history, said])
        else:
            body["input"] = [said]
            if previous is not None:
                body["previous_response_id"] = previous
        sent = time.perf_counter()
        try:
            r = await client.post(f"{url}/v1/responses", json=body)
        except httpx.HTTPError:
            run.failed += 1
            return
        if r.status_code != 200:
            run.failed += 1
            return
        run.latencies.append(time.perf_counter() - sent)
        answer = r.json()
        previous = answer["id"]
        prompts.setdefault(k, []).append(int(answer["usage"]["input_tokens"]))
        history += [said, *[item for item in answer["output"] if item.get("type") == "message"]]


async def drive(url: str, variant: str, args: argparse.Namespace, sims: list[str], say: Progress) -> Run:
    run = Run(variant)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=128)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        before = await sim_cache_counts(client, sims)
        prompts: dict[int, list[int]] = {}
        start = time.perf_counter()
        await asyncio.gather(*(conversation(client, url, k, variant, args, run, prompts)
                               for k in range(args.conversations)))
        run.seconds = time.perf_counter() - start
        after = await sim_cache_counts(client, sims)
        first_turns = sum(p[0] for p in prompts.values() if p)
        # Follow-ups only: the opening turns are all new (their lookups hit nothing, as the oracle's).
        run.hits = after[0] - before[0]
        run.queries = after[1] - before[1] - first_turns
        run.oracle_hits = sum(p[i - 1] // BLOCK * BLOCK for p in prompts.values() for i in range(1, len(p)))
        run.store = store_times(await client.get(f"{url}/metrics"), len(run.latencies))
    say(f"  {variant}: {len(run.latencies)} answered, {run.failed} failed in {run.seconds:.1f} s")
    return run


_SAMPLE = re.compile(r'^coordinator_response_store_seconds_(bucket|sum|count)\{([^}]*)\} (\S+)$')


def store_times(metrics: httpx.Response, requests: int) -> dict[str, Any]:
    """The store's time per request (every call's seconds summed, over the requests answered) and each
    operation's p50 (the upper bound of the histogram bucket holding the median)."""
    sums: dict[str, float] = {}
    buckets: dict[str, list[tuple[float, float]]] = {}
    for line in metrics.text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        kind, labels, value = m.groups()
        fields = dict(part.split("=", 1) for part in labels.split(","))
        op = fields["op"].strip('"')
        if kind == "sum":
            sums[op] = sums.get(op, 0.0) + float(value)
        elif kind == "bucket" and fields.get("result") == '"ok"':
            le = fields["le"].strip('"')
            buckets.setdefault(op, []).append((float("inf") if le == "+Inf" else float(le), float(value)))
    out: dict[str, Any] = {"store_ms_per_request": round(sum(sums.values()) / requests * 1000, 3)
                           if requests else 0.0}
    for op in ("get", "put"):
        rows = sorted(buckets.get(op, []))
        total = rows[-1][1] if rows else 0.0
        median = next((le for le, n in rows if total and n >= total / 2), None)
        out[f"{op}_p50_ms_at_most"] = None if median is None else round(median * 1000, 2)
        out[f"{op}_calls"] = int(total)
    return out


def isolated(redis_url: str, out_dir: Path, turns: int, calls: int = 200) -> dict[str, float]:
    """Each store alone on an idle event loop: a follow-up's get and put, with entries the size a
    conversation of ``turns`` turns stores (the last turn's), p50 of get + put in ms. This is what
    a request pays for storing when the process is not busy with anything else."""
    from coordinator.pipeline.responses.store import RedisStore, SqliteStore, StoredResponse

    said: dict[str, Any] = {"type": "message", "role": "user", "content": "Go on about fact 7."}
    answer: dict[str, Any] = {"type": "message", "role": "assistant", "status": "completed", "id": "msg_0",
                              "content": [{"type": "output_text", "text": "It stands on a rock",
                                           "annotations": []}]}
    history = [said, answer] * turns
    response = {"id": "resp_0", "object": "response", "status": "completed", "output": [answer],
                "usage": {"input_tokens": 900, "output_tokens": 8, "total_tokens": 908}}

    async def one(store: Any) -> float:
        times = []
        for i in range(calls):
            start = time.perf_counter()
            await store.get("t", f"resp_{i - 1}")
            await store.put("t", StoredResponse(f"resp_{i}", {**response, "id": f"resp_{i}"}, [said], history,
                                                time.time()))
            times.append(time.perf_counter() - start)
        await store.aclose()
        return round(pct(times, 50) * 1000, 3)

    sqlite = SqliteStore(str(out_dir / f"isolated-{uuid.uuid4().hex}.sqlite3"), 3600.0, 1 << 30)
    redis = RedisStore(redis_url, uuid.uuid4().hex, 3600.0, 1 << 30, timeout_s=2.0)
    return {"sqlite": asyncio.run(one(sqlite)), "redis": asyncio.run(one(redis))}


def coordinator_config(variant: str, render_url: str, urls: list[str], redis_url: str | None,
                       out_dir: Path) -> dict[str, Any]:
    store: dict[str, Any] = {"backend": "off"}
    if variant == "sqlite":
        store = {"backend": "sqlite", "path": str(out_dir / f"responses-{uuid.uuid4().hex}.sqlite3")}
    elif variant == "redis":
        store = {"backend": "redis", "redis_url": redis_url, "namespace": uuid.uuid4().hex}
    return {"render": {**render_config([render_url]), "timeout_s": 60},
            "models": [{"name": SERVED, "max_model_len": 2048}],
            "engines": [{"url": u} for u in urls], "engine_client": {"health_interval_s": 1.0},
            "scheduling": {"prefix": {"block_size": BLOCK}}, "responses": {"store": store},
            "server": {"log_level": "warning", "metrics": True}}


def engine_configs(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [{"model": SERVED, "seed": i, "block_size": BLOCK, "capacity_blocks": 65536,
             "prefill_s_per_token": args.prefill_ms / 1000, "decode_s_per_token": args.decode_ms / 1000,
             "stream_interval": args.max_tokens, "max_model_len": 2048} for i in range(args.engines)]


def plot(runs: dict[str, Run], alone: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"stateless": "tab:gray", "sqlite": "tab:blue", "redis": "tab:red"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for variant, run in runs.items():
        lat = sorted(x * 1000 for x in run.latencies)
        if lat:
            a.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], label=variant, color=colors[variant])
    a.set_xlabel("request latency (ms), every core busy")
    a.set_ylabel("fraction of requests")
    a.legend()
    stores = [v for v in ("sqlite", "redis") if v in runs]
    x = range(len(stores))
    b.bar([i - 0.2 for i in x], [alone[v] for v in stores], width=0.4, label="store alone, get + put p50",
          color=[colors[v] for v in stores])
    b.bar([i + 0.2 for i in x], [runs[v].summary()["store_ms_per_request"] for v in stores], width=0.4,
          label="store call wall time in the run (event-loop waits included)", color="tab:olive")
    b.set_xticks(list(x), stores)
    b.set_yscale("log")
    b.axhline(TARGET_STORE_MS, color="black", linestyle="--",
              label=f"target {TARGET_STORE_MS} ms (store alone)")
    b.set_ylabel("ms per request (log)")
    b.legend(fontsize=8)
    save_figure(fig, path)


def headline(summaries: dict[str, dict[str, Any]], alone: dict[str, float]) -> dict[str, Any]:
    base = summaries["stateless"]
    head: dict[str, Any] = {"benchmark": NAME, "failed": sum(s["failed"] for s in summaries.values())}
    met = head["failed"] == 0
    for v in ("sqlite", "redis"):
        s = summaries[v]
        hit = s["followup_hit_rate"] / s["oracle_hit_rate"] if s["oracle_hit_rate"] else float("nan")
        head[f"{v}_store_alone_p50_ms"] = alone[v]
        head[f"{v}_store_in_run_ms_per_request"] = s["store_ms_per_request"]
        head[f"{v}_latency_p50_delta_ms"] = round(s["latency_p50_ms"] - base["latency_p50_ms"], 2)
        head[f"{v}_pod_cpu_ms_delta"] = round(s["cpu_ms_pod"] - base["cpu_ms_pod"], 3)
        head[f"{v}_throughput_ratio"] = round(s["throughput_rps"] / base["throughput_rps"], 3) \
            if base["throughput_rps"] else float("nan")
        head[f"{v}_hit_vs_oracle"] = round(hit, 3)
        head[f"{v}_followup_hit_rate"] = s["followup_hit_rate"]
        met = met and alone[v] <= TARGET_STORE_MS and hit >= TARGET_HIT
    head["targets_met"] = bool(met)
    return head


def markdown(args: argparse.Namespace, summaries: dict[str, dict[str, Any]], head: dict[str, Any]) -> str:
    rows = "\n".join(
        f"| {s['variant']} | {s['requests']} | {s['failed']} | {s['latency_p50_ms']} | "
        f"{s['latency_p90_ms']} | {s['throughput_rps']} | {s['cpu_ms_pod']} | {s['cpu_ms_coordinator']} | "
        f"{s['cpu_ms_redis']} | {s.get('store_ms_per_request', '')} | {s['followup_hit_rate']} | "
        f"{s['oracle_hit_rate']} |" for s in summaries.values())
    return f"""# Stored Responses: what storing costs a request, and the follow-ups' KV hits

{args.engines} simulated engines, the real render sidecar, {args.conversations} conversations at once,
{args.turns} turns each ({args.conversations * args.turns} requests per variant), {args.max_tokens}
output tokens a turn, everything on one machine. `stateless`: `store: false`, the whole conversation
sent every turn; `sqlite` and `redis`: turns chained with `previous_response_id`. CPU: ms of CPU per
answered request, by process (the pod: coordinator, render sidecar, engines, Redis). "store wall": the
coordinator's `coordinator_response_store_seconds` per request, waiting for a busy event loop included.

| variant | n | failed | p50 | p90 | req/s | pod CPU | coord. CPU | Redis CPU | store wall | hits | oracle |
|---|---|---|---|---|---|---|---|---|---|---|---|
{rows}

- **each store alone** (idle event loop, entries of a {args.turns}-turn conversation), get + put p50:
  SQLite **{head['sqlite_store_alone_p50_ms']} ms**, Redis **{head['redis_store_alone_p50_ms']} ms**
  (target ≤ {TARGET_STORE_MS})
- follow-up prefix hit rate over the oracle's: SQLite **{head['sqlite_hit_vs_oracle']}**, Redis
  **{head['redis_hit_vs_oracle']}** (target ≥ {TARGET_HIT})
- at this load (every core busy), beside `stateless`: pod CPU per request SQLite
  {head['sqlite_pod_cpu_ms_delta']:+} ms, Redis {head['redis_pod_cpu_ms_delta']:+} ms; throughput
  {head['sqlite_throughput_ratio']}x and {head['redis_throughput_ratio']}x; latency p50
  {head['sqlite_latency_p50_delta_ms']:+} ms and {head['redis_latency_p50_delta_ms']:+} ms (reported)
- targets met: **{head['targets_met']}**

![latency and store time](responses_store.png)
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=32, help="conversations at once (the concurrency)")
    ap.add_argument("--turns", type=int, default=31, help="turns per conversation")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prefill-ms", type=float, default=0.05, help="simulated ms per uncached prompt token")
    ap.add_argument("--decode-ms", type=float, default=2.0, help="simulated ms per output token")
    ap.add_argument("--order", default=",".join(VARIANTS), help="the variants, in the order they run")
    ap.add_argument("--render-url", help="a running render sidecar instead of starting one")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 engines, 4 conversations, 3 turns")
    args = ap.parse_args(argv)
    if args.quick:
        args.engines, args.conversations, args.turns = 2, 4, 3
    say = Progress(NAME)
    out_dir = _report.OUT_ROOT / NAME
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Run] = {}
    with ExitStack() as stack:
        render_url, render_pid = args.render_url, None
        if render_url is None:
            sidecar = stack.enter_context(render_sidecars(1, say, log_dir=out_dir))[0]
            render_url, render_pid = str(sidecar.url), sidecar_pid(sidecar)
        redis = RedisServer().start()
        stack.callback(redis.stop)
        redis_pid = redis.pid
        for variant in args.order.split(","):
            with ExitStack() as inner:
                urls, sims_pid = inner.enter_context(sim_engines(engine_configs(args)))
                config = coordinator_config(variant, render_url, urls, redis.url, out_dir)
                log = out_dir / f"coordinator-{variant}.log"
                coord = inner.enter_context(CoordinatorProcess(config, log_path=log))
                say(f"{variant}: {args.conversations} conversations x {args.turns} turns, "
                    f"{args.engines} engines")
                pids = {"coordinator": coord.pid, "render": render_pid, "engines": sims_pid,
                        "redis": redis_pid if variant == "redis" else None}
                before = {k: tree_cpu_s(p) for k, p in pids.items()}
                run = asyncio.run(drive(coord.url, variant, args, urls, say))
                after = {k: tree_cpu_s(p) for k, p in pids.items()}
                answered = max(1, len(run.latencies))
                run.cpu_ms = {k: round(((after[k] or 0.0) - (before[k] or 0.0)) / answered * 1000, 3)
                              for k in pids}
                run.cpu_ms["pod"] = round(sum(run.cpu_ms.values()), 3)
                runs[variant] = run
        alone = isolated(redis.url, out_dir, args.turns)
        say(f"each store alone, get + put p50: SQLite {alone['sqlite']} ms, Redis {alone['redis']} ms")
    summaries = {v: r.summary() for v, r in runs.items()}
    head = headline(summaries, alone)
    plot(runs, alone, out_dir / "responses_store.png")
    write_report(NAME, {**head, "quick": args.quick, "runs": list(summaries.values()), "config": vars(args)},
                 markdown(args, summaries, head))
    final_json(head)


if __name__ == "__main__":
    main()
