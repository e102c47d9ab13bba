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
call (p50) and the sidecar's CPU seconds per call.

Then the parser legs, each on a sidecar of its own: the hermes tool parser (a request with ``tools``)
and the olmo3 reasoning parser (the output opens with ``<think>``), each twice:

* **stateless**: vLLM's own render server; the full prompt ids on every call, as the coordinator sends
  them to such a sidecar; every call replays the stream (the same call at p is repeated);
* **cached**: our render server (``render_sidecar.server``) with its parser-session cache; the prompt
  ids only on the first call, as the coordinator sends them there. A session follows its stream, so
  here the timed calls *advance* the stream one token each from p (p, p+1, ..., p+calls-1), which is
  what a real stream does.

Last, the parser's own work as native ``vllm serve`` pays it: vLLM's parser class driven in this
process one delta at a time, timed per token at each position (no HTTP, no JSON).

Targets: plain ``cost_ratio`` ≤ 1.5; each cached leg's ``cost_ratio`` ≤ 1.5; each cached leg's
sidecar CPU per call ≤ 1.5 times the plain leg's at every position.

    python -m perf.derender_cost [--positions 100,4000] [--calls 100] [--rounds 5] [--no-parser]
        [--render-url URL] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec

from perf._procs import SERVED, cpu_sum, render_sidecars, sidecar_pid
from perf._report import Progress, final_json, pct, save_figure, write_report


class _Answer(msgspec.Struct):
    stream_state: msgspec.Raw = msgspec.Raw(b"null")


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(_Answer).decode
NAME = "derender_cost"
MAX_MODEL_LEN = 8192   # SmolLM2-135M-Instruct: max_position_embeddings 8192
TARGET_RATIO = 1.5     # plain and cached-parser legs; and cached CPU per call vs plain
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


LEGS: dict[str, dict[str, Any]] = {
    # name: sidecar flags, request/output shape, whether the timed calls advance the stream
    "plain": {"sidecar": {}, "parser": None, "advance": False},
    "hermes_stateless": {"sidecar": {"tool_call_parser": "hermes", "enable_auto_tool_choice": True,
                                     "session_cache": False}, "parser": "hermes", "advance": False},
    "hermes_cached": {"sidecar": {"tool_call_parser": "hermes", "enable_auto_tool_choice": True,
                                  "session_cache": True}, "parser": "hermes", "advance": True},
    "olmo3_stateless": {"sidecar": {"reasoning_parser": "olmo3", "session_cache": False},
                        "parser": "olmo3", "advance": False},
    "olmo3_cached": {"sidecar": {"reasoning_parser": "olmo3", "session_cache": True},
                     "parser": "olmo3", "advance": True},
}


class Leg:
    """One sidecar, one chat request shape (plain, with tools, or a reasoning answer), its prompt ids
    and output ids."""

    def __init__(self, url: str, parser: str | None, need: int, *, cached: bool = False) -> None:
        self.url = url
        self.parser = parser
        self.cached = cached
        body: dict[str, Any] = {"model": SERVED, "messages": [{"role": "user", "content": QUESTION}],
                                "stream": True, "max_tokens": need + 8}
        if parser == "hermes":
            body["tools"] = [WEATHER_TOOL]
        r = httpx.post(f"{url}/v1/chat/completions/render", json=body, timeout=60)
        r.raise_for_status()
        self.prompt_ids: list[int] = r.json()["token_ids"]
        # What the coordinator sends per chunk: every option, a stub conversation.
        self.chat_request = {**body, "messages": [{"role": "user", "content": ""}]}
        text, ids = ("<think>" if parser == "olmo3" else ""), list[int]()
        while len(ids) < need:
            text += "".join(SENTENCES) * 10
            t = httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60)
            t.raise_for_status()
            ids = t.json()["tokens"]
        self.output_ids: list[int] = ids
        self.http = httpx.Client(base_url=url, timeout=60)

    def call(self, tokens: list[int], state: Any) -> Any:
        if self.parser and not (self.cached and state is not None):
            seed: list[int] | None = self.prompt_ids
        else:
            seed = self.prompt_ids[-8:] if state is None and not self.parser else None
        body = {"stream": True, "model": SERVED, "stream_state": state, "prompt_tokens": len(self.prompt_ids),
                "prompt_token_ids": seed, "chat_request": self.chat_request,
                "generate_chunk": {"request_id": "cost", "choices": [
                    {"index": 0, "finish_reason": None, "stop_reason": None, "token_ids": tokens}]}}
        # As the coordinator does: msgspec both ways, and the state kept as the raw JSON the sidecar
        # wrote (never decoded, sent back byte for byte), so the client's own work stays small.
        r = self.http.post("/v1/chat/completions/derender", content=_encode(body),
                           headers={"content-type": "application/json"})
        if r.status_code == 409:  # the session is elsewhere: send the prompt ids, as the coordinator does
            r = self.http.post("/v1/chat/completions/derender",
                               content=_encode({**body, "prompt_token_ids": self.prompt_ids}),
                               headers={"content-type": "application/json"})
        r.raise_for_status()
        state_json = _decode(r.content).stream_state
        return None if bytes(state_json) == b"null" else state_json

    def state_at(self, position: int, build_chunk: int) -> Any:
        state = None
        for lo in range(0, position, build_chunk):
            state = self.call(self.output_ids[lo:min(position, lo + build_chunk)], state)
        return state


def measure(leg: Leg, positions: list[int], calls: int, rounds: int, build_chunk: int,
            pid: int | None, say: Progress, *, advance: bool = False) -> dict[str, Any]:
    """Time one-token calls at each position. ``advance``: each timed call continues the stream from
    the previous one (p, p+1, ...; a round starts again from the state carried to p, which a cached
    sidecar serves by one replay first, untimed)."""
    states = {p: leg.state_at(p, build_chunk) for p in positions}
    walls: dict[int, list[float]] = {p: [] for p in positions}
    cpu: dict[int, list[float]] = {p: [] for p in positions}
    for p in positions:                     # warm-up
        leg.call([leg.output_ids[p]], states[p])
    for r in range(rounds):
        for p in positions if r % 2 == 0 else reversed(positions):
            state = states[p]
            if advance:  # the state at p is not the session's any more: one untimed replay brings it back
                state = leg.call([leg.output_ids[p]], state)
            c0 = cpu_sum([pid])
            for i in range(calls):
                token = [leg.output_ids[p + 1 + i if advance else p]]
                t0 = time.perf_counter()
                out = leg.call(token, state)
                walls[p].append(time.perf_counter() - t0)
                if advance:
                    state = out
            c1 = cpu_sum([pid])
            if c0 is not None and c1 is not None:
                cpu[p].append((c1 - c0) / calls)
    res: dict[str, Any] = {}
    for p in positions:
        res[str(p)] = {"wall_p50_ms": round(pct(walls[p], 50) * 1000, 3),
                       "wall_p90_ms": round(pct(walls[p], 90) * 1000, 3),
                       "sidecar_cpu_ms_per_call":
                           round(statistics.median(cpu[p]) * 1000, 3) if cpu[p] else None,
                       "state_bytes": len(bytes(states[p])) if states[p] is not None else 0}
        say(f"  {leg.parser or 'plain'}{' (cached)' if leg.cached else ''} @ {p}: {res[str(p)]}")
    lo, hi = str(positions[0]), str(positions[-1])
    ratio = round(res[hi]["wall_p50_ms"] / res[lo]["wall_p50_ms"], 3)
    cpu_lo, cpu_hi = res[lo]["sidecar_cpu_ms_per_call"], res[hi]["sidecar_cpu_ms_per_call"]
    return {"positions": res, "cost_ratio": ratio,
            "cpu_ratio": round(cpu_hi / cpu_lo, 3) if cpu_lo and cpu_hi else None}


@contextmanager
def sidecar(url: str | None, kwargs: dict[str, Any], say: Progress,
            log_dir: Path) -> Iterator[tuple[str, int | None]]:
    if url:
        yield url, None
        return
    with render_sidecars(1, say, log_dir=log_dir, max_model_len=MAX_MODEL_LEN, **kwargs) as (s,):
        yield s.url, sidecar_pid(s)


def parser_in_process(parser: str, positions: list[int], calls: int, say: Progress) -> dict[str, Any]:
    """ms per token of vLLM's parser driven one delta at a time in this process (native serving's
    cost): the output decoded once, then ``parse_delta`` per token; timed over ``calls`` tokens
    from each position."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager
    from vllm.tokenizers import get_tokenizer

    from token_engine.model_prep import ensure_model

    model = str(ensure_model())
    tokenizer = get_tokenizer(model)
    body: dict[str, Any] = {"model": SERVED, "messages": [{"role": "user", "content": QUESTION}]}
    text = "<think>" if parser == "olmo3" else ""
    if parser == "hermes":
        body["tools"] = [WEATHER_TOOL]
    request = ChatCompletionRequest(**body)
    cls = ParserManager.get_parser(tool_parser_name="hermes" if parser == "hermes" else None,
                                   reasoning_parser_name="olmo3" if parser == "olmo3" else None,
                                   enable_auto_tools=parser == "hermes", model_name=model,
                                   tokenizer=tokenizer)
    assert cls is not None
    need = positions[-1] + calls + 1
    while len(tokenizer.encode(text, add_special_tokens=False)) < need:
        text += "".join(SENTENCES) * 10
    ids = tokenizer.encode(text, add_special_tokens=False)[:need]
    pieces = [tokenizer.decode([t]) for t in ids]
    res: dict[str, Any] = {}
    for p in positions:
        p_cls = cls(tokenizer, request.tools, chat_template_kwargs={}, model_config=None)  # type: ignore[arg-type]
        for i in range(p):
            p_cls.parse_delta(pieces[i], [ids[i]], request, prompt_token_ids=[], finished=False)
        t0 = time.perf_counter()
        for i in range(p, p + calls):
            p_cls.parse_delta(pieces[i], [ids[i]], request, prompt_token_ids=[], finished=False)
        res[str(p)] = round((time.perf_counter() - t0) / calls * 1000, 4)
    say(f"  {parser} in-process parse_delta ms per token: {res}")
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", default="100,4000", help="output positions; ratio = last / first")
    ap.add_argument("--calls", type=int, default=100,
                    help="timed calls per position per round (CPU time is read in 10 ms ticks)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--build-chunk", type=int, default=16, help="tokens per call while carrying the state")
    ap.add_argument("--no-parser", action="store_true", help="skip the parser legs")
    ap.add_argument("--legs", default=",".join(LEGS), help="which of " + ", ".join(LEGS) + " (plain always)")
    ap.add_argument("--render-url", help="a running plain sidecar (max_model_len above the positions); "
                    "the parser legs are then skipped")
    ap.add_argument("--quick", action="store_true", help="smoke run: positions 10,200, few calls")
    args = ap.parse_args(argv)
    if args.quick:
        args.positions, args.calls, args.rounds, args.build_chunk = "10,200", 5, 2, 64
    positions = sorted(int(x) for x in args.positions.split(","))
    say = Progress(NAME)
    names = ["plain"] if args.no_parser or args.render_url else [
        n for n in LEGS if n == "plain" or n in args.legs.split(",")]
    out_dir = write_report(NAME, {}, "# Streaming derender cost\n\n(running)\n")
    f: dict[str, Any] = {"positions": positions, "calls": args.calls, "rounds": args.rounds,
                         "build_chunk": args.build_chunk, "max_model_len": MAX_MODEL_LEN, "legs": {},
                         "in_process_ms_per_token": {}, "quick": args.quick}
    for name in names:
        spec = LEGS[name]
        url = args.render_url if name == "plain" else None
        with ExitStack() as stack:
            say(f"{name}: sidecar {'(given)' if url else 'starting, max_model_len ' + str(MAX_MODEL_LEN)}")
            surl, pid = stack.enter_context(sidecar(url, spec["sidecar"], say, out_dir))
            leg = Leg(surl, spec["parser"], positions[-1] + args.calls + 2, cached=spec["advance"])
            say(f"{name}: prompt {len(leg.prompt_ids)} tokens; carrying stream_state to {positions}")
            f["legs"][name] = measure(leg, positions, args.calls, args.rounds, args.build_chunk, pid, say,
                                      advance=spec["advance"])
            f["legs"][name]["prompt_tokens"] = len(leg.prompt_ids)
    for parser in sorted({LEGS[n]["parser"] for n in names} - {None}):
        f["in_process_ms_per_token"][parser] = parser_in_process(parser, positions, args.calls, say)
    plain = f["legs"]["plain"]
    f["cost_ratio"] = plain["cost_ratio"]
    f["target_ratio"] = TARGET_RATIO
    checks = {"plain_cost_ratio": plain["cost_ratio"] <= TARGET_RATIO}
    for name, leg_f in f["legs"].items():
        if not name.endswith("_cached"):
            continue
        checks[f"{name}_cost_ratio"] = leg_f["cost_ratio"] <= TARGET_RATIO
        for p in positions:
            mine = leg_f["positions"][str(p)]["sidecar_cpu_ms_per_call"]
            base = plain["positions"][str(p)]["sidecar_cpu_ms_per_call"]
            if mine is not None and base:
                leg_f.setdefault("cpu_vs_plain", {})[str(p)] = round(mine / base, 3)
                checks[f"{name}_cpu_vs_plain_at_{p}"] = mine / base <= TARGET_RATIO
    f["checks"] = checks
    f["target_met"] = all(checks.values())
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
        for p, ratio in leg_f.get("cpu_vs_plain", {}).items():
            head[f"{prefix}cpu_vs_plain_at_{p}"] = ratio
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
    checks = "\n".join(f"- `{k}`: {'met' if v else '**NOT met**'}" for k, v in f.get("checks", {}).items())
    native = "\n".join(f"- {parser}: " + ", ".join(f"{v} ms per token @ {p}" for p, v in by_pos.items())
                        for parser, by_pos in f.get("in_process_ms_per_token", {}).items())
    cpu_rows = "\n".join(f"- {name}: " + ", ".join(f"{r}x @ {p}" for p, r in leg["cpu_vs_plain"].items())
                          for name, leg in f["legs"].items() if leg.get("cpu_vs_plain"))
    return (f"# Streaming derender cost by output position\n\nOne-token streaming chat derender calls with "
            f"`stream_state` carried to each position ({f['build_chunk']} tokens per call while carrying); "
            f"{f['calls']} timed calls per position per round, {f['rounds']} rounds alternating the "
            f"positions; sidecar `--max-model-len {f['max_model_len']}`. `*_stateless`: vLLM's render "
            "server (the same call repeated); `*_cached`: ours with the parser-session cache (the timed "
            "calls advance the stream).\n\n" + "\n".join(rows)
            + (f"\n\nSidecar CPU per call of the cached legs against the plain leg:\n{cpu_rows}"
               if cpu_rows else "")
            + (f"\n\nThe parser's own work, in-process, one delta at a time (native serving):\n{native}"
               if native else "")
            + f"\n\nTargets (≤ {f['target_ratio']}) — {verdict}:\n{checks}"
            f"\n\n![plot]({NAME}.png)\n")


def _plot(f: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = f["positions"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(1, len(f["legs"]))
    for i, (name, leg) in enumerate(f["legs"].items()):
        xs = [x - 0.4 + width * (i + 0.5) for x in range(len(ps))]
        ax.bar(xs, [leg["positions"][str(p)]["wall_p50_ms"] for p in ps], width, label=name)
    ax.set_xticks(range(len(ps)), [f"position {p}" for p in ps])
    ax.set_ylabel("ms per one-token derender call (p50, log)")
    ax.set_yscale("log")
    ax.set_title("streaming derender cost vs output position")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
