"""Streaming capacity: how many tokens per second the coordinator can stream when the engine costs nothing.

Why: every engine chunk costs the coordinator one awaited derender call on the render sidecar, so
with a fast engine the streaming path, not the engine, bounds throughput. With a zero-cost simulated
engine (no decode or prefill time, one token per engine chunk, as vLLM's default stream interval) the
measured rate is the coordinator + sidecar ceiling.

Load: ``--streams`` concurrent chat streams (distinct prompts) of ``--tokens`` tokens each
(``ignore_eos``), one wave; rate = streamed tokens / wall time of the wave. Baseline in the same run:
the same rendered token ids straight at the engine's ``/inference/v1/generate``.

Matrix: 1 and ``--sidecars`` render sidecar processes (``render.urls``; skipped while the coordinator
only has ``render.url``) x ``stream.coalesce`` off/on. Each cell gets a fresh coordinator child
process (so its CPU is measurable and it does not share the load generator's event loop). Per cell:
``streamed_tokens_per_s``; ``derender_calls_per_token`` (from the sidecars' own
``http_requests_total`` of the derender routes); CPU seconds per 1,000 tokens of the coordinator, the
sidecars (with their renderer workers) and the engine process. The simulated output is a function of
the prompt, so every cell must stream the same texts: checked, per prompt, against the first cell.

With ``--parser hermes`` (or ``olmo3``) the run compares instead: plain streams (a sidecar without
parsers) and parser streams (requests with ``tools`` for hermes) on a sidecar with that parser and our
parser-session cache, one sidecar each, coalescing as the coordinator decides it (hermes merges calls,
olmo3 goes one token per call); target: parser tokens/s ≥ 0.5 times plain tokens/s. The same parser
streams, fewer of them (``--stateless-streams``), also go through vLLM's own render server with that
parser: their texts (content and reasoning) must equal the cached run's.

    python -m perf.capacity [--streams 64] [--tokens 256] [--sidecars 2] [--render-url URL[,URL]] [--quick]
    python -m perf.capacity --parser hermes [--streams 64] [--tokens 1024] [--stateless-streams 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from coordinator.embedded import free_port
from perf._procs import (
    SERVED,
    CoordinatorProcess,
    cpu_sum,
    own_cpu_s,
    render_config,
    render_sidecars,
    sidecar_calls,
    sidecar_pid,
    sim_engines,
    supports_render_pool,
)
from perf._report import Progress, final_json, save_figure, write_report

NAME = "capacity"
TARGET_TOKENS_PER_S = 3000.0
TARGET_PARSER_VS_PLAIN = 0.5
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather in a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"]}},
}
PARSER_FLAGS: dict[str, dict[str, Any]] = {
    "hermes": {"tool_call_parser": "hermes", "enable_auto_tool_choice": True},
    "olmo3": {"reasoning_parser": "olmo3"},
}


def prompts(n: int) -> list[str]:
    return [f"Question {i}: tell me a long story about the number {i}." for i in range(n)]


def chat_body(prompt: str, tokens: int, parser: str | None = None) -> dict[str, Any]:
    body = {"model": SERVED, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    if parser == "hermes":
        body.update(tools=[WEATHER_TOOL], tool_choice="auto")
    return body


async def _chat_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[str, int]:
    """The streamed text and the number of SSE frames with a choice."""
    parts: list[str] = []
    frames = 0
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            frame = json.loads(line[6:])
            if "error" in frame:
                raise RuntimeError(f"stream error: {frame['error']}")
            for c in frame.get("choices") or ():
                frames += 1
                delta = c.get("delta") or {}
                parts.append((delta.get("reasoning") or "") + (delta.get("content") or ""))
    return "".join(parts), frames


async def _direct_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> int:
    tokens = 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:]).get("choices") or ():
                    tokens += len(c.get("token_ids") or ())
    return tokens


async def wave_chat(url: str, texts: list[str], tokens: int,
                    parser: str | None = None) -> tuple[float, list[str], int]:
    """All prompts at once; returns wall seconds, the streamed texts (prompt order), SSE frames."""
    limits = httpx.Limits(max_connections=len(texts) + 4, max_keepalive_connections=len(texts) + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        t0 = time.perf_counter()
        out = await asyncio.gather(*(_chat_stream(client, f"{url}/v1/chat/completions",
                                                  chat_body(p, tokens, parser)) for p in texts))
        wall = time.perf_counter() - t0
    return wall, [t for t, _ in out], sum(f for _, f in out)


async def wave_direct(url: str, bodies: list[dict[str, Any]]) -> tuple[float, int]:
    limits = httpx.Limits(max_connections=len(bodies) + 4, max_keepalive_connections=len(bodies) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(_direct_stream(client, f"{url}/inference/v1/generate", b)
                                        for b in bodies))
        return time.perf_counter() - t0, sum(counts)


def coordinator_config(render_urls: list[str], engine: str, coalesce: bool) -> dict[str, Any]:
    # A long per-call timeout: on a loaded 2-core machine 64 queued derender calls can take seconds,
    # and this benchmark measures throughput, not the production timeout.
    return {"render": {**render_config(render_urls), "timeout_s": 120}, "engines": [{"url": engine}],
            "models": [{"name": SERVED}], "stream": {"coalesce": coalesce},
            "admission": {"engine_tokens": 10_000_000}}


def per_1k(cpu: float | None, tokens: int) -> float | None:
    return None if cpu is None or not tokens else round(cpu / tokens * 1000, 4)


def run_cell(label: str, render_urls: list[str], render_pids: list[int | None], engine: str,
             engine_pid: int, coalesce: bool, texts: list[str], tokens: int, log: Path,
             say: Progress, parser: str | None = None) -> tuple[dict[str, Any], list[str]]:
    cfg = coordinator_config(render_urls, engine, coalesce)
    with CoordinatorProcess(cfg, log_path=log) as coord:
        asyncio.run(wave_chat(coord.url, texts[:4], 8, parser))   # warm-up: connections, first render
        calls0 = [sidecar_calls(u) for u in render_urls]
        me = os.getpid()   # the load generator: if it saturates, the cell measures the client
        cpu0 = (cpu_sum([coord.pid]), cpu_sum(render_pids), cpu_sum([engine_pid]), own_cpu_s(me))
        try:
            wall, streamed, frames = asyncio.run(wave_chat(coord.url, texts, tokens, parser))
        except (RuntimeError, httpx.HTTPError) as exc:   # recorded; the other cells still run
            say(f"{label}: FAILED: {exc}")
            return {"label": label, "sidecars": len(render_urls), "coalesce": coalesce,
                    "error": str(exc)[:300], "streamed_tokens_per_s": 0.0}, []
        cpu1 = (cpu_sum([coord.pid]), cpu_sum(render_pids), cpu_sum([engine_pid]), own_cpu_s(me))
        calls1 = [sidecar_calls(u) for u in render_urls]
    total = len(texts) * tokens
    calls = None if None in calls0 + calls1 else sum(b - a for a, b in zip(calls0, calls1, strict=True)
                                                     if a is not None and b is not None)
    d = [None if a is None or b is None else b - a for a, b in zip(cpu0, cpu1, strict=True)]
    cell = {
        "label": label, "sidecars": len(render_urls), "coalesce": coalesce, "tokens": total,
        "wall_s": round(wall, 3), "streamed_tokens_per_s": round(total / wall, 1),
        "sse_frames": frames, "derender_calls": calls,
        "derender_calls_per_token": None if calls is None else round(calls / total, 4),
        "coordinator_cpu_s_per_1k_tokens": per_1k(d[0], total),
        "sidecar_cpu_s_per_1k_tokens": per_1k(d[1], total),
        "engine_cpu_s_per_1k_tokens": per_1k(d[2], total),
        "client_cpu_s_per_1k_tokens": per_1k(d[3], total),
        # Other work on the machine shows here: a 1-minute load average well above the core count
        # means these processes got a fraction of the CPU and the rate is not the coordinator's.
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    say(f"{label}: {cell['streamed_tokens_per_s']} tok/s, derender calls/token "
        f"{cell['derender_calls_per_token']}, CPU s/1k tokens coordinator "
        f"{cell['coordinator_cpu_s_per_1k_tokens']} sidecar {cell['sidecar_cpu_s_per_1k_tokens']}")
    return cell, streamed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--sidecars", type=int, default=2, help="N of the 1-vs-N sidecar comparison")
    ap.add_argument("--render-url", help="comma-separated running sidecars instead of starting them "
                                         "(their CPU is then not measured)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 streams x 32 tokens, 1 sidecar")
    ap.add_argument("--parser", choices=sorted(PARSER_FLAGS), help="plain vs parser streams (see above)")
    ap.add_argument("--stateless-streams", type=int, default=4,
                    help="parser streams also run through vLLM's render server, for the output check")
    args = ap.parse_args(argv)
    if args.quick:
        args.streams, args.tokens, args.sidecars = 8, 32, 1
    if args.parser:
        parser_main(args)
        return
    say = Progress(NAME)
    texts = prompts(args.streams)
    out_dir = write_report(NAME, {}, "# Streaming capacity\n\n(running)\n")
    log = out_dir / "coordinator.log"
    log.write_text("")

    with ExitStack() as stack:
        if args.render_url:
            urls = args.render_url.split(",")
            urls = urls if supports_render_pool() else urls[:1]
            pids: list[int | None] = [None] * len(urls)
        else:
            n = max(1, args.sidecars) if supports_render_pool() else 1
            sidecars = stack.enter_context(render_sidecars(n, say, log_dir=out_dir))
            urls = [s.url for s in sidecars]
            pids = [sidecar_pid(s) for s in sidecars]
        engines, engine_pid = stack.enter_context(sim_engines([zero_cost_engine()]))
        engine = engines[0]

        say(f"direct: {args.streams} streams x {args.tokens} tokens straight at the engine")
        bodies = []
        for p in texts:
            r = httpx.post(f"{urls[0]}/v1/chat/completions/render", json=chat_body(p, args.tokens),
                           timeout=30)
            r.raise_for_status()
            b = r.json()
            bodies.append({"token_ids": b["token_ids"], "stream": True,
                           "sampling_params": {**b["sampling_params"], "max_tokens": args.tokens,
                                               "ignore_eos": True}})
        asyncio.run(wave_direct(engine, bodies[:4]))
        e0 = cpu_sum([engine_pid])
        wall, got = asyncio.run(wave_direct(engine, bodies))
        e1 = cpu_sum([engine_pid])
        direct = {"wall_s": round(wall, 3), "tokens": got, "direct_tokens_per_s": round(got / wall, 1),
                  "engine_cpu_s_per_1k_tokens": per_1k(None if e0 is None or e1 is None else e1 - e0, got)}
        say(f"direct: {direct['direct_tokens_per_s']} tok/s")

        sidecar_counts = sorted({1, len(urls)})
        if not supports_render_pool() and args.sidecars > 1:
            say(f"no render.urls in this coordinator's config: {args.sidecars}-sidecar cells skipped")
        cells: list[dict[str, Any]] = []
        reference: list[str] | None = None
        mismatched: list[str] = []
        for n in sidecar_counts:
            for coalesce in (False, True):
                label = f"{n} sidecar{'s' if n > 1 else ''}, coalesce {'on' if coalesce else 'off'}"
                say(f"{label}: {args.streams} streams x {args.tokens} tokens through the coordinator")
                cell, streamed = run_cell(label, urls[:n], pids[:n], engine, engine_pid, coalesce, texts,
                                          args.tokens, log, say)
                cells.append(cell)
                if "error" in cell:
                    mismatched.append(label)
                    continue
                if reference is None:
                    reference = streamed
                diff = [i for i, (a, b) in enumerate(zip(reference, streamed, strict=True)) if a != b]
                cell["texts_identical_to_first_cell"] = not diff
                if diff:
                    mismatched.append(label)
                    say(f"{label}: {len(diff)} streamed texts differ from the first cell "
                        f"(e.g. prompt {diff[0]})")

    best = max(cells, key=lambda c: c["streamed_tokens_per_s"])
    f: dict[str, Any] = {
        "streams": args.streams, "tokens_per_stream": args.tokens, "quick": args.quick,
        "render_pool_supported": supports_render_pool(),
        "sidecars_started": None if args.render_url else len(urls),
        "direct": direct, "cells": cells, "outputs_identical": not mismatched, "mismatched_cells": mismatched,
        "target_tokens_per_s": TARGET_TOKENS_PER_S,
        "best_cell": best["label"], "streamed_tokens_per_s": best["streamed_tokens_per_s"],
        "direct_tokens_per_s": direct["direct_tokens_per_s"],
        "streamed_vs_direct": round(best["streamed_tokens_per_s"] / direct["direct_tokens_per_s"], 4),
    }
    f["target_met"] = f["streamed_tokens_per_s"] >= TARGET_TOKENS_PER_S and f["outputs_identical"]
    out = write_report(NAME, f, _markdown(f))
    _plot(f, out / f"{NAME}.png")
    say(f"report: {out}/report.md, plot: {out}/{NAME}.png")
    head: dict[str, Any] = {"benchmark": NAME, "streamed_tokens_per_s": f["streamed_tokens_per_s"],
                            "direct_tokens_per_s": f["direct_tokens_per_s"], "best_cell": f["best_cell"]}
    for c in cells:
        key = f"s{c['sidecars']}_{'coalesce' if c['coalesce'] else 'plain'}"
        head[f"{key}_tokens_per_s"] = c["streamed_tokens_per_s"]
        head[f"{key}_derender_calls_per_token"] = c.get("derender_calls_per_token")
        head[f"{key}_coordinator_cpu_s_per_1k"] = c.get("coordinator_cpu_s_per_1k_tokens")
        head[f"{key}_sidecar_cpu_s_per_1k"] = c.get("sidecar_cpu_s_per_1k_tokens")
    head.update({"outputs_identical": f["outputs_identical"], "target_tokens_per_s": TARGET_TOKENS_PER_S,
                 "target_met": f["target_met"]})
    final_json(head)


def zero_cost_engine() -> dict[str, Any]:
    """No prefill or decode time, one token per chunk (vLLM's default interval)."""
    return {"model": SERVED, "mode": "random", "ttft_s": 0.0, "decode_s_per_token": 0.0,
            "prefill_s_per_token": 0.0, "stream_interval": 1, "max_concurrency": 1024}


def parser_main(args: argparse.Namespace) -> None:
    """Plain streams vs parser streams through the cache, and the parser streams' texts against vLLM's
    stateless derender (``--parser``)."""
    from render_sidecar.launch import RenderSidecar
    from token_engine.model_prep import ensure_model

    parser: str = args.parser
    name = f"{NAME}_{parser}"
    say = Progress(name)
    texts = prompts(args.streams)
    out_dir = write_report(name, {}, f"# Streaming capacity with {parser}\n\n(running)\n")
    log = out_dir / "coordinator.log"
    log.write_text("")
    model = ensure_model()
    specs = {"plain": {}, "cached": {**PARSER_FLAGS[parser], "session_cache": True},
             "stateless": {**PARSER_FLAGS[parser], "session_cache": False}}
    with ExitStack() as stack:
        servers = {}
        for role, flags in specs.items():
            s = RenderSidecar(model, port=free_port(), served_model_name=SERVED, echo=False,
                              log_path=out_dir / f"render-{role}.log", **flags)
            s.start()
            stack.callback(s.stop)
            servers[role] = s
        say("waiting for 3 render sidecars (real vLLM): plain, cached parser, stateless parser")
        for s in servers.values():
            s.wait_ready(timeout=600)
        engines, engine_pid = stack.enter_context(sim_engines([zero_cost_engine()]))
        engine = engines[0]
        cells: dict[str, dict[str, Any]] = {}
        streamed: dict[str, list[str]] = {}
        for role, use_parser, n in (("plain", None, args.streams), ("cached", parser, args.streams),
                                    ("stateless", parser, min(args.stateless_streams, args.streams))):
            label = {"plain": "plain streams", "cached": f"{parser} streams, session cache",
                     "stateless": f"{parser} streams, vLLM's stateless derender"}[role]
            say(f"{label}: {n} streams x {args.tokens} tokens through the coordinator")
            s = servers[role]
            cells[role], streamed[role] = run_cell(label, [s.url], [sidecar_pid(s)], engine, engine_pid, True,
                                                   texts[:n], args.tokens, log, say, use_parser)
    plain, cached, stateless = cells["plain"], cells["cached"], cells["stateless"]
    k = len(streamed["stateless"])
    same = bool(streamed["cached"]) and streamed["cached"][:k] == streamed["stateless"]
    ratio = round(cached["streamed_tokens_per_s"] / plain["streamed_tokens_per_s"], 4) \
        if plain["streamed_tokens_per_s"] else 0.0
    f: dict[str, Any] = {
        "parser": parser, "streams": args.streams, "tokens_per_stream": args.tokens, "quick": args.quick,
        "stateless_streams": k, "cells": list(cells.values()),
        "plain_tokens_per_s": plain["streamed_tokens_per_s"],
        "parser_tokens_per_s": cached["streamed_tokens_per_s"],
        "stateless_parser_tokens_per_s": stateless["streamed_tokens_per_s"],
        "parser_vs_plain": ratio, "target_parser_vs_plain": TARGET_PARSER_VS_PLAIN,
        "outputs_identical_to_stateless": same,
    }
    f["target_met"] = ratio >= TARGET_PARSER_VS_PLAIN and same
    out = write_report(name, f, _parser_markdown(f))
    _parser_plot(f, out / f"{name}.png")
    say(f"report: {out}/report.md, plot: {out}/{name}.png")
    final_json({"benchmark": name, **{k: f[k] for k in (
        "plain_tokens_per_s", "parser_tokens_per_s", "stateless_parser_tokens_per_s", "parser_vs_plain",
        "outputs_identical_to_stateless", "target_parser_vs_plain", "target_met")},
        "parser_sidecar_cpu_s_per_1k": cached.get("sidecar_cpu_s_per_1k_tokens"),
        "plain_sidecar_cpu_s_per_1k": plain.get("sidecar_cpu_s_per_1k_tokens"),
        "parser_derender_calls_per_token": cached.get("derender_calls_per_token")})


def _parser_markdown(f: dict[str, Any]) -> str:
    rows = ["| cell | streams | streamed tok/s | derender calls / token | CPU s / 1k tokens: coordinator | "
            "sidecar | load avg (1 min) |", "|---|---|---|---|---|---|---|"]
    for c in f["cells"]:
        if "error" in c:
            rows.append(f"| {c['label']} | | failed: {c['error'][:120]} | | | | |")
            continue
        streams = c["tokens"] // f["tokens_per_stream"]
        rows.append(f"| {c['label']} | {streams} | {c['streamed_tokens_per_s']} | "
                    f"{_fmt(c['derender_calls_per_token'])} | {_fmt(c['coordinator_cpu_s_per_1k_tokens'])} | "
                    f"{_fmt(c['sidecar_cpu_s_per_1k_tokens'])} | {c['load_avg_1m']} |")
    verdict = "met" if f["target_met"] else "NOT met"
    return (f"# Streaming capacity with the {f['parser']} parser\n\n{f['streams']} concurrent chat streams x "
            f"{f['tokens_per_stream']} tokens (`ignore_eos`) against a zero-cost simulated engine, one "
            "sidecar per cell, each cell a fresh coordinator process; the stateless cell runs the first "
            f"{f['stateless_streams']} streams only.\n\n" + "\n".join(rows)
            + f"\n\nParser streams / plain streams: **{f['parser_vs_plain']}** (target ≥ "
            f"{f['target_parser_vs_plain']}); parser texts identical to vLLM's stateless derender: "
            f"{f['outputs_identical_to_stateless']} — {verdict}.\n\n![plot](capacity_{f['parser']}.png)\n")


def _parser_plot(f: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in f["cells"] if "error" not in c]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ax.bar(range(len(cells)), [c["streamed_tokens_per_s"] for c in cells],
           color=["tab:grey", "tab:blue", "tab:red"][:len(cells)])
    ax.set_xticks(range(len(cells)), [c["label"].replace(", ", "\n") for c in cells], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("streamed tokens/s (log)")
    ax.set_title(f"{f['streams']} streams x {f['tokens_per_stream']} tokens, zero-cost engine")
    save_figure(fig, path)


def _fmt(v: Any) -> str:
    return "n/a" if v is None else str(v)


def _markdown(f: dict[str, Any]) -> str:
    rows = ["| cell | streamed tok/s | vs direct | derender calls / token | CPU s / 1k tokens: coordinator | "
            "sidecar(s) | engine | load generator | same texts | load avg (1 min) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    d = f["direct"]
    rows.append(f"| engine direct | {d['direct_tokens_per_s']} | 1.0 | - | - | - | "
                f"{_fmt(d['engine_cpu_s_per_1k_tokens'])} | - | - | - |")
    for c in f["cells"]:
        if "error" in c:
            rows.append(f"| {c['label']} | failed: {c['error'][:120]} | | | | | | | | |")
            continue
        rows.append(f"| {c['label']} | {c['streamed_tokens_per_s']} | "
                    f"{round(c['streamed_tokens_per_s'] / d['direct_tokens_per_s'], 4)} | "
                    f"{_fmt(c['derender_calls_per_token'])} | {_fmt(c['coordinator_cpu_s_per_1k_tokens'])} | "
                    f"{_fmt(c['sidecar_cpu_s_per_1k_tokens'])} | {_fmt(c['engine_cpu_s_per_1k_tokens'])} | "
                    f"{_fmt(c['client_cpu_s_per_1k_tokens'])} | {c['texts_identical_to_first_cell']} | "
                    f"{c['load_avg_1m']} |")
    pool = "" if f["render_pool_supported"] else (
        " This coordinator has no `render.urls` yet, so only the 1-sidecar cells ran.")
    verdict = "met" if f["target_met"] else "NOT met"
    return (f"# Streaming capacity\n\n{f['streams']} concurrent chat streams x "
            f"{f['tokens_per_stream']} tokens (`ignore_eos`), one wave per cell, against a zero-cost "
            f"simulated engine (one token per chunk); "
            f"each cell a fresh coordinator process.{pool}\n\n" + "\n".join(rows)
            + f"\n\nTarget: ≥ {TARGET_TOKENS_PER_S:g} streamed tok/s with identical outputs — {verdict} "
            f"(best: {f['best_cell']}, {f['streamed_tokens_per_s']} tok/s; outputs identical across cells: "
            f"{f['outputs_identical']}).\n\n![plot]({NAME}.png)\n")


def _plot(f: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = f["cells"]
    labels = ["engine\ndirect"] + [c["label"].replace(", ", "\n") for c in cells]
    rates = [f["direct"]["direct_tokens_per_s"]] + [c["streamed_tokens_per_s"] for c in cells]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    a.bar(range(len(rates)), rates, color=["grey"] + ["tab:blue"] * len(cells))
    a.axhline(f["target_tokens_per_s"], color="red", ls="--", lw=1, label="target")
    a.set_xticks(range(len(rates)), labels, fontsize=8)
    a.set_yscale("log")
    a.set_ylabel("tokens/s (log)")
    a.set_title(f"{f['streams']} streams x {f['tokens_per_stream']} tokens")
    a.legend()
    xs = range(len(cells))
    coord = [c.get("coordinator_cpu_s_per_1k_tokens") or 0 for c in cells]
    side = [c.get("sidecar_cpu_s_per_1k_tokens") or 0 for c in cells]
    b.bar([x - 0.2 for x in xs], coord, 0.4, label="coordinator")
    b.bar([x + 0.2 for x in xs], side, 0.4, label="sidecar(s)")
    b.set_xticks(list(xs), labels[1:], fontsize=8)
    b.set_ylabel("CPU seconds per 1,000 streamed tokens")
    b.set_title("CPU cost per token")
    b.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
