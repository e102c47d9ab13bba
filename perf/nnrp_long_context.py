"""Long-context chat on a real engine: the NNRP door against the HTTP/SSE door.

Why: with a prompt near the context limit the engine's prefill dominates, and what a client wants
to know is whether the NNRP door changes TTFT or total time there. ``perf.nnrp_latency`` answers
the per-chunk question on a simulated engine; this is the same question on real vLLM.

Set-up: a real ``--tokens-only`` vLLM engine (CPU) and a real render sidecar, the coordinator
embedded in this process. The prompt is one user message padded to ``--prompt-tokens`` rendered
tokens (counted by the sidecar's chat render) of a ``--max-model-len`` context. Every request's
message starts with its own nonce, so no request reuses another's cached prefix. One request at a
time, greedy, ``--max-tokens`` tokens, the doors alternating (one warm-up each, not counted); TTFT is
send → first text event, total is send → end of stream. Ratios are NNRP / SSE medians of this run.

    python -m perf.nnrp_long_context [--requests 5] [--prompt-tokens 1800] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from coordinator.embedded import EmbeddedCoordinator, free_port
from coordinator.nnrp.client import NnrpClient
from perf._report import Progress, final_json, save_figure, write_report
from perf.nnrp_latency import SERVED, chat_body, nnrp_request, settings_for, sse_request, ws_url

NAME = "nnrp_long_context"
PARAGRAPH = ("The archive holds letters, ledgers and maps from the river trade of the eighteenth century. "
             "Each box is catalogued by year and port, and the clerks noted tonnage, cargo and weather. ")
Run = tuple[float, float]   # (ttft_s, total_s)


def build_prompt(render_url: str, target: int, nonce: str) -> tuple[str, int]:
    """A user message whose rendered chat prompt has about ``target`` tokens (from below)."""
    def count(text: str) -> int:
        body = {"model": SERVED, "messages": [{"role": "user", "content": text}]}
        r = httpx.post(f"{render_url}/v1/chat/completions/render", json=body, timeout=60)
        r.raise_for_status()
        return len(r.json()["token_ids"])

    head = f"Request {nonce}. Summarise the following notes in two sentences.\n\n"
    per = count(head + PARAGRAPH * 10) - count(head)
    words = (PARAGRAPH * (target * 10 // max(per, 1) + 2)).split(" ")
    lo, hi = 0, len(words)
    while lo < hi:   # the longest prefix of the padding that stays within the target
        mid = (lo + hi + 1) // 2
        if count(head + " ".join(words[:mid])) <= target:
            lo = mid
        else:
            hi = mid - 1
    text = head + " ".join(words[:lo])
    return text, count(text)


async def run_doors(url: str, prompts: list[tuple[str, int]], args: argparse.Namespace,
                    say: Callable[[str], None]) -> dict[str, list[Run]]:
    """The prompts are built beforehand: nothing blocks the event loop while the session is open."""
    runs: dict[str, list[Run]] = {"sse": [], "nnrp": []}
    async with httpx.AsyncClient(timeout=600) as http:
        nnrp = await NnrpClient.connect(ws_url(url), credits=256)
        try:
            for i, (text, n) in enumerate(prompts):
                door = ("sse", "nnrp")[(i + i // 2) % 2]   # sse,nnrp,nnrp,sse,...
                body = chat_body(args.max_tokens, text)
                timing = (await sse_request(http, url, body))[0] if door == "sse" else \
                    await nnrp_request(nnrp, body)
                warm = i < 2
                say(f"{door}{' (warm-up)' if warm else ''}: {n} prompt tokens, "
                    f"TTFT {timing.ttft * 1000:.0f} ms, total {timing.total * 1000:.0f} ms, "
                    f"{len(timing.arrivals)} text events")
                if not warm:
                    runs[door].append((timing.ttft, timing.total))
        finally:
            await nnrp.close()
    return runs


def _ms(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(statistics.median(values) * 1000, 1), "min_ms": round(min(values) * 1000, 1),
            "max_ms": round(max(values) * 1000, 1)}


def figures(runs: dict[str, list[Run]], *, prompt_tokens: int, max_tokens: int,
            max_model_len: int) -> dict[str, Any]:
    f: dict[str, Any] = {"benchmark": NAME, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
                         "max_model_len": max_model_len, "requests": len(runs["sse"])}
    for door in ("sse", "nnrp"):
        f[door] = {"ttft": _ms([r[0] for r in runs[door]]), "total": _ms([r[1] for r in runs[door]])}
    f["ttft_p50_ratio"] = round(f["nnrp"]["ttft"]["p50_ms"] / f["sse"]["ttft"]["p50_ms"], 3)
    f["total_p50_ratio"] = round(f["nnrp"]["total"]["p50_ms"] / f["sse"]["total"]["p50_ms"], 3)
    return f


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5, help="measured requests per door (one warm-up each)")
    ap.add_argument("--prompt-tokens", type=int, default=1800)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args(argv)
    if args.prompt_tokens + args.max_tokens > args.max_model_len:
        ap.error("--prompt-tokens + --max-tokens must fit in --max-model-len")
    say = Progress(NAME)
    from render_sidecar.launch import RenderSidecar
    from token_engine.launch import VllmEngine
    from token_engine.model_prep import ensure_model

    model = ensure_model()
    out = write_report(NAME, {"quick": True}, "# Long-context chat, NNRP vs HTTP/SSE\n\n(running)\n")
    with ExitStack() as stack:
        say("starting a --tokens-only engine and a render sidecar (real vLLM, CPU)")
        engine = VllmEngine(model, port=free_port(), served_model_name=SERVED, mode="tokens-only",
                            max_model_len=args.max_model_len, echo=False, enable_log_requests=False,
                            log_path=out / "engine.log")
        engine.start()
        stack.callback(engine.stop)
        render = RenderSidecar(model, port=free_port(), served_model_name=SERVED,
                               max_model_len=args.max_model_len, echo=False, log_path=out / "render.log")
        render.start()
        stack.callback(render.stop)
        for proc in (engine, render):
            proc.wait_ready(timeout=900)
        coord = stack.enter_context(EmbeddedCoordinator(settings_for(render.url, engine.url)))
        say(f"ready; {args.requests} requests per door (+1 warm-up each), ~{args.prompt_tokens} tokens")
        prompts = [build_prompt(render.url, args.prompt_tokens, secrets.token_hex(4))
                   for _ in range(2 * (args.requests + 1))]
        sizes = [n for _, n in prompts]
        runs = asyncio.run(run_doors(coord.url, prompts, args, say))
        leftover = coord.wait_idle()
    f = figures(runs, prompt_tokens=round(statistics.median(sizes)), max_tokens=args.max_tokens,
                max_model_len=args.max_model_len)
    f["inflight_after"] = leftover
    f["runs_ms"] = {d: [[round(a * 1000, 1), round(b * 1000, 1)] for a, b in r] for d, r in runs.items()}
    out = write_report(NAME, f, _markdown(f))
    _plot(f, out / f"{NAME}.png")
    say(f"report: {out}/report.md")
    final_json({"benchmark": NAME, "prompt_tokens": f["prompt_tokens"], "requests": f["requests"],
                "sse_ttft_p50_ms": f["sse"]["ttft"]["p50_ms"],
                "nnrp_ttft_p50_ms": f["nnrp"]["ttft"]["p50_ms"],
                "ttft_p50_ratio": f["ttft_p50_ratio"], "total_p50_ratio": f["total_p50_ratio"],
                "inflight_after": leftover})


def _markdown(f: dict[str, Any]) -> str:
    rows = ["| measure | HTTP/SSE p50 (min-max) ms | NNRP p50 (min-max) ms | NNRP / SSE p50 |",
            "|---|---|---|---|"]
    for key, label, ratio in (("ttft", "TTFT", f["ttft_p50_ratio"]),
                              ("total", "total", f["total_p50_ratio"])):
        s, n = f["sse"][key], f["nnrp"][key]
        rows.append(f"| {label} | {s['p50_ms']} ({s['min_ms']}-{s['max_ms']}) | "
                    f"{n['p50_ms']} ({n['min_ms']}-{n['max_ms']}) | {ratio} |")
    return (f"# Long-context chat, NNRP vs HTTP/SSE\n\n{f['requests']} requests per door, "
            f"~{f['prompt_tokens']} prompt tokens of a {f['max_model_len']}-token context, "
            f"{f['max_tokens']} output tokens, greedy, one at a time, doors alternating; real "
            f"`--tokens-only` vLLM engine and render sidecar on CPU, no prefix reuse between requests.\n\n"
            + "\n".join(rows) + f"\n\n![plot]({NAME}.png)\n")


def _plot(f: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (door, label) in enumerate((("sse", "HTTP/SSE"), ("nnrp", "NNRP"))):
        vals = f.get("runs_ms", {}).get(door, [])
        ax.scatter([i - 0.1] * len(vals), [v[0] for v in vals], marker="o", label=f"{label} TTFT")
        ax.scatter([i + 0.1] * len(vals), [v[1] for v in vals], marker="x", label=f"{label} total")
    ax.set_xticks([0, 1], ["HTTP/SSE", "NNRP"])
    ax.set_ylabel("ms")
    ax.set_title(f"~{f['prompt_tokens']}-token prompt, {f['max_tokens']} output tokens")
    ax.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
