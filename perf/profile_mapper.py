"""What the NNRP door's per-chunk work costs next to the HTTP door's, without an engine or a socket.

Why: every streamed chunk of an NNRP chat operation goes through ``ChatStreamMapper`` (chunk → profile
events) and becomes a ``result`` frame; the HTTP door only encodes the chunk as an SSE ``data:`` frame.
This measures both on the same chunk sequences, in the same process and run, so the ratio says how
much more CPU the NNRP door spends per chunk before the transport.

Chunk sequences have the shape the coordinator's SSE path writes (role chunk, content chunks, a finish
chunk, a usage chunk; ``docs/openai-api.md``): ``text`` (one word per chunk), ``text+chunk`` (the same
with ``include_openai_chunk``, the raw chunk attached to its event) and ``tool_calls`` (argument
fragments of one tool call). Paths, per chunk:

* ``sse``: ``coordinator.api.openai.sse.frame(chunk)``, what the HTTP door does (the baseline);
* ``map``: ``ChatStreamMapper.map_chunk`` alone (plus ``complete()`` once per stream);
* ``nnrp-json`` / ``nnrp-msgpack``: mapping, then each event copied and encoded as a result frame,
  what ``Session._pump``/``_emit`` do per chunk (``coordinator.nnrp.frames``).

Each repetition times every path once over the same streams, paths interleaved so machine noise hits
all; figures are medians over repetitions. Ratios are ``nnrp-*`` (or ``map``) time per chunk over
``sse`` time per chunk.

    python -m perf.profile_mapper [--tokens 256] [--streams 200] [--reps 7] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coordinator.api.openai.sse import frame as sse_frame
from coordinator.nnrp import frames as F
from coordinator.nnrp.profile import ChatStreamMapper
from perf._report import Progress, final_json, save_figure, write_report

NAME = "profile_mapper"
PATHS = ("sse", "map", "nnrp-json", "nnrp-msgpack")
SCENARIOS = ("text", "text+chunk", "tool_calls")
WORDS = ("The", " city", " of", " Paris", " was", " founded", " on", " the", " Île", " de", " la",
         " Cité", ",", " an", " island", " in", " the", " Seine", ".", " Its", " history", " spans", " two",
         " millennia")
Chunk = dict[str, Any]


def _chunk(choices: list[Chunk], **extra: Any) -> Chunk:
    return {"id": "chatcmpl-5f1c2a9e0b7d4c3a", "object": "chat.completion.chunk", "created": 1_760_000_000,
            "model": "smollm2-135m-instruct", "choices": choices, **extra}


def text_stream(tokens: int) -> list[Chunk]:
    """Role chunk, ``tokens`` one-word content chunks (the last with ``finish_reason``), usage chunk."""
    chunks = [_chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None}], prompt_token_ids=None, prompt_text=None)]
    for i in range(tokens):
        last = i == tokens - 1
        choice: Chunk = {"index": 0, "delta": {"content": WORDS[i % len(WORDS)]}, "logprobs": None,
                         "finish_reason": "length" if last else None, "token_ids": None}
        if last:
            choice["stop_reason"] = None
        chunks.append(_chunk([choice]))
    chunks.append(_chunk([], usage={"prompt_tokens": 40, "completion_tokens": tokens,
                                    "total_tokens": 40 + tokens}, system_fingerprint="coordinator-0a1b2c3d"))
    return chunks


def tool_stream(tokens: int) -> list[Chunk]:
    """One tool call: its id/name chunk, then ``tokens - 1`` argument fragments, finish, usage."""
    chunks = text_stream(0)[:1]
    first = {"index": 0, "id": "chatcmpl-tool-9d2f", "type": "function",
             "function": {"name": "get_weather", "arguments": ""}}
    chunks.append(_chunk([{"index": 0, "delta": {"content": None, "tool_calls": [first]}, "logprobs": None,
                           "finish_reason": None, "token_ids": None}]))
    for i in range(tokens - 1):
        frag = '{"city": "' if i == 0 else WORDS[i % len(WORDS)].strip() or "x"
        call = {"index": 0, "function": {"arguments": frag}}
        chunks.append(_chunk([{"index": 0, "delta": {"content": None, "tool_calls": [call]}, "logprobs": None,
                               "finish_reason": None, "token_ids": None}]))
    chunks.append(_chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls",
                           "stop_reason": None, "token_ids": None}]))
    chunks.append(_chunk([], usage={"prompt_tokens": 120, "completion_tokens": tokens,
                                    "total_tokens": 120 + tokens}, system_fingerprint="coordinator-0a1b2c3d"))
    return chunks


def run_sse(chunks: list[Chunk]) -> int:
    for chunk in chunks:
        sse_frame(chunk)
    return 0


def run_map(chunks: list[Chunk], include_chunk: bool) -> int:
    mapper = ChatStreamMapper(include_openai_chunk=include_chunk)
    events = 0
    for chunk in chunks:
        events += len(mapper.map_chunk(chunk))
    return events + (mapper.complete() is not None)


def run_nnrp(chunks: list[Chunk], include_chunk: bool, encoding: str) -> int:
    """As the session does per chunk: map, copy each event, build and encode its result frame."""
    mapper = ChatStreamMapper(include_openai_chunk=include_chunk)
    seq = 0
    encode = F.encode
    for chunk in chunks:
        for event in mapper.map_chunk(chunk):
            encode(F.result("op-1", seq, dict(event)), encoding)
            seq += 1
    done = mapper.complete()
    if done is not None:
        encode(F.result("op-1", seq, dict(done)), encoding)
        seq += 1
    return seq


def runner(path: str, scenario: str) -> Callable[[list[Chunk]], int]:
    include = scenario == "text+chunk"
    if path == "sse":
        return run_sse
    if path == "map":
        return lambda c: run_map(c, include)
    encoding = path.removeprefix("nnrp-")
    return lambda c: run_nnrp(c, include, encoding)


def measure(streams: dict[str, list[Chunk]], n_streams: int, reps: int,
            say: Callable[[str], None]) -> dict[str, Any]:
    """Per scenario and path: medians over ``reps`` of ns per chunk, chunks/s and events/s."""
    times: dict[tuple[str, str], list[float]] = {(s, p): [] for s in streams for p in PATHS}
    events: dict[tuple[str, str], int] = {}
    for rep in range(reps):
        for scenario, chunks in streams.items():
            order = PATHS[rep % len(PATHS):] + PATHS[:rep % len(PATHS)]   # rotate who goes first
            for path in order:
                fn = runner(path, scenario)
                fn(chunks)   # warm
                t0 = time.perf_counter()
                n = 0
                for _ in range(n_streams):
                    n += fn(chunks)
                times[(scenario, path)].append(time.perf_counter() - t0)
                events[(scenario, path)] = n
        say(f"repetition {rep + 1}/{reps} done")
    out: dict[str, Any] = {}
    for scenario, chunks in streams.items():
        n_chunks = len(chunks) * n_streams
        cell: dict[str, Any] = {"chunks_per_stream": len(chunks)}
        for path in PATHS:
            runs = times[(scenario, path)]
            t = statistics.median(runs)
            ev = events[(scenario, path)] or events[(scenario, "map")]   # sse makes no events: same count
            cell[path] = {"ns_per_chunk": round(t / n_chunks * 1e9, 1), "chunks_per_s": round(n_chunks / t),
                          "events_per_s": round(ev / t), "events_per_stream": ev // n_streams,
                          "spread_pct": round((max(runs) / min(runs) - 1) * 100, 1)}
        base = cell["sse"]["ns_per_chunk"]
        cell["ratio_vs_sse"] = {p: round(cell[p]["ns_per_chunk"] / base, 2) for p in PATHS if p != "sse"}
        out[scenario] = cell
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256, help="content (or tool-argument) chunks per stream")
    ap.add_argument("--streams", type=int, default=200, help="streams per path and repetition")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="smoke run: 16 tokens, 5 streams, 2 repetitions")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.streams, args.reps = 16, 5, 2
    say = Progress(NAME)
    streams = {"text": text_stream(args.tokens), "text+chunk": text_stream(args.tokens),
               "tool_calls": tool_stream(args.tokens)}
    say(f"{len(SCENARIOS)} scenarios x {len(PATHS)} paths, {args.streams} streams of {args.tokens} tokens, "
        f"{args.reps} repetitions")
    cells = measure(streams, args.streams, args.reps, say)
    figures: dict[str, Any] = {"benchmark": NAME, "tokens": args.tokens, "streams": args.streams,
                               "reps": args.reps, "quick": args.quick, "scenarios": cells}
    out = write_report(NAME, figures, _markdown(figures))
    _plot(figures, out / f"{NAME}.png")
    say(f"report: {out}/report.md")
    text = cells["text"]
    final_json({"benchmark": NAME, "tokens": args.tokens,
                "map_events_per_s": text["map"]["events_per_s"],
                "nnrp_json_events_per_s": text["nnrp-json"]["events_per_s"],
                "nnrp_msgpack_events_per_s": text["nnrp-msgpack"]["events_per_s"],
                "sse_chunks_per_s": text["sse"]["chunks_per_s"],
                "map_vs_sse_ratio": text["ratio_vs_sse"]["map"],
                "nnrp_json_vs_sse_ratio": text["ratio_vs_sse"]["nnrp-json"],
                "nnrp_msgpack_vs_sse_ratio": text["ratio_vs_sse"]["nnrp-msgpack"],
                "tool_calls_nnrp_json_vs_sse_ratio": cells["tool_calls"]["ratio_vs_sse"]["nnrp-json"],
                "with_chunk_nnrp_json_vs_sse_ratio": cells["text+chunk"]["ratio_vs_sse"]["nnrp-json"]})


def _markdown(f: dict[str, Any]) -> str:
    rows = ["| scenario | path | ns per chunk | chunks/s | events/s | ratio to sse | spread over reps |",
            "|---|---|---|---|---|---|---|"]
    for scenario, cell in f["scenarios"].items():
        for path in PATHS:
            v = cell[path]
            ratio = "1.00 (baseline)" if path == "sse" else f"{cell['ratio_vs_sse'][path]:.2f}"
            events = "n/a" if path == "sse" else f"{v['events_per_s']:,}"
            rows.append(f"| {scenario} | {path} | {v['ns_per_chunk']:,} | {v['chunks_per_s']:,} | {events} | "
                        f"{ratio} | {v['spread_pct']}% |")
    text = f["scenarios"]["text"]
    return (f"# NNRP profile mapping cost\n\n{f['streams']} streams of {f['tokens']} tokens per path and "
            f"repetition, {f['reps']} repetitions (medians), one process, no engine. `sse` is the HTTP "
            f"door's per-chunk work (the baseline); `map` the profile mapping alone; `nnrp-*` mapping plus "
            f"the result frame's encoding.\n\n" + "\n".join(rows) +
            f"\n\nPlain text: the NNRP door's per-chunk work (JSON frames) is "
            f"{text['ratio_vs_sse']['nnrp-json']}x the SSE door's, "
            f"{text['nnrp-json']['ns_per_chunk'] - text['sse']['ns_per_chunk']:,.0f} ns more per chunk.\n\n"
            f"![plot]({NAME}.png)\n")


def _plot(f: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(f["scenarios"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(PATHS)
    for i, p in enumerate(PATHS):
        xs = [j + (i - (len(PATHS) - 1) / 2) * width for j in range(len(scenarios))]
        ax.bar(xs, [f["scenarios"][s][p]["ns_per_chunk"] / 1000 for s in scenarios], width, label=p)
    ax.set_xticks(range(len(scenarios)), scenarios)
    ax.set_ylabel("µs per chunk (median)")
    ax.set_title("per-chunk CPU: SSE frame vs NNRP mapping + result frame")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
