"""Does one streaming derender call get dearer as the output grows?

Why: the coordinator calls vLLM's stateless streaming derender once per engine chunk (or per coalesced
batch of chunks) and carries ``stream_state`` from call to call. If the sidecar's work per call grows
with the output already streamed (state to decode and re-encode, text re-parsed by a tool parser),
long answers slow down towards their end and the per-token cost of a stream is quadratic.

Method: one render sidecar with ``--max-model-len`` large enough for the positions (SmolLM2's config
allows 8,192), started by this benchmark; a chat prompt rendered by it; a fixed English output
tokenized by it. For each position p (default 100 and 4,000) the ``stream_state`` is carried to p by
derendering the output in chunks of ``--build-chunk`` tokens, exactly as a stream would; then the
same one-token call at p is timed repeatedly (the state is not advanced, so every call does the same
work). Positions alternate in blocks to spread machine noise. Per position: client-side wall time per
call (p50) and the sidecar's CPU seconds per call. Then the same with a tool parser
(``--tool-call-parser hermes --enable-auto-tool-choice``, a request with ``tools``: the sidecar then
needs the full prompt ids on every call, as the coordinator sends them).

    python -m perf.derender_cost [--positions 100,4000] [--calls 40] [--rounds 5] [--no-parser]
        [--render-url URL] [--parser-render-url URL] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from perf._procs import SERVED, cpu_sum, render_sidecars, sidecar_pid
from perf._report import Progress, final_json, pct, save_figure, write_report

NAME = "derender_cost"
MAX_MODEL_LEN = 8192   # SmolLM2-135M-Instruct: max_position_embeddings 8192
TARGET_RATIO = 1.5     # without a parser
QUESTION = "Tell me a long story about a lighthouse keeper."
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather in a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"]}},
}
SENTENCES = ("The keeper climbed the stairs at dusk and lit the lamp. ",
             "Ships passed far out in the dark, and the light turned slowly over the water. ",
             "In the morning he wrote the weather into his book and slept until noon. ")


class Leg:
    """One sidecar, one chat request shape (plain or with tools), its prompt ids and output ids."""

    def __init__(self, url: str, parser: bool, need: int) -> None:
        self.url = url
        self.parser = parser
        body: dict[str, Any] = {"model": SERVED, "messages": [{"role": "user", "content": QUESTION}],
                                "stream": True, "max_tokens": need + 8}
        if parser:
            body["tools"] = [WEATHER_TOOL]
        r = httpx.post(f"{url}/v1/chat/completions/render", json=body, timeout=60)
        r.raise_for_status()
        self.prompt_ids: list[int] = r.json()["token_ids"]
        # What the coordinator sends per chunk: every option, a stub conversation.
        self.chat_request = {**body, "messages": [{"role": "user", "content": ""}]}
        text, ids = "", list[int]()
        while len(ids) < need:
            text += "".join(SENTENCES) * 10
            t = httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60)
            t.raise_for_status()
            ids = t.json()["tokens"]
        self.output_ids: list[int] = ids
        self.http = httpx.Client(base_url=url, timeout=60)

    def call(self, tokens: list[int], state: dict[str, Any] | None) -> dict[str, Any] | None:
        seed = self.prompt_ids if self.parser else (self.prompt_ids[-8:] if state is None else None)
        body = {"stream": True, "model": SERVED, "stream_state": state, "prompt_tokens": len(self.prompt_ids),
                "prompt_token_ids": seed, "chat_request": self.chat_request,
                "generate_chunk": {"request_id": "cost", "choices": [
                    {"index": 0, "finish_reason": None, "stop_reason": None, "token_ids": tokens}]}}
        r = self.http.post("/v1/chat/completions/derender", json=body)
        r.raise_for_status()
        out: dict[str, Any] | None = r.json().get("stream_state")
        return out

    def state_at(self, position: int, build_chunk: int) -> dict[str, Any] | None:
        state = None
        for lo in range(0, position, build_chunk):
            state = self.call(self.output_ids[lo:min(position, lo + build_chunk)], state)
        return state


def measure(leg: Leg, positions: list[int], calls: int, rounds: int, build_chunk: int,
            pid: int | None, say: Progress) -> dict[str, Any]:
    states = {p: leg.state_at(p, build_chunk) for p in positions}
    walls: dict[int, list[float]] = {p: [] for p in positions}
    cpu: dict[int, list[float]] = {p: [] for p in positions}
    for p in positions:                     # warm-up
        leg.call([leg.output_ids[p]], states[p])
    for r in range(rounds):
        for p in positions if r % 2 == 0 else reversed(positions):
            c0 = cpu_sum([pid])
            for _ in range(calls):
                t0 = time.perf_counter()
                leg.call([leg.output_ids[p]], states[p])
                walls[p].append(time.perf_counter() - t0)
            c1 = cpu_sum([pid])
            if c0 is not None and c1 is not None:
                cpu[p].append((c1 - c0) / calls)
    res: dict[str, Any] = {}
    for p in positions:
        res[str(p)] = {"wall_p50_ms": round(pct(walls[p], 50) * 1000, 3),
                       "wall_p90_ms": round(pct(walls[p], 90) * 1000, 3),
                       "sidecar_cpu_ms_per_call":
                           round(statistics.median(cpu[p]) * 1000, 3) if cpu[p] else None,
                       "state_bytes": len(json.dumps(states[p]))}
        say(f"  {'parser' if leg.parser else 'plain'} @ {p}: {res[str(p)]}")
    lo, hi = str(positions[0]), str(positions[-1])
    ratio = round(res[hi]["wall_p50_ms"] / res[lo]["wall_p50_ms"], 3)
    cpu_lo, cpu_hi = res[lo]["sidecar_cpu_ms_per_call"], res[hi]["sidecar_cpu_ms_per_call"]
    return {"positions": res, "cost_ratio": ratio,
            "cpu_ratio": round(cpu_hi / cpu_lo, 3) if cpu_lo and cpu_hi else None}


@contextmanager
def sidecar(url: str | None, parser: bool, say: Progress,
            log_dir: Path) -> Iterator[tuple[str, int | None]]:
    if url:
        yield url, None
        return
    kwargs: dict[str, Any] = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True} if parser else {}
    with render_sidecars(1, say, log_dir=log_dir, max_model_len=MAX_MODEL_LEN, **kwargs) as (s,):
        yield s.url, sidecar_pid(s)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", default="100,4000", help="output positions; ratio = last / first")
    ap.add_argument("--calls", type=int, default=100,
                    help="timed calls per position per round (CPU time is read in 10 ms ticks)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--build-chunk", type=int, default=16, help="tokens per call while carrying the state")
    ap.add_argument("--no-parser", action="store_true", help="skip the tool-parser sidecar")
    ap.add_argument("--render-url", help="a running plain sidecar (max_model_len above the positions)")
    ap.add_argument("--parser-render-url", help="a running sidecar with the hermes tool parser")
    ap.add_argument("--quick", action="store_true", help="smoke run: positions 10,200, few calls")
    args = ap.parse_args(argv)
    if args.quick:
        args.positions, args.calls, args.rounds, args.build_chunk = "10,200", 5, 2, 64
    positions = sorted(int(x) for x in args.positions.split(","))
    say = Progress(NAME)
    legs = [False] if args.no_parser else [False, True]
    out_dir = write_report(NAME, {}, "# Streaming derender cost\n\n(running)\n")
    f: dict[str, Any] = {"positions": positions, "calls": args.calls, "rounds": args.rounds,
                         "build_chunk": args.build_chunk, "max_model_len": MAX_MODEL_LEN, "legs": {},
                         "quick": args.quick}
    for parser in legs:
        name = "hermes_parser" if parser else "plain"
        url = args.parser_render_url if parser else args.render_url
        if parser and args.render_url and not url:
            say("no --parser-render-url given with --render-url: the parser leg is skipped")
            continue
        with ExitStack() as stack:
            say(f"{name}: sidecar {'(given)' if url else 'starting, max_model_len ' + str(MAX_MODEL_LEN)}")
            surl, pid = stack.enter_context(sidecar(url, parser, say, out_dir))
            leg = Leg(surl, parser, positions[-1] + 1)
            say(f"{name}: prompt {len(leg.prompt_ids)} tokens; carrying stream_state to {positions}")
            f["legs"][name] = measure(leg, positions, args.calls, args.rounds, args.build_chunk, pid, say)
            f["legs"][name]["prompt_tokens"] = len(leg.prompt_ids)
    plain = f["legs"]["plain"]
    f["cost_ratio"] = plain["cost_ratio"]
    f["target_ratio"] = TARGET_RATIO
    f["target_met"] = plain["cost_ratio"] <= TARGET_RATIO
    out = write_report(NAME, f, _markdown(f))
    _plot(f, out / f"{NAME}.png")
    say(f"report: {out}/report.md, plot: {out}/{NAME}.png")
    lo, hi = positions[0], positions[-1]
    head: dict[str, Any] = {"benchmark": NAME}
    for name, leg_f in f["legs"].items():
        prefix = "" if name == "plain" else f"{name}_"
        head[f"{prefix}cost_ratio_{hi}_vs_{lo}"] = leg_f["cost_ratio"]
        head[f"{prefix}cpu_ratio_{hi}_vs_{lo}"] = leg_f["cpu_ratio"]
        head[f"{prefix}ms_per_call_at_{lo}"] = leg_f["positions"][str(lo)]["wall_p50_ms"]
        head[f"{prefix}ms_per_call_at_{hi}"] = leg_f["positions"][str(hi)]["wall_p50_ms"]
    head.update({"target_ratio": TARGET_RATIO, "target_met": f["target_met"]})
    final_json(head)


def _markdown(f: dict[str, Any]) -> str:
    ps = f["positions"]
    rows = ["| sidecar | " + " | ".join(f"ms per call @ {p} (p50 / p90)" for p in ps)
            + " | " + " | ".join(f"sidecar CPU ms per call @ {p}" for p in ps)
            + " | " + " | ".join(f"stream_state bytes @ {p}" for p in ps)
            + f" | wall ratio {ps[-1]} vs {ps[0]} | CPU ratio |", "|---" * (3 * len(ps) + 3) + "|"]
    for name, leg in f["legs"].items():
        pos = leg["positions"]
        rows.append(f"| {name} | " + " | ".join(f"{pos[str(p)]['wall_p50_ms']} / {pos[str(p)]['wall_p90_ms']}"
                                                for p in ps)
                    + " | " + " | ".join(str(pos[str(p)]["sidecar_cpu_ms_per_call"]) for p in ps)
                    + " | " + " | ".join(str(pos[str(p)]["state_bytes"]) for p in ps)
                    + f" | **{leg['cost_ratio']}** | {leg['cpu_ratio']} |")
    verdict = "met" if f["target_met"] else "NOT met"
    return (f"# Streaming derender cost by output position\n\nOne-token streaming chat derender calls with "
            f"`stream_state` carried to each position ({f['build_chunk']} tokens per call while carrying); "
            f"{f['calls']} timed calls per position per round, {f['rounds']} rounds alternating the "
            f"positions; sidecar `--max-model-len {f['max_model_len']}`.\n\n" + "\n".join(rows)
            + f"\n\nTarget: wall ratio ≤ {f['target_ratio']} without a parser — {verdict}."
            f"\n\n![plot]({NAME}.png)\n")


def _plot(f: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = f["positions"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / max(1, len(f["legs"]))
    for i, (name, leg) in enumerate(f["legs"].items()):
        xs = [x - 0.4 + width * (i + 0.5) for x in range(len(ps))]
        ax.bar(xs, [leg["positions"][str(p)]["wall_p50_ms"] for p in ps], width, label=name)
    ax.set_xticks(range(len(ps)), [f"position {p}" for p in ps])
    ax.set_ylabel("ms per one-token derender call (p50)")
    ax.set_title("streaming derender cost vs output position")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
