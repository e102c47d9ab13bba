"""What the coordinator's render → generate → streaming-derender path costs on top of the engine.

Baseline (same run, same engine): the rendered token ids sent straight to the engine's
``/inference/v1/generate`` stream. Measured: the same chat requests through the coordinator (real
vLLM render sidecar; simulated engine with a fixed per-token time so the engine's cost is constant).
Reported per concurrency level: TTFT and end-to-end latency of both paths, their ratios, and the
added milliseconds per streamed token.

    python -m perf.stream_overhead [--requests 30] [--concurrency 1,4] [--max-tokens 48] [--decode-ms 10]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import httpx

from coordinator.config import EngineSettings, ModelSettings, RenderSettings, Settings
from coordinator.embedded import EmbeddedCoordinator, free_port
from perf._report import Progress, final_json, save_figure, summary_ms, write_report
from render_sidecar.launch import RenderSidecar
from token_engine.model_prep import ensure_model
from token_engine.simulator import SimConfig, SimulatedEngine

SERVED = "smollm2-135m-instruct"
QUESTION = "Tell me about the history of Paris in a few sentences."


async def _timed_stream(client: httpx.AsyncClient, url: str,
                        body: dict[str, Any]) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    ttft = 0.0
    frames = 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                frames += 1
                if not ttft:
                    ttft = time.perf_counter() - t0
    return ttft, time.perf_counter() - t0, frames


async def _run(url: str, body: dict[str, Any], n: int, conc: int) -> dict[str, list[float]]:
    sem = asyncio.Semaphore(conc)
    ttfts: list[float] = []
    totals: list[float] = []
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=conc * 2)) as client:
        async def one() -> None:
            async with sem:
                ttft, total, _ = await _timed_stream(client, url, body)
                ttfts.append(ttft)
                totals.append(total)
        await asyncio.gather(*(one() for _ in range(n)))
    return {"ttft": ttfts, "total": totals}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--decode-ms", type=float, default=10.0)
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    say = Progress("stream_overhead")

    say("preparing model")
    model = ensure_model()
    say("starting render sidecar (real vLLM) and simulated engine")
    render = RenderSidecar(model, port=free_port(), served_model_name=SERVED, echo=False)
    render.start()
    sim = SimulatedEngine(SimConfig(model=SERVED, mode="random", decode_s_per_token=args.decode_ms / 1000))
    sim.start()
    try:
        render.wait_ready(timeout=600)
        settings = Settings(render=RenderSettings(url=render.url), engines=[EngineSettings(url=sim.url)],
                            models=[ModelSettings(name=SERVED)])
        with EmbeddedCoordinator(settings) as coord:
            chat = {"model": SERVED, "messages": [{"role": "user", "content": QUESTION}], "stream": True,
                    "max_tokens": args.max_tokens, "ignore_eos": True}
            rendered = httpx.post(f"{render.url}/v1/chat/completions/render", json=chat, timeout=30).json()
            direct = {**rendered, "stream": True}
            direct["sampling_params"] = {**rendered["sampling_params"], "max_tokens": args.max_tokens,
                                         "ignore_eos": True}
            figures: dict[str, Any] = {"max_tokens": args.max_tokens, "decode_ms": args.decode_ms,
                                       "requests": args.requests, "levels": {},
                                       "renderer_workers": render.renderer_num_workers}
            for conc in levels:
                say(f"concurrency {conc}: warm-up")
                asyncio.run(_run(f"{coord.url}/v1/chat/completions", chat, min(4, args.requests), conc))
                say(f"concurrency {conc}: baseline (engine direct), {args.requests} requests")
                base = asyncio.run(_run(f"{sim.url}/inference/v1/generate", direct, args.requests, conc))
                say(f"concurrency {conc}: through the coordinator, {args.requests} requests")
                ours = asyncio.run(_run(f"{coord.url}/v1/chat/completions", chat, args.requests, conc))
                b_t, o_t = summary_ms(base["total"]), summary_ms(ours["total"])
                b_f, o_f = summary_ms(base["ttft"]), summary_ms(ours["ttft"])
                figures["levels"][str(conc)] = {
                    "direct_ttft": b_f, "coordinator_ttft": o_f,
                    "direct_total": b_t, "coordinator_total": o_t,
                    "ttft_p50_ratio": round(o_f["p50_ms"] / b_f["p50_ms"], 3),
                    "total_p50_ratio": round(o_t["p50_ms"] / b_t["p50_ms"], 3),
                    "added_ms_per_token_p50": round((o_t["p50_ms"] - b_t["p50_ms"]) / args.max_tokens, 3),
                }
                say(f"concurrency {conc}: total p50 {b_t['p50_ms']} → {o_t['p50_ms']} ms, "
                    f"ttft p50 {b_f['p50_ms']} → {o_f['p50_ms']} ms")
            leftover = coord.wait_idle()
            figures["inflight_after"] = leftover
    finally:
        sim.stop()
        render.stop()
    out = write_report("stream_overhead", figures, _markdown(figures))
    _plot(figures, out / "stream_overhead.png")
    say(f"report: {out}/report.md, plot: {out}/stream_overhead.png")
    final_json({"benchmark": "stream_overhead", **{
        f"c{c}_{k}": v[k] for c, v in figures["levels"].items()
        for k in ("ttft_p50_ratio", "total_p50_ratio", "added_ms_per_token_p50")}})


def _markdown(f: dict[str, Any]) -> str:
    rows = ["| concurrency | TTFT p50 direct / coordinator (ms) | total p50 direct / coordinator (ms) | "
            "total ratio | added ms per token |", "|---|---|---|---|---|"]
    for c, v in f["levels"].items():
        rows.append(f"| {c} | {v['direct_ttft']['p50_ms']} / {v['coordinator_ttft']['p50_ms']} | "
                    f"{v['direct_total']['p50_ms']} / {v['coordinator_total']['p50_ms']} | "
                    f"{v['total_p50_ratio']} | {v['added_ms_per_token_p50']} |")
    return (f"# Streaming overhead\n\n{f['requests']} requests per level, {f['max_tokens']} tokens each, "
            f"engine {f['decode_ms']} ms/token, render sidecar with {f['renderer_workers']} renderer workers "
            f"(`--renderer-num-workers`).\n\n" + "\n".join(rows) + "\n\n![plot](stream_overhead.png)\n")


def _plot(f: dict[str, Any], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(f["levels"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("ttft", "total"), strict=True):
        xs = range(len(levels))
        direct = [f["levels"][c][f"direct_{metric}"]["p50_ms"] for c in levels]
        ours = [f["levels"][c][f"coordinator_{metric}"]["p50_ms"] for c in levels]
        ax.bar([x - 0.2 for x in xs], direct, 0.4, label="engine direct")
        ax.bar([x + 0.2 for x in xs], ours, 0.4, label="through coordinator")
        ax.set_xticks(list(xs), [f"c={c}" for c in levels])
        ax.set_ylabel("ms (p50)")
        ax.set_title("time to first token" if metric == "ttft" else "end-to-end latency")
        ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
