"""Offload tiers: does scoring a CPU-offloaded prefix (``scheduling.prefix.tiers``) bring conversations
back to the engine that can load them instead of recomputing them?

Four simulated engines, each with a small KV cache and a CPU offload tier eight times its size
(vLLM's ``OffloadingConnector`` with self-describing KV events, as the simulator models it: loading a
token back costs a tenth of computing it). By default every user is an agent with its own 1,500-token
instructions (``--tenants`` = ``--users``); ``--tenants 8`` gives a system prompt shared by four users
each, which stays in the engines' caches and leaves the tiers less to do. Users come back to their
conversations after longer than the pending layer remembers a routing decision (``pending_ttl_s``),
and by then the engine's cache has moved their blocks to its CPU tier. The same schedule runs in one
run against:

- ``round_robin``: the reference.
- ``precise_tierless``: the precise KV-event index reading the engines' caches only (``tiers: {}``),
  the behaviour before tiers: an offloaded conversation looks new, and may land anywhere.
- ``precise_tiers``: the default weights (CPU 0.5, storage 0.25).

Reported per policy: TTFT p50/p90, the share of prompt tokens served from the engines' caches and
from their CPU tiers, and the prompt tokens computed; the headline is the tierless/tiers ratio of
TTFT p90 and of tokens computed. No target in the issue: the ratios are what they are.

    python -m perf.offload_tiers [--quick] [--render-url URL]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from coordinator.config import (
    EngineSettings,
    ModelSettings,
    PrefixIndexSettings,
    RenderSettings,
    SchedulingSettings,
    Settings,
)
from perf._procs import render_sidecar
from perf._report import Progress, final_json, save_figure, summary_ms, write_report
from perf.kv_affinity import (
    BLOCK_SIZE,
    ENGINES,
    SERVED,
    EngineHandle,
    EngineModel,
    Turn,
    Workload,
    build_schedule,
    context_length,
    drive_embedded,
    engine_process,
)

POLICIES = ("round_robin", "precise_tierless", "precise_tiers")


def _settings(policy: str, render_url: str, sims: Sequence[EngineHandle], max_model_len: int,
              pending_ttl_s: float) -> Settings:
    precise = policy != "round_robin"
    tiers = {} if policy == "precise_tierless" else PrefixIndexSettings().tiers
    return Settings(
        render=RenderSettings(url=render_url),
        engines=[EngineSettings(url=s.url,
                                kv_events=s.kv_events["endpoint"] if precise and s.kv_events else None)
                 for s in sims],
        models=[ModelSettings(name=SERVED, max_model_len=max_model_len, vocab_size=49152)],  # SmolLM2's
        scheduling=SchedulingSettings(
            policy="affinity" if precise else "round_robin",
            prefix=PrefixIndexSettings(source="precise" if precise else "none", block_size=BLOCK_SIZE,
                                       pending_ttl_s=pending_ttl_s, tiers=tiers)))


def run_policy(policy: str, render_url: str, schedule: Sequence[Turn], model: EngineModel, concurrency: int,
               max_tokens: int, pending_ttl_s: float, say: Callable[[str], None]) -> dict[str, Any]:
    with engine_process([model.sim_config(i, True) for i in range(ENGINES)]) as sims:
        run = drive_embedded(_settings(policy, render_url, sims, model.max_model_len, pending_ttl_s), sims,
                             schedule, False, concurrency, max_tokens, say, precise=policy != "round_robin")
    caches = [state["prefix_cache"] for state in run.states]
    samples = run.samples
    queries = sum(c["queries"] for c in caches)
    hits = sum(c["hits"] for c in caches)
    loaded = sum(c["offload_hits"] for c in caches)
    ttft = summary_ms([s.ttft_s for s in samples if s.ok])
    return {"ttft_p50_ms": ttft["p50_ms"], "ttft_p90_ms": ttft["p90_ms"], "ttft": ttft,
            "cache_hit_rate": round(hits / queries, 4) if queries else 0.0,
            "offload_hit_rate": round(loaded / queries, 4) if queries else 0.0,
            "computed_tokens": queries - hits - loaded, "prompt_tokens": queries,
            "evictions": sum(c["evictions"] for c in caches), "errors": sum(not s.ok for s in samples),
            "wall_s": round(run.wall, 2)}


def headline(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"benchmark": "offload_tiers"}
    for p, r in results.items():
        for k in ("ttft_p50_ms", "ttft_p90_ms", "cache_hit_rate", "offload_hit_rate", "computed_tokens"):
            out[f"{p}_{k}"] = r[k]
    blind, aware = results.get("precise_tierless"), results.get("precise_tiers")
    if blind and aware:
        out["ttft_p50_tierless_vs_tiers"] = round(blind["ttft_p50_ms"] / aware["ttft_p50_ms"], 2)
        out["ttft_p90_tierless_vs_tiers"] = round(blind["ttft_p90_ms"] / aware["ttft_p90_ms"], 2)
        out["computed_tokens_tierless_vs_tiers"] = round(blind["computed_tokens"]
                                                         / max(1, aware["computed_tokens"]), 2)
        out["errors"] = sum(r["errors"] for r in results.values())
    return out


def _markdown(f: dict[str, Any], head: dict[str, Any]) -> str:
    m = f["engine_model"]
    rows = ["| policy | TTFT p50 (ms) | TTFT p90 (ms) | from cache | from CPU tier | tokens computed "
            "| errors |", "|---|---|---|---|---|---|---|"]
    for p, r in f["policies"].items():
        rows.append(f"| {p} | {r['ttft_p50_ms']} | {r['ttft_p90_ms']} | {r['cache_hit_rate']} | "
                    f"{r['offload_hit_rate']} | {r['computed_tokens']:,} | {r['errors']} |")
    ratios = ""
    if "ttft_p90_tierless_vs_tiers" in head:
        ratios = ("\n\nTierless over tier-aware, same run: TTFT p50 "
                  f"**{head['ttft_p50_tierless_vs_tiers']}x**, p90 "
                  f"**{head['ttft_p90_tierless_vs_tiers']}x**, prompt tokens computed "
                  f"**{head['computed_tokens_tierless_vs_tiers']}x**.")
    return ("# Offload tiers\n\n"
            f"{f['requests']} requests ({f['workload']['users']} users x {f['workload']['turns']} turns, "
            f"{f['workload']['tenants']} {f['workload']['system_tokens']}-token system prompts, think time "
            f"{f['workload']['think_s']} s against a pending layer of {f['pending_ttl_s']} s), {ENGINES} "
            f"engines with {m['capacity_blocks']} blocks of KV cache and a CPU tier of {m['offload_blocks']} "
            f"blocks each (block {BLOCK_SIZE}); prefill {m['prefill_s_per_token'] * 1000} ms/token, a token "
            "loaded back from the CPU tier a tenth of that.\n\n" + "\n".join(rows) + ratios
            + "\n\n![plot](offload_tiers.png)\n")


def _plot(f: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pol = f["policies"]
    names = list(pol)
    xs = list(range(len(names)))
    labels = [n.replace("_", "\n", 1) for n in names]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.bar([x - 0.2 for x in xs], [pol[n]["ttft_p50_ms"] for n in names], 0.4, label="p50")
    a.bar([x + 0.2 for x in xs], [pol[n]["ttft_p90_ms"] for n in names], 0.4, label="p90")
    a.set_xticks(xs, labels, fontsize=8)
    a.set_ylabel("ms")
    a.set_title("time to first token (client)")
    a.legend()
    cache = [pol[n]["cache_hit_rate"] for n in names]
    tier = [pol[n]["offload_hit_rate"] for n in names]
    b.bar(xs, cache, 0.6, label="from the engine's cache", color="tab:green")
    b.bar(xs, tier, 0.6, bottom=cache, label="loaded from its CPU tier", color="tab:olive")
    b.bar(xs, [1 - c - t for c, t in zip(cache, tier, strict=True)], 0.6,
          bottom=[c + t for c, t in zip(cache, tier, strict=True)], label="computed", color="tab:red")
    b.set_xticks(xs, labels, fontsize=8)
    b.set_ylim(0, 1)
    b.set_ylabel("share of prompt tokens")
    b.set_title("where prompt tokens came from")
    b.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=32, help="system prompts (32: one per user)")
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--think-s", type=float, default=5.0, help="mean time between a user's turns")
    ap.add_argument("--ramp-s", type=float, default=6.0)
    ap.add_argument("--pending-ttl-s", type=float, default=2.0,
                    help="scheduling.prefix.pending_ttl_s: shorter than the think time")
    ap.add_argument("--capacity-blocks", type=int, default=256, help="KV cache per engine")
    ap.add_argument("--offload-blocks", type=int, default=2048, help="CPU tier per engine")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--prefill-ms", type=float, default=0.2, help="per computed prompt token")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--render-url", help="use this running render sidecar")
    ap.add_argument("--quick", action="store_true", help="tiny workload (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.tenants, args.users, args.turns, args.system_tokens = 2, 6, 3, 300
        args.think_s, args.ramp_s, args.pending_ttl_s, args.capacity_blocks, args.offload_blocks = \
            1.0, 0.5, 0.3, 48, 512
    policies = [p for p in args.policies.split(",") if p]
    if set(policies) - set(POLICIES):
        ap.error(f"choose policies from {', '.join(POLICIES)}")
    say = Progress("offload_tiers")
    work = Workload(args.tenants, args.users, args.turns, args.system_tokens, 100, 200, args.think_s,
                    args.ramp_s, args.seed)
    schedule = build_schedule(work)
    max_model_len = context_length(schedule, args.max_tokens)
    model = EngineModel(args.capacity_blocks, 4, args.prefill_ms / 1000, 0.005, 0.01, max_model_len,
                        offload_blocks=args.offload_blocks)
    say(f"{len(schedule)} requests, {ENGINES} engines: {args.capacity_blocks} cache blocks + "
        f"{args.offload_blocks} CPU-tier blocks each")
    with render_sidecar(args.render_url, say, max_model_len=max_model_len) as render_url:
        results: dict[str, dict[str, Any]] = {}
        for p in policies:
            say(f"{p}: fresh coordinator and {ENGINES} engines")
            r = results[p] = run_policy(p, render_url, schedule, model, args.concurrency, args.max_tokens,
                                        args.pending_ttl_s, say)
            say(f"{p}: TTFT p50/p90 {r['ttft_p50_ms']}/{r['ttft_p90_ms']} ms, from cache "
                f"{r['cache_hit_rate']}, from CPU tier {r['offload_hit_rate']}, computed "
                f"{r['computed_tokens']:,} tokens, errors {r['errors']}")
    figures: dict[str, Any] = {"workload": asdict(work), "engine_model": asdict(model),
                               "requests": len(schedule), "pending_ttl_s": args.pending_ttl_s,
                               "quick": args.quick, "policies": results}
    head = headline(results)
    figures["headline"] = head
    out = write_report("offload_tiers", figures, _markdown(figures, head))
    _plot(figures, out / "offload_tiers.png")
    say(f"report: {out}/report.md, plot: {out}/offload_tiers.png")
    final_json(head)


if __name__ == "__main__":
    main()
