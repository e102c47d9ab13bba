"""How long an engine chunk takes to reach an NNRP client, next to an HTTP/SSE client, and how fast a
cancel frame ends an operation.

Why: the NNRP door runs the same pipeline as the OpenAI door and adds the profile mapping, credits
and result frames over a WebSocket. The question a client asks is what that adds per streamed
chunk, and whether a cancel really stops the operation at once.

Set-up: a coordinator embedded in this process, a real vLLM render sidecar (or ``--render-url``), a
simulated engine in this process (``mode="context"``: one word per token, a fixed time per token).
The engine's app gets an ASGI tap defined here (the coordinator is untouched) that timestamps every
token chunk of a ``/generate`` stream when it is handed to the engine's server, and the moment the
engine sees its client go. All clocks are this process's ``time.perf_counter``.

Measured, one request at a time, the two doors alternating request by request on the same engine:

* **push latency**: engine chunk k handed to the server → the k-th text event at the client (an SSE
  ``data:`` line with content, read with httpx; a ``response.output_text.delta`` iterated from the
  NNRP client library, JSON frames). A request whose event count differs from its engine chunk count
  (coalesced derender calls) is left out and counted;
* **TTFT** from the client's send to its first text event, and the whole stream;
* **cancel**: after ``--cancel-after`` events the NNRP client sends a cancel frame; cancel → the
  operation's last event (``response.cancelled``), how many text events still arrived after it, and
  cancel → the engine seeing its stream closed. The same run measures, as baselines, a ping → pong
  round trip on the same session (the floor for any control frame) and, on the HTTP door, the client
  closing its SSE connection → the engine seeing its stream closed.

Everything shares this process's GIL and the machine's cores, so absolute figures include the
harness; both doors pay it equally, which is why the ratios are the result.

    python -m perf.nnrp_latency [--requests 30] [--max-tokens 32] [--decode-ms 10] [--cancels 20]
        [--render-url URL] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.config import EngineSettings, ModelSettings, RenderSettings, Settings
from coordinator.embedded import EmbeddedCoordinator, free_port
from coordinator.nnrp.client import NnrpClient
from coordinator.nnrp.profile import CANCELLED, OUTPUT_TEXT_DELTA, TERMINAL_EVENT_TYPES
from perf._report import Progress, final_json, pct, save_figure, write_report
from token_engine.simulator import SimConfig, SimulatedEngine

NAME = "nnrp_latency"
SERVED = "smollm2-135m-instruct"
QUESTION = "Tell me about the history of Paris in a few sentences."


# ------------------------------------------------------------------------------------ engine tap
@dataclass
class StreamRecord:
    """One engine ``/generate`` stream as the engine's server saw it."""

    chunks: list[float] = field(default_factory=list)   # token chunks handed to the server
    disconnect: float | None = None                      # the engine's client went away
    ended: float | None = None                           # the engine's handler returned


class EmissionTap:
    """ASGI middleware for the simulated engine: records a ``StreamRecord`` per generate request.

    Only timestamps, at the ASGI boundary, so what is measured is the engine's server handing a chunk
    to its socket, not anything inside the coordinator."""

    def __init__(self, app: ASGIApp, records: list[StreamRecord]) -> None:
        self.app = app
        self.records = records

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/generate"):
            await self.app(scope, receive, send)
            return
        rec = StreamRecord()
        self.records.append(rec)

        async def tapped_send(message: Message) -> None:
            if message["type"] == "http.response.body":
                body = message.get("body", b"")
                if b'"token_ids":[' in body and b'"token_ids":[]' not in body:
                    rec.chunks.append(time.perf_counter())
            await send(message)

        async def tapped_receive() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and rec.disconnect is None:
                rec.disconnect = time.perf_counter()
            return message

        try:
            await self.app(scope, tapped_receive, tapped_send)
        finally:
            rec.ended = time.perf_counter()


# ------------------------------------------------------------------------------------- clients
@dataclass
class Timing:
    """One streamed request at the client: send time, text-event arrival times, end."""

    t0: float
    arrivals: list[float]
    end: float

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.t0 if self.arrivals else float("nan")

    @property
    def total(self) -> float:
        return self.end - self.t0


def chat_body(max_tokens: int, content: str = QUESTION, stream: bool = True) -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": content}], "stream": stream,
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}


def _has_text(line: str) -> bool:
    if not line.startswith("data: {"):
        return False
    chunk = json.loads(line[6:])
    return any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ())


async def sse_request(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                      stop_after: int | None = None) -> tuple[Timing, float | None]:
    """Stream one chat request over HTTP/SSE. With ``stop_after``, close the connection after that many
    text events (the HTTP door's cancel); returns the timing and when the close began."""
    t0 = time.perf_counter()
    arrivals: list[float] = []
    closed_at: float | None = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            t = time.perf_counter()
            if _has_text(line):
                arrivals.append(t)
                if stop_after is not None and len(arrivals) >= stop_after:
                    closed_at = time.perf_counter()
                    break
    return Timing(t0, arrivals, time.perf_counter()), closed_at


async def nnrp_request(nnrp: NnrpClient, body: dict[str, Any]) -> Timing:
    """One chat operation on an open session; arrivals are text-delta events as the client yields them."""
    t0 = time.perf_counter()
    arrivals: list[float] = []
    op = await nnrp.chat(body)
    async for event in op:
        t = time.perf_counter()
        if event["type"] == OUTPUT_TEXT_DELTA:
            arrivals.append(t)
        elif event["type"] in TERMINAL_EVENT_TYPES and event["type"] != "response.completed":
            raise RuntimeError(f"operation ended with {event}")
    return Timing(t0, arrivals, time.perf_counter())


@dataclass
class CancelResult:
    to_last_event: float
    events_after: int
    to_engine_closed: float | None
    last_type: str


async def nnrp_cancel(nnrp: NnrpClient, body: dict[str, Any], after: int) -> tuple[float, CancelResult]:
    """Submit, read ``after`` text events, send a cancel frame; cancel → last event, events after it."""
    op = await nnrp.chat(body)
    sent: float | None = None
    n = after_cancel = 0
    last = 0.0
    last_type = ""
    async for event in op:
        last, last_type = time.perf_counter(), event["type"]
        if event["type"] == OUTPUT_TEXT_DELTA:
            n += 1
            if sent is not None:
                after_cancel += 1
            elif n >= after:
                sent = time.perf_counter()
                await op.cancel("benchmark")
    if sent is None:
        raise RuntimeError("the operation ended before it could be cancelled")
    return sent, CancelResult(last - sent, after_cancel, None, last_type)


# ----------------------------------------------------------------------------------- stack set-up
@contextmanager
def render_url(given: str | None, say: Callable[[str], None]) -> Iterator[tuple[str, int | None]]:
    """The given sidecar URL, or a real vLLM render sidecar started here (and its renderer workers)."""
    if given:
        yield given, None
        return
    from render_sidecar.launch import RenderSidecar
    from token_engine.model_prep import ensure_model

    say("preparing model, starting the render sidecar (real vLLM)")
    render = RenderSidecar(ensure_model(), port=free_port(), served_model_name=SERVED, echo=False)
    render.start()
    try:
        render.wait_ready(timeout=600)
        yield render.url, render.renderer_num_workers
    finally:
        render.stop()


def settings_for(render: str, engine_url: str) -> Settings:
    """The default settings for one render sidecar and one engine."""
    return Settings(render=RenderSettings(url=render), engines=[EngineSettings(url=engine_url)],
                    models=[ModelSettings(name=SERVED)])


def ws_url(http_url: str) -> str:
    return http_url.replace("http://", "ws://", 1) + "/nnrp/v1"


async def engine_closed(rec: StreamRecord) -> float | None:
    """When the engine saw its stream closed (its client gone, or its handler returned); None if it did
    not within 3 s."""
    for _ in range(600):
        seen = rec.disconnect or rec.ended
        if seen is not None:
            return seen
        await asyncio.sleep(0.005)
    return None


# --------------------------------------------------------------------------------------- the run
def push_latencies(timing: Timing, rec: StreamRecord) -> list[float] | None:
    """Engine chunk k → client text event k; None when the counts differ (coalesced calls)."""
    if len(timing.arrivals) != len(rec.chunks) or not rec.chunks:
        return None
    return [a - e for a, e in zip(timing.arrivals, rec.chunks, strict=True)]


async def measure(url: str, records: list[StreamRecord], args: argparse.Namespace,
                  say: Callable[[str], None]) -> dict[str, Any]:
    body = chat_body(args.max_tokens)
    push: dict[str, list[float]] = {"sse": [], "nnrp": []}
    ttft: dict[str, list[float]] = {"sse": [], "nnrp": []}
    total: dict[str, list[float]] = {"sse": [], "nnrp": []}
    skipped = {"sse": 0, "nnrp": 0}
    async with httpx.AsyncClient(timeout=60) as http:
        nnrp = await NnrpClient.connect(ws_url(url), credits=256)
        try:
            say("warm-up: 2 requests per door")
            for _ in range(2):
                await sse_request(http, url, body)
                await nnrp_request(nnrp, body)
            say(f"push latency: {args.requests} requests per door, alternating")
            for i in range(2 * args.requests):
                door = ("sse", "nnrp")[(i + i // 2) % 2]   # sse,nnrp,nnrp,sse,...: neither always first
                if door == "sse":
                    timing, _ = await sse_request(http, url, body)
                else:
                    timing = await nnrp_request(nnrp, body)
                lat = push_latencies(timing, records[-1])
                ttft[door].append(timing.ttft)
                total[door].append(timing.total)
                if lat is None:
                    skipped[door] += 1
                else:
                    push[door].extend(lat)
            say("cancel: NNRP cancel frames, HTTP disconnects, pings")
            long_body = chat_body(args.cancel_after + 200)
            cancels: list[CancelResult] = []
            http_close: list[float] = []
            pings: list[float] = []
            for i in range(args.cancels):
                t = time.perf_counter()
                await nnrp.ping(i + 1)
                pings.append(time.perf_counter() - t)
                sent, res = await nnrp_cancel(nnrp, long_body, args.cancel_after)
                seen = await engine_closed(records[-1])
                res.to_engine_closed = None if seen is None else seen - sent
                cancels.append(res)
                _, closed = await sse_request(http, url, long_body, stop_after=args.cancel_after)
                seen = await engine_closed(records[-1])
                if closed is not None and seen is not None:
                    http_close.append(seen - closed)
        finally:
            await nnrp.close()
    return {"push": push, "ttft": ttft, "total": total, "skipped": skipped, "cancels": cancels,
            "http_close": http_close, "pings": pings}


def _ms(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {"p50_ms": round(pct(ms, 50), 3), "p95_ms": round(pct(ms, 95), 3), "n": len(ms)}


def summarize(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    f: dict[str, Any] = {"benchmark": NAME, "quick": args.quick, "requests": args.requests,
                         "max_tokens": args.max_tokens, "decode_ms": args.decode_ms, "cancels": args.cancels,
                         "cancel_after": args.cancel_after, "skipped_requests": raw["skipped"]}
    for door in ("sse", "nnrp"):
        f[door] = {"push": _ms(raw["push"][door]), "ttft": _ms(raw["ttft"][door]),
                   "total": _ms(raw["total"][door])}
    f["push_p50_ratio"] = round(f["nnrp"]["push"]["p50_ms"] / f["sse"]["push"]["p50_ms"], 3)
    f["push_p95_ratio"] = round(f["nnrp"]["push"]["p95_ms"] / f["sse"]["push"]["p95_ms"], 3)
    f["ttft_p50_ratio"] = round(f["nnrp"]["ttft"]["p50_ms"] / f["sse"]["ttft"]["p50_ms"], 3)
    cancels: list[CancelResult] = raw["cancels"]
    engine = [c.to_engine_closed for c in cancels if c.to_engine_closed is not None]
    f["cancel"] = {"to_last_event": _ms([c.to_last_event for c in cancels]),
                   "to_engine_closed": _ms(engine),
                   "events_after_cancel_max": max((c.events_after for c in cancels), default=0),
                   "events_after_cancel_total": sum(c.events_after for c in cancels),
                   "last_event_is_cancelled": all(c.last_type == CANCELLED for c in cancels),
                   "ping_rtt": _ms(raw["pings"]), "http_close_to_engine_closed": _ms(raw["http_close"])}
    f["cancel_vs_ping_p50_ratio"] = round(f["cancel"]["to_last_event"]["p50_ms"]
                                          / f["cancel"]["ping_rtt"]["p50_ms"], 3)
    return f


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=30, help="requests per door for push latency")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--decode-ms", type=float, default=10.0, help="simulated engine time per token")
    ap.add_argument("--cancels", type=int, default=20, help="cancelled operations (and HTTP disconnects)")
    ap.add_argument("--cancel-after", type=int, default=8, help="text events read before cancelling")
    ap.add_argument("--render-url", help="use this render sidecar instead of starting a real one")
    ap.add_argument("--quick", action="store_true", help="smoke run: 3 requests of 8 tokens, 2 cancels")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.max_tokens, args.cancels, args.cancel_after = 3, 8, 2, 3
    say = Progress(NAME)
    records: list[StreamRecord] = []
    sim = SimulatedEngine(SimConfig(model=SERVED, mode="context", decode_s_per_token=args.decode_ms / 1000))
    sim.app.add_middleware(EmissionTap, records=records)
    sim.start()
    try:
        with render_url(args.render_url, say) as (render, workers), \
                EmbeddedCoordinator(settings_for(render, sim.url)) as coord:
            raw = asyncio.run(measure(coord.url, records, args, say))
            leftover = coord.wait_idle()
    finally:
        sim.stop()
    f = summarize(raw, args)
    f["renderer_workers"] = workers
    f["inflight_after"] = leftover
    out = write_report(NAME, f, _markdown(f))
    _plot(raw, out / f"{NAME}.png")
    say(f"report: {out}/report.md")
    final_json({"benchmark": NAME,
                "sse_push_p50_ms": f["sse"]["push"]["p50_ms"], "sse_push_p95_ms": f["sse"]["push"]["p95_ms"],
                "nnrp_push_p50_ms": f["nnrp"]["push"]["p50_ms"],
                "nnrp_push_p95_ms": f["nnrp"]["push"]["p95_ms"],
                "push_p50_ratio": f["push_p50_ratio"], "push_p95_ratio": f["push_p95_ratio"],
                "ttft_p50_ratio": f["ttft_p50_ratio"],
                "cancel_to_last_event_p50_ms": f["cancel"]["to_last_event"]["p50_ms"],
                "cancel_to_last_event_p95_ms": f["cancel"]["to_last_event"]["p95_ms"],
                "cancel_vs_ping_p50_ratio": f["cancel_vs_ping_p50_ratio"],
                "events_after_cancel": f["cancel"]["events_after_cancel_total"],
                "inflight_after": leftover})


def _markdown(f: dict[str, Any]) -> str:
    s, n, c = f["sse"], f["nnrp"], f["cancel"]
    rows = ["| measure | HTTP/SSE p50 / p95 (ms) | NNRP p50 / p95 (ms) | NNRP / SSE p50 |",
            "|---|---|---|---|"]
    for key, label in (("push", "engine chunk → client event"), ("ttft", "send → first text event"),
                       ("total", "whole stream")):
        ratio = round(n[key]["p50_ms"] / s[key]["p50_ms"], 3)
        rows.append(f"| {label} | {s[key]['p50_ms']} / {s[key]['p95_ms']} | "
                    f"{n[key]['p50_ms']} / {n[key]['p95_ms']} | {ratio} |")
    crow = ["| cancel measure | p50 / p95 (ms) | n |", "|---|---|---|"]
    for key, label in (("to_last_event", "NNRP cancel frame → last event (`response.cancelled`)"),
                       ("ping_rtt", "baseline: NNRP ping → pong, same session"),
                       ("to_engine_closed", "NNRP cancel frame → engine sees its stream closed"),
                       ("http_close_to_engine_closed",
                        "HTTP client closes SSE → engine sees its stream closed")):
        crow.append(f"| {label} | {c[key]['p50_ms']} / {c[key]['p95_ms']} | {c[key]['n']} |")
    workers = f.get("renderer_workers")
    sidecar = (f"real vLLM render sidecar ({workers} renderer workers)" if workers
               else "a given render sidecar")
    return (f"# NNRP push and cancel latency\n\n{f['requests']} requests per door of {f['max_tokens']} "
            f"tokens, one at a time, doors alternating; simulated engine {f['decode_ms']} ms/token; "
            f"{sidecar}; coordinator, engine and clients in one process. Requests left out "
            f"(event count ≠ engine chunk count): {f['skipped_requests']}.\n\n" + "\n".join(rows) +
            f"\n\nCancel after {f['cancel_after']} text events, {f['cancels']} operations: last event "
            f"`response.cancelled` every time: {c['last_event_is_cancelled']}; text events that still "
            f"arrived after the cancel frame was sent: {c['events_after_cancel_total']} in total "
            f"(at most {c['events_after_cancel_max']} per operation).\n\n" + "\n".join(crow) +
            f"\n\n![plot]({NAME}.png)\n")


def _plot(raw: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for door, label in (("sse", "HTTP/SSE"), ("nnrp", "NNRP")):
        ms = sorted(v * 1000 for v in raw["push"][door])
        if ms:
            ax1.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))], label=label)
    ax1.set_xlabel("engine chunk → client event (ms)")
    ax1.set_ylabel("fraction of chunks")
    ax1.set_title("push latency (CDF)")
    ax1.legend()
    cancels: list[CancelResult] = raw["cancels"]
    data = [[c.to_last_event * 1000 for c in cancels], [p * 1000 for p in raw["pings"]],
            [c.to_engine_closed * 1000 for c in cancels if c.to_engine_closed is not None],
            [v * 1000 for v in raw["http_close"]]]
    ax2.boxplot([d or [0.0] for d in data])
    ax2.set_xticks([1, 2, 3, 4],
                   ["cancel →\nlast event", "ping\nRTT", "cancel →\nengine", "HTTP close\n→ engine"])
    ax2.set_ylabel("ms")
    ax2.set_title("cancellation")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
