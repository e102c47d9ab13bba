"""Union, handoff and trigger side by side: what each topology costs a client, in one run.

Why: P/D exists to take prefill off the decoding engines, and each P/D protocol adds hops of its
own (handoff: the prefill leg's answer before decode starts; trigger: the decode engine's callback
to our metaserver, then the prefill engine's "KV done" message to the decode engine). On simulated
engines that share one CPU those hops are the whole difference, so this measures exactly what the
coordinator and the protocols add, not what disaggregation buys on a real fleet.

Set-up: one real render sidecar (vLLM) and, in one child process, simulated engines in ``mode:
context`` (the output is a function of the context, so every topology must give the same text):
union = one engine; handoff = a prefill and a decode engine (NIXL-style handoff); trigger = the same
pair with layer-wise connectors. One coordinator process per topology. Each round streams the same
completions (distinct token-id prompts, so no topology gains from a prefix cache) through each
coordinator (the order rotates per round), closed loop at a fixed
concurrency, and reads time to first token, output tokens per second, the texts, and afterwards
``/admin/accounting`` (nothing may be held) and, for trigger, the metaserver's callback counts.

    python -m perf.topologies [--prompts 96] [--concurrency 8] [--rounds 3] [--render-url URL] [--quick]

Writes perf/out/topologies/ (report.md, result.json, topologies.png); the last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from coordinator.embedded import free_port
from perf import _report
from perf._procs import SERVED, CoordinatorProcess, render_config, render_sidecars, sim_engines
from perf._report import Progress, final_json, pct, save_figure, write_report

NAME = "topologies"
TOPOLOGIES = ("union", "handoff", "trigger")


@dataclass
class Sample:
    ttft_s: float | None
    output_tokens: int
    text: str
    error: str | None = None


@dataclass
class Run:
    topology: str
    round: int
    duration_s: float
    samples: list[Sample] = field(default_factory=list)
    held: int | None = None
    callbacks: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.error is None]

    def summary(self) -> dict[str, Any]:
        ttft = [s.ttft_s * 1000 for s in self.ok if s.ttft_s is not None]
        tokens = sum(s.output_tokens for s in self.ok)
        return {"topology": self.topology, "round": self.round, "requests": len(self.samples),
                "failed": len(self.samples) - len(self.ok), "output_tokens": tokens,
                "output_tok_s": round(tokens / self.duration_s, 1) if self.duration_s else None,
                "mean_ttft_ms": round(statistics.fmean(ttft), 1) if ttft else None,
                "p90_ttft_ms": round(pct(ttft, 90), 1) if ttft else None,
                "held": self.held, "trigger_callbacks": self.callbacks or None}


def prompt(i: int, tokens: int) -> list[int]:
    """A distinct token-id prompt per request: its first block already differs from every other's."""
    return [1000 + (i * 7919 + k * 31) % 40000 for k in range(tokens)]


def engine_configs(decode_s: float, prefill_s: float) -> list[dict[str, Any]]:
    """union, then the handoff pair, then the trigger pair (one child process serves them all)."""
    base = {"model": SERVED, "mode": "context", "decode_s_per_token": decode_s,
            "prefill_s_per_token": prefill_s}
    return [base,
            {**base, "kv_role": "prefill", "engine_id": "hp"},
            {**base, "kv_role": "decode", "engine_id": "hd"},
            {**base, "kv_role": "prefill", "kv_connector": "layerwise", "engine_id": "tp"},
            {**base, "kv_role": "decode", "kv_connector": "layerwise", "engine_id": "td"}]


def coordinator_configs(render_url: str, urls: list[str]) -> dict[str, dict[str, Any]]:
    union, hp, hd, tp, td = urls
    # vocab_size given (SmolLM2's), so token-id prompts are checked without reading the model folder.
    common = {"render": render_config([render_url]), "models": [{"name": SERVED, "vocab_size": 49152}],
              "engine_client": {"health_interval_s": 30}}
    pd = {"pd_min_uncached_tokens": 0}
    return {
        "union": {**common, "engines": [{"url": union}]},
        "handoff": {**common, "topology": pd,
                    "engines": [{"url": hp, "role": "prefill"}, {"url": hd, "role": "decode"}]},
        "trigger": {**common, "topology": {**pd, "trigger": {"host": "127.0.0.1", "port": free_port()}},
                    "engines": [{"url": tp, "role": "prefill", "pd_protocol": "trigger"},
                                {"url": td, "role": "decode", "pd_protocol": "trigger"}]},
    }


async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Sample:
    t0 = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    tokens = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Sample(None, 0, "", f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Sample(ttft, tokens, "".join(parts), str(chunk["error"])[:200])
                for choice in chunk.get("choices") or ():
                    text = choice.get("text")
                    if text:
                        ttft = time.perf_counter() - t0 if ttft is None else ttft
                        parts.append(text)
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
    except httpx.HTTPError as exc:
        return Sample(ttft, tokens, "".join(parts), f"{type(exc).__name__}: {exc}")
    return Sample(ttft, tokens, "".join(parts))


async def drive(url: str, bodies: list[dict[str, Any]], concurrency: int) -> tuple[list[Sample], float]:
    """Closed loop: ``concurrency`` clients take the next prompt as soon as theirs is done."""
    results: list[Sample | None] = [None] * len(bodies)
    queue = iter(range(len(bodies)))

    async def worker(client: httpx.AsyncClient) -> None:
        for i in queue:
            results[i] = await one(client, url, bodies[i])

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        duration = time.perf_counter() - t0
    return [s for s in results if s is not None], duration


def held(url: str) -> int | None:
    """``held`` of /admin/accounting once in-flight work had a moment to end (None: unreadable)."""
    for _ in range(50):
        try:
            value = int(httpx.get(f"{url}/admin/accounting", timeout=5).json()["held"])
        except (httpx.HTTPError, KeyError, ValueError):
            return None
        if value == 0:
            return 0
        time.sleep(0.1)
    return value


def callbacks(url: str) -> dict[str, float]:
    """The metaserver's answers so far, by status (cumulative: a run's are the difference)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("coordinator_trigger_callbacks_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels[len("coordinator_trigger_callbacks_total"):]] = float(value)
    return out


def headline(runs: list[Run], texts_equal: bool) -> dict[str, Any]:
    """Per topology the mean over rounds; TTFT and throughput as ratios against handoff."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r.topology, []).append(r.summary())

    def mean(t: str, key: str) -> float | None:
        values = [s[key] for s in by.get(t, []) if s[key] is not None]
        return round(statistics.fmean(values), 1) if values else None

    out: dict[str, Any] = {"benchmark": NAME}
    for t in TOPOLOGIES:
        out[f"{t}_output_tok_s"] = mean(t, "output_tok_s")
        out[f"{t}_mean_ttft_ms"] = mean(t, "mean_ttft_ms")
    for t in ("union", "trigger"):
        h, x = out["handoff_mean_ttft_ms"], out[f"{t}_mean_ttft_ms"]
        out[f"{t}_ttft_vs_handoff"] = round(x / h, 2) if h and x else None
        h, x = out["handoff_output_tok_s"], out[f"{t}_output_tok_s"]
        out[f"{t}_throughput_vs_handoff"] = round(x / h, 2) if h and x else None
    out["failed"] = sum(len(r.samples) - len(r.ok) for r in runs)
    out["held_after"] = max((r.held if r.held is not None else 1) for r in runs)
    out["texts_equal_union"] = texts_equal
    return out


def markdown(args: argparse.Namespace, runs: list[Run], head: dict[str, Any], failures: list[str]) -> str:
    rows = ["| topology | round | requests | failed | output tok/s | mean TTFT ms | p90 TTFT ms "
            "| held after |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s = r.summary()
        rows.append(f"| {s['topology']} | {s['round']} | {s['requests']} | {s['failed']} "
                    f"| {s['output_tok_s']} | {s['mean_ttft_ms']} | {s['p90_ttft_ms']} | {s['held']} |")
    trig = [r.callbacks for r in runs if r.topology == "trigger"]
    lines = [
        "# Topologies: union, handoff, trigger", "",
        f"{args.prompts} streamed completions of {args.prompt_tokens} prompt tokens and {args.max_tokens} "
        "output tokens, "
        f"closed loop at concurrency {args.concurrency}, {args.rounds} round(s); simulated engines at "
        f"{args.decode_ms} ms per output token and {args.prefill_ms_per_token} ms per prompt token, one "
        "real render sidecar, one coordinator process per topology.", "",
        *rows, "",
        f"- TTFT vs handoff: union **{head['union_ttft_vs_handoff']}x**, trigger "
        f"**{head['trigger_ttft_vs_handoff']}x**",
        f"- Output tok/s vs handoff: union {head['union_throughput_vs_handoff']}x, trigger "
        f"{head['trigger_throughput_vs_handoff']}x",
        f"- Every topology's texts equal union's: {'yes' if head['texts_equal_union'] else '**no**'}; "
        f"failed requests: {head['failed']}; largest `held` after a run: {head['held_after']}",
        f"- Trigger metaserver callbacks per run, by status: {trig}", "",
        "![topologies](topologies.png)", "",
    ]
    if failures:
        lines += ["First failures:", "", *(f"- {f}" for f in failures[:5]), ""]
    return "\n".join(lines)


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    rounds = sorted({r.round for r in runs})
    width = 0.8 / max(1, len(rounds))
    for k, rnd in enumerate(rounds):
        got = {r.topology: r.summary() for r in runs if r.round == rnd}
        xs = [i + k * width for i in range(len(TOPOLOGIES))]
        a.bar(xs, [got[t]["mean_ttft_ms"] or 0 for t in TOPOLOGIES], width, label=f"round {rnd}")
        b.bar(xs, [got[t]["output_tok_s"] or 0 for t in TOPOLOGIES], width, label=f"round {rnd}")
    for ax, title in ((a, "mean time to first token (ms)"), (b, "output tokens per second")):
        ax.set_xticks([i + width * (len(rounds) - 1) / 2 for i in range(len(TOPOLOGIES))], list(TOPOLOGIES))
        ax.set_title(title)
        ax.legend(loc="lower right")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-ms", type=float, default=5.0, help="simulated ms per output token")
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.2, help="simulated ms per prompt token")
    ap.add_argument("--render-url", help="a running render sidecar instead of starting one")
    ap.add_argument("--quick", action="store_true", help="smoke run: few prompts, one round")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.rounds, args.concurrency, args.max_tokens = 8, 1, 4, 16
    say = Progress(NAME)
    out_dir = _report.OUT_ROOT / NAME
    out_dir.mkdir(parents=True, exist_ok=True)
    bodies = [{"model": SERVED, "prompt": prompt(i, args.prompt_tokens), "max_tokens": args.max_tokens,
               "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
              for i in range(args.prompts)]
    runs: list[Run] = []
    with ExitStack() as stack:
        render_url = args.render_url
        if render_url is None:
            render_url = str(stack.enter_context(render_sidecars(1, say, log_dir=out_dir))[0].url)
        urls, _ = stack.enter_context(sim_engines(engine_configs(args.decode_ms / 1000,
                                                                 args.prefill_ms_per_token / 1000)))
        coords = {t: stack.enter_context(CoordinatorProcess(cfg, log_path=out_dir / f"coordinator-{t}.log"))
                  for t, cfg in coordinator_configs(render_url, urls).items()}
        say("ready; warm-up (two requests per topology)")
        for t in TOPOLOGIES:
            asyncio.run(drive(coords[t].url, bodies[:2], 2))
        for rnd in range(args.rounds):
            order = TOPOLOGIES[rnd % 3:] + TOPOLOGIES[:rnd % 3]
            for t in order:
                before = callbacks(coords[t].url)
                samples, duration = asyncio.run(drive(coords[t].url, bodies, args.concurrency))
                after = callbacks(coords[t].url)
                run = Run(t, rnd, duration, samples, held(coords[t].url),
                          {k: v - before.get(k, 0.0) for k, v in after.items()})
                runs.append(run)
                s = run.summary()
                say(f"round {rnd} {t}: {s['output_tok_s']} tok/s, mean TTFT {s['mean_ttft_ms']} ms, "
                    f"failed {s['failed']}, held {s['held']}")
    union_texts = [[s.text for s in r.samples] for r in runs if r.topology == "union"]
    texts_equal = bool(union_texts) and all([s.text for s in r.samples] == union_texts[0] for r in runs)
    failures = [f"{r.topology} round {r.round}: {s.error}" for r in runs for s in r.samples if s.error]
    head = headline(runs, texts_equal)
    plot(runs, out_dir / "topologies.png")
    figures = {**head, "quick": args.quick, "runs": [r.summary() for r in runs],
               "config": {k: v for k, v in vars(args).items()}}
    write_report(NAME, figures, markdown(args, runs, head, failures))
    final_json(head)


if __name__ == "__main__":
    main()
