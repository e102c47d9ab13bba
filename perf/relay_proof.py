"""Mid-stream relay proven on real vLLM engines killed with SIGKILL (docs/relay.md).

Set-up: a real render sidecar, two real ``--tokens-only`` CPU engines, the coordinator in-process
(``EmbeddedCoordinator``, so its registry tells which engine serves a stream) with the ``random``
scheduling policy, so both engines serve streams and both get killed. Greedy chat streams
(temperature 0, ``max_tokens`` 192 by default) over 20 varied prompts, one at a time.

Method: first every prompt's **baseline** on the fault-free stack (text, usage, chunk times). Then
each run streams one prompt again and, once the client has seen a random number of output tokens
(from ``stream_options.continuous_usage_stats``, at least the first chunk, at most 12 tokens before
the baseline's end), sends SIGKILL to the whole process group of the engine serving it (API server
and EngineCore at once, as when a container dies). The coordinator relays the stream to the other
engine; the client keeps reading until ``[DONE]``. The killed engine is then checked gone (no live
process in its group, its port free), restarted and waited for (engine ``/health`` and the
coordinator's registry: healthy, breaker letting requests through) before the next run.

Per run: the kill point (tokens seen by the client; tokens the coordinator had committed, from its
relay event), the relay gap (the client's silence from the failed engine's last content chunk to
the replay's first), kill → first relayed chunk, whether the text is byte-identical to the
baseline, a duplicated span at the point where it diverges (if it does), one role delta, one
finish, no error event, usage equal to the baseline's, and ``coordinator_relays_total`` counting
exactly one relay.

Pass: at least 95 % of runs (19 of 20) byte-identical, none with duplicated text, every run
relayed. The process exits 1 when the proof fails.

    python -m perf.relay_proof [--runs 20] [--max-tokens 192] [--seed 7] [--policy random] [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import re
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from coordinator.config import (
    EngineClientSettings,
    EngineSettings,
    ModelSettings,
    RenderSettings,
    SchedulingSettings,
    Settings,
)
from coordinator.embedded import EmbeddedCoordinator, free_port
from perf._procs import SERVED
from perf._report import Progress, final_json, pct, save_figure, write_report
from token_engine.process import group_alive, group_pids
from token_engine.vllm_server import port_in_use

NAME = "relay_proof"
MAX_MODEL_LEN = 2048
PASS_SHARE = 0.95       # 19 of 20
TAIL_MARGIN = 12        # the kill lands at least this many tokens before the baseline's end
_COMMITTED = re.compile(r"\bcommitted=(\d+)")

PROMPTS = (
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Write a long story about a dragon who is afraid of the dark.",
    "Describe a day in the life of a medieval baker, from dawn to night.",
    "Write a detailed guide to planting a vegetable garden in spring.",
    "Tell me about the history of the printing press and why it mattered.",
    "Write a letter from a sailor to his family after a year at sea.",
    "Explain how rain forms, step by step, for a curious ten-year-old.",
    "Describe the city of the future as imagined by an architect.",
    "Write a story about a robot that learns to paint.",
    "Give detailed advice to a student starting university.",
    "Explain how a computer boots up, from power button to desktop.",
    "Write a travel diary entry about a train journey through the mountains.",
    "Describe how bread is made, from wheat field to table.",
    "Write a fairy tale about a fox, a crow and a clever little girl.",
    "Explain the water cycle and why it matters for life on Earth.",
    "Write a speech for the opening of a new public library.",
    "Describe the life of honeybees in a hive through one summer.",
    "Write a mystery story set in an old hotel during a snowstorm.",
    "Explain how to prepare for a long hike and what to pack.",
    "Tell the story of the first people to cross the ocean in a small boat.",
)


def chat_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    """A greedy chat stream whose every chunk carries the output token count so far."""
    return {"model": SERVED, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


@dataclass
class Chunk:
    t: float                     # time.monotonic() when the client read it
    content: str
    completion_tokens: int | None


@dataclass
class StreamResult:
    chunks: list[Chunk] = field(default_factory=list)
    roles: int = 0
    finishes: list[str] = field(default_factory=list)
    errors: list[Any] = field(default_factory=list)
    done: int = 0
    usage: dict[str, Any] | None = None
    killed_at: float | None = None
    kill_tokens: int | None = None

    @property
    def text(self) -> str:
        return "".join(c.content for c in self.chunks)

    @property
    def completion_tokens(self) -> int:
        return int((self.usage or {}).get("completion_tokens") or 0)


def stream_chat(client: httpx.Client, url: str, body: dict[str, Any], *,
                kill_after: int | None = None, kill: Any = None) -> StreamResult:
    """Read one SSE chat stream; call ``kill()`` once the client has seen ``kill_after`` output tokens."""
    res = StreamResult()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            res.errors.append({"status": resp.status_code, "body": resp.text})
            return res
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            now = time.monotonic()
            if data == "[DONE]":
                res.done += 1
                continue
            event = json.loads(data)
            if "error" in event:
                res.errors.append(event)
                continue
            usage = event.get("usage")
            if isinstance(usage, dict):
                res.usage = usage
            tokens = int(usage["completion_tokens"]) if isinstance(usage, dict) else None
            for choice in event.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("role"):
                    res.roles += 1
                if delta.get("content"):
                    res.chunks.append(Chunk(now, delta["content"], tokens))
                if choice.get("finish_reason"):
                    res.finishes.append(choice["finish_reason"])
            if (kill_after is not None and res.killed_at is None and tokens is not None
                    and tokens >= kill_after and res.chunks):
                kill()
                res.killed_at = time.monotonic()
                res.kill_tokens = tokens
    return res


# ---- engines ---------------------------------------------------------------------------------------

def sigkill_engine(engine: Any) -> list[int]:
    """SIGKILL every process of a launched vLLM server at once (API server + EngineCore: the launcher
    starts each server as its own process group); returns the pids that were killed."""
    proc = engine.process
    if proc is None or not proc.is_running():
        raise RuntimeError(f"{engine.name} is not running")
    pgid = int(proc.pid)
    pids = group_pids(pgid)
    os.killpg(pgid, signal.SIGKILL)
    return pids


def wait_engine_gone(engine: Any, timeout: float = 30.0) -> dict[str, Any]:
    """After a SIGKILL: reap the server, and check no orphan of its group lives on or holds its port."""
    assert engine.process is not None
    pgid = int(engine.process.pid)
    engine.stop(timeout=timeout)          # reaps the leader; the group is already dead
    deadline = time.monotonic() + timeout
    while (group_alive(pgid) or port_in_use(engine.host, engine.port)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"orphans": group_pids(pgid), "port_in_use": port_in_use(engine.host, engine.port)}


def serving_engine(coord: EmbeddedCoordinator, timeout: float = 5.0) -> str:
    """The URL of the one engine the coordinator has a request in flight on."""
    deadline = time.monotonic() + timeout
    while True:
        busy = [e.url for e in coord.components.registry.engines if e.inflight_requests > 0]
        if len(busy) == 1:
            return busy[0]
        if time.monotonic() > deadline:
            raise RuntimeError(f"expected one engine with a request in flight, found {busy}")
        time.sleep(0.005)


def wait_engine_available(coord: EmbeddedCoordinator, url: str, timeout: float = 60.0) -> float:
    """Until the coordinator's registry takes requests for ``url`` again (healthy, breaker lets through)."""
    t0 = time.monotonic()
    while True:
        engine = coord.components.registry.get(url)
        if engine is not None and engine.probe_ok is True and engine.available:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"coordinator did not take {url} back within {timeout:.0f}s")
        time.sleep(0.1)


def relays_total(coord: EmbeddedCoordinator) -> float:
    return float(coord.components.metrics.relays._value.get())


# ---- checks ----------------------------------------------------------------------------------------

def common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def repeated_span(text: str, at: int, min_len: int = 4) -> int:
    """Longest L >= ``min_len`` with ``text[at-L:at] == text[at:at+L]`` (text repeated at ``at``), else 0."""
    for length in range(min(at, len(text) - at), min_len - 1, -1):
        if text[at - length:at] == text[at:at + length]:
            return length
    return 0


def compare(faulted: str, baseline: str) -> dict[str, Any]:
    """Byte identity, and where they differ: the divergence point, the texts around it, and whether the
    faulted text repeats a span there that the baseline does not (duplicated text)."""
    identical = faulted.encode() == baseline.encode()
    if identical:
        return {"identical": True, "duplicated": False}
    p = common_prefix(faulted, baseline)
    dup = repeated_span(faulted, p)
    duplicated = bool(dup) and repeated_span(baseline, p) < dup
    return {"identical": False, "duplicated": duplicated, "diverged_at_char": p, "repeated_chars": dup,
            "faulted_around": faulted[max(0, p - 60):p + 60],
            "baseline_around": baseline[max(0, p - 60):p + 60],
            "faulted_longer": len(faulted) > len(baseline)}


def first_relayed(res: StreamResult, committed: int | None) -> int | None:
    """Index of the first content chunk from the replay: the first whose output count passes the
    tokens the coordinator had committed when it relayed."""
    if committed is None:
        return None
    return next((i for i, c in enumerate(res.chunks)
                 if c.completion_tokens is not None and c.completion_tokens > committed), None)


def relay_gap(res: StreamResult, first: int | None) -> float | None:
    """The client's silence across the relay: from the last chunk of the failed engine to the first
    chunk of the replay (failure detection, a new placement, the replay's prefill, its first
    derender)."""
    if first is None or first == 0:
        return None
    return res.chunks[first].t - res.chunks[first - 1].t


def max_gap(res: StreamResult) -> float:
    gaps = [b.t - a.t for a, b in zip(res.chunks, res.chunks[1:], strict=False)]
    return max(gaps) if gaps else 0.0


def median_gap(res: StreamResult) -> float:
    gaps = [b.t - a.t for a, b in zip(res.chunks, res.chunks[1:], strict=False)]
    return statistics.median(gaps) if gaps else 0.0


# ---- coordinator log ------------------------------------------------------------------------------

class LogTap(logging.Handler):
    """The coordinator's log lines with the monotonic time they were emitted, also written to a file."""

    def __init__(self, path: Path) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[float, str]] = []
        self._fh = path.open("w", encoding="utf-8")
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        line = self.format(record)
        self.records.append((time.monotonic(), line))
        self._fh.write(line + "\n")
        self._fh.flush()

    def since(self, t: float) -> list[tuple[float, str]]:
        return [(ts, line) for ts, line in self.records if ts >= t]

    def finish(self) -> None:
        # Not ``close()``: ``logging.shutdown`` (run by ``dictConfig``, e.g. uvicorn's) calls that on
        # every handler alive, and the tap must outlive it.
        self._fh.close()


@contextmanager
def coordinator_log(path: Path) -> Iterator[LogTap]:
    tap = LogTap(path)
    logger = logging.getLogger("coordinator")
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(tap)
    try:
        yield tap
    finally:
        logger.removeHandler(tap)
        logger.setLevel(old)
        tap.finish()


def settings(render_url: str, engine_urls: Sequence[str], policy: str = "random") -> Settings:
    """Defaults except a 1 s health probe (a restarted engine is back in rotation quickly) and the
    scheduling policy: random by default, so both engines serve streams and both get killed and
    restarted. With the default affinity policy a prompt returns to the engine that served its
    baseline, and with round-robin each run takes two picks (stream, relay), so both would kill the
    same engine every time."""
    os.environ.pop("COORD_CONFIG", None)
    return Settings(render=RenderSettings(url=render_url),
                    engines=[EngineSettings(url=u) for u in engine_urls], models=[ModelSettings(name=SERVED)],
                    engine_client=EngineClientSettings(health_interval_s=1.0),
                    scheduling=SchedulingSettings(policy=policy))  # type: ignore[arg-type]


# ---- the proof -------------------------------------------------------------------------------------

def one_run(i: int, prompt_i: int, prompt: str, base: StreamResult, rng: random.Random,
            coord: EmbeddedCoordinator, engines: dict[str, Any], client: httpx.Client, tap: LogTap,
            args: argparse.Namespace, say: Progress) -> dict[str, Any]:
    hi = max(1, base.completion_tokens - TAIL_MARGIN)
    kill_after = rng.randint(1, hi)
    victim: dict[str, Any] = {}

    def kill() -> None:
        url = serving_engine(coord)
        victim["url"] = url
        victim["name"] = engines[url].name
        victim["pids"] = sigkill_engine(engines[url])

    relays0 = relays_total(coord)
    t0 = time.monotonic()
    res = stream_chat(client, coord.url, chat_body(prompt, args.max_tokens), kill_after=kill_after, kill=kill)
    relayed = relays_total(coord) - relays0
    lines = tap.since(t0)
    cmp = compare(res.text, base.text)
    committed = None
    detected_at = None      # the "leg ... phase=stream" event: the coordinator ended the failed attempt
    for ts, line in lines:
        if "event=leg " in line and "phase=stream" in line and detected_at is None:
            detected_at = ts
        m = _COMMITTED.search(line)
        if "event=relay " in line and "result=ok" in line and m and committed is None:
            committed = int(m.group(1))
    first = first_relayed(res, committed)
    first_after = None if first is None else res.chunks[first].t
    gap = relay_gap(res, first)
    row: dict[str, Any] = {
        "run": i, "prompt": prompt_i, "kill_after_tokens": kill_after, "kill_point_tokens": res.kill_tokens,
        "committed_at_relay": committed, "baseline_tokens": base.completion_tokens,
        "engine_killed": victim.get("name"), "pids_killed": len(victim.get("pids", [])),
        "relays": relayed, "relay_gap_s": None if gap is None else round(gap, 4),
        "kill_to_detected_s": None if detected_at is None or res.killed_at is None
        else round(detected_at - res.killed_at, 4),
        "kill_to_relayed_chunk_s": None if first_after is None or res.killed_at is None
        else round(first_after - res.killed_at, 4),
        "baseline_max_gap_s": round(max_gap(base), 4), "baseline_median_gap_s": round(median_gap(base), 4),
        "roles": res.roles, "finishes": res.finishes, "errors": res.errors, "done": res.done,
        "usage_equal": (res.usage or {}).get("completion_tokens") == base.completion_tokens
        and (res.usage or {}).get("prompt_tokens") == (base.usage or {}).get("prompt_tokens"),
        **cmp,
    }
    row["clean_stream"] = (res.roles == 1 and len(res.finishes) == 1 and not res.errors and res.done == 1)
    if not cmp["identical"]:
        row["faulted_text"] = res.text
        row["coordinator_log"] = [line for _, line in lines]
    if victim.get("url"):
        gone = wait_engine_gone(engines[victim["url"]])
        row["orphans_after_kill"] = gone["orphans"]
        row["port_in_use_after_kill"] = gone["port_in_use"]
        t = time.monotonic()
        engines[victim["url"]].start()
        engines[victim["url"]].wait_ready(timeout=900)
        row["restart_s"] = round(time.monotonic() - t, 1)
        row["back_in_rotation_s"] = round(wait_engine_available(coord, victim["url"]), 2)
    row["ok"] = bool(cmp["identical"] and not cmp["duplicated"] and row["clean_stream"] and relayed == 1
                     and row["usage_equal"])
    say(f"run {i + 1}/{args.runs}: prompt {prompt_i}, killed {row['engine_killed']} "
        f"({row['pids_killed']} processes) after {res.kill_tokens} tokens "
        f"(committed {committed}) of {base.completion_tokens}; relays {relayed:.0f}, "
        f"{'identical' if cmp['identical'] else 'DIFFERENT'}"
        f"{', DUPLICATED' if cmp['duplicated'] else ''}, relay gap "
        f"{'n/a' if gap is None else f'{gap * 1000:.0f} ms'}; restarted in {row.get('restart_s')} s")
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--seed", type=int, default=7, help="seeds the kill points")
    ap.add_argument("--policy", default="random", choices=["random", "affinity", "round_robin", "least_load"],
                    help="scheduling policy (random: both engines serve streams and get killed)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 runs")
    args = ap.parse_args(argv)
    if args.quick:
        args.runs = 2
    say = Progress(NAME)
    rng = random.Random(args.seed)

    from render_sidecar.launch import RenderSidecar
    from token_engine.launch import VllmEngine
    from token_engine.model_prep import ensure_model

    model = ensure_model()
    out_dir = write_report(NAME, {}, "# Relay proof\n\n(running)\n")
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.runs)]
    rows: list[dict[str, Any]] = []
    baselines: dict[int, StreamResult] = {}
    t_start = time.monotonic()
    with ExitStack() as stack:
        say("starting render sidecar and two --tokens-only engines (real vLLM, CPU)")
        engines: dict[str, Any] = {}
        for name in ("engine-a", "engine-b"):
            e = VllmEngine(model, port=free_port(), served_model_name=SERVED, mode="tokens-only",
                           max_model_len=MAX_MODEL_LEN, echo=False, log_path=out_dir / f"{name}.log",
                           name=name)
            e.start()
            stack.callback(e.stop)
            engines[e.url] = e
        render = RenderSidecar(model, port=free_port(), served_model_name=SERVED, max_model_len=MAX_MODEL_LEN,
                               echo=False, log_path=out_dir / "render.log")
        render.start()
        stack.callback(render.stop)
        for s in (render, *engines.values()):
            s.wait_ready(timeout=900)
        coord = EmbeddedCoordinator(settings(render.url, list(engines), args.policy))   # configures logging
        tap = stack.enter_context(coordinator_log(out_dir / "coordinator.log"))
        stack.enter_context(coord)
        client = stack.enter_context(httpx.Client(timeout=httpx.Timeout(300, connect=10)))
        for url in engines:
            wait_engine_available(coord, url)
        say(f"ready; baselines of {len(set(prompts))} prompts on the fault-free stack")
        for prompt in prompts:
            pi = PROMPTS.index(prompt)
            if pi in baselines:
                continue
            base = stream_chat(client, coord.url, chat_body(prompt, args.max_tokens))
            if base.errors or base.done != 1 or not base.chunks:
                raise RuntimeError(f"baseline of prompt {pi} failed: {base.errors}")
            baselines[pi] = base
            say(f"baseline {pi}: {base.completion_tokens} tokens, finish {base.finishes}")
        for i, prompt in enumerate(prompts):
            pi = PROMPTS.index(prompt)
            row = one_run(i, pi, prompt, baselines[pi], rng, coord, engines, client, tap, args, say)
            if not row["identical"]:
                # Is the difference the relay's, or does the fault-free stack itself drift?
                again = stream_chat(client, coord.url, chat_body(prompt, args.max_tokens))
                row["unfaulted_rerun_identical"] = again.text.encode() == baselines[pi].text.encode()
            rows.append(row)

    f = figures(rows, baselines, args, time.monotonic() - t_start)
    out = write_report(NAME, f, _markdown(f))
    _plot(f, out / f"{NAME}.png")
    say(f"report: {out}/report.md, plot: {out}/{NAME}.png")
    final_json({"benchmark": NAME, "runs": f["runs"], "identical": f["identical"],
                "duplicated": f["duplicated"],
                "relayed": f["relayed"], "clean_streams": f["clean_streams"],
                "relay_gap_p50_ms": f["relay_gap_ms"]["p50"], "relay_gap_max_ms": f["relay_gap_ms"]["max"],
                "passed": f["passed"]})
    if not f["passed"]:
        sys.exit(1)


def figures(rows: list[dict[str, Any]], baselines: dict[int, StreamResult], args: argparse.Namespace,
            wall_s: float) -> dict[str, Any]:
    n = len(rows)
    gaps = [r["relay_gap_s"] * 1000 for r in rows if r["relay_gap_s"] is not None]
    resumes = [r["kill_to_relayed_chunk_s"] * 1000 for r in rows if r["kill_to_relayed_chunk_s"] is not None]
    detects = [r["kill_to_detected_s"] * 1000 for r in rows if r["kill_to_detected_s"] is not None]
    base_gaps = [r["baseline_max_gap_s"] * 1000 for r in rows]
    base_median_gaps = [r["baseline_median_gap_s"] * 1000 for r in rows]
    restarts = [r["restart_s"] for r in rows if r.get("restart_s") is not None]
    identical = sum(bool(r["identical"]) for r in rows)
    duplicated = sum(bool(r["duplicated"]) for r in rows)
    relayed = sum(r["relays"] == 1 for r in rows)
    clean = sum(bool(r["clean_stream"]) for r in rows)

    def stats(values: list[float]) -> dict[str, float | None]:
        if not values:
            return {"p50": None, "p90": None, "max": None, "mean": None}
        return {"p50": round(pct(values, 50), 1), "p90": round(pct(values, 90), 1),
                "max": round(max(values), 1), "mean": round(statistics.fmean(values), 1)}

    passed = (n > 0 and identical >= math.ceil(PASS_SHARE * n) and duplicated == 0 and relayed == n
              and clean == n)
    return {"runs": n, "max_tokens": args.max_tokens, "seed": args.seed, "policy": args.policy,
            "quick": args.quick,
            "engines_killed": dict(sorted(Counter(str(r["engine_killed"]) for r in rows).items())),
            "identical": identical, "duplicated": duplicated, "relayed": relayed, "clean_streams": clean,
            "usage_equal": sum(bool(r["usage_equal"]) for r in rows),
            "orphans_after_kill": sum(bool(r.get("orphans_after_kill")) for r in rows),
            "relay_gap_ms": stats(gaps), "kill_to_relayed_chunk_ms": stats(resumes),
            "kill_to_detected_ms": stats(detects),
            "baseline_max_gap_ms": stats(base_gaps), "baseline_median_gap_ms": stats(base_median_gaps),
            "restart_s": stats(restarts),
            "kill_points": [r["kill_point_tokens"] for r in rows],
            "baseline_tokens": {str(k): v.completion_tokens for k, v in sorted(baselines.items())},
            "pass_rule": f">= {math.ceil(PASS_SHARE * n)} of {n} identical, 0 duplicated, every run relayed "
                         "once with one role, one finish, no error",
            "passed": passed, "wall_s": round(wall_s, 1), "rows": rows}


def _markdown(f: dict[str, Any]) -> str:
    head = ("| run | prompt | engine killed | kill point (client tokens) | committed at relay | "
            "baseline tokens | relay gap (ms) | kill → relayed chunk (ms) | identical | duplicated | "
            "restart (s) |")
    rows = [head, "|" + "---|" * 11]
    for r in f["rows"]:
        def ms(v: float | None) -> str:
            return "n/a" if v is None else f"{v * 1000:.0f}"
        rows.append(f"| {r['run'] + 1} | {r['prompt']} | {r['engine_killed']} | {r['kill_point_tokens']} | "
                    f"{r['committed_at_relay']} | {r['baseline_tokens']} | {ms(r['relay_gap_s'])} | "
                    f"{ms(r['kill_to_relayed_chunk_s'])} | {'yes' if r['identical'] else '**no**'} | "
                    f"{'**yes**' if r['duplicated'] else 'no'} | {r.get('restart_s')} |")
    g, k, b = f["relay_gap_ms"], f["kill_to_relayed_chunk_ms"], f["baseline_max_gap_ms"]
    d, m = f["kill_to_detected_ms"], f["baseline_median_gap_ms"]
    verdict = "**passed**" if f["passed"] else "**FAILED**"
    return (f"# Relay proof on real engines\n\n{f['runs']} greedy chat streams "
            f"(max_tokens {f['max_tokens']}) on two `--tokens-only` CPU vLLM engines; in each, the serving "
            f"engine's process group was "
            f"SIGKILLed after a random number of output tokens and restarted before the next run; "
            f"scheduling policy `{f['policy']}`, engines killed: {f['engines_killed']}.\n\n"
            f"- byte-identical to the fault-free baseline: **{f['identical']} of {f['runs']}**; duplicated "
            f"text: **{f['duplicated']}**; relayed exactly once: {f['relayed']}; one role, one finish, no "
            f"error, one `[DONE]`: {f['clean_streams']}; usage equal to the baseline's: {f['usage_equal']}\n"
            f"- relay gap (the client's silence from the failed engine's last chunk to the replay's first): "
            f"p50 {g['p50']} ms, p90 {g['p90']} ms, max {g['max']} ms; fault-free streams of the same "
            f"prompts: median gap between chunks p50 {m['p50']} ms, longest gap p50 {b['p50']} ms, "
            f"max {b['max']} ms\n"
            f"- kill → first relayed chunk at the client: p50 {k['p50']} ms, max {k['max']} ms (of which "
            f"kill → the coordinator ends the failed attempt: p50 {d['p50']} ms, max {d['max']} ms)\n"
            f"- killed engine restarted and healthy in p50 {f['restart_s']['p50']} s; orphan processes "
            f"after a kill: {f['orphans_after_kill']}\n"
            f"- rule: {f['pass_rule']} — {verdict}\n\n" + "\n".join(rows) + f"\n\n![plot]({NAME}.png)\n")


def _plot(f: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = f["rows"]
    xs = [r["run"] + 1 for r in rows]
    colors = ["tab:green" if r["identical"] else "tab:red" for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.bar(xs, [r["baseline_tokens"] for r in rows], color="lightgrey", label="baseline output tokens")
    ax1.scatter(xs, [r["kill_point_tokens"] or 0 for r in rows], color=colors, marker="x", s=60, zorder=3,
                label="SIGKILL (tokens seen by the client)")
    ax1.set_xticks(xs)
    ax1.set_ylim(0, max(r["baseline_tokens"] for r in rows) * 1.3)
    ax1.set_xlabel("run")
    ax1.set_ylabel("output tokens")
    ax1.set_title(f"kill points; {f['identical']}/{f['runs']} byte-identical (green)")
    ax1.legend(fontsize=8, loc="upper left", ncol=2)
    ax2.bar(xs, [(r["relay_gap_s"] or 0) * 1000 for r in rows], color=colors, label="relay gap")
    ax2.plot(xs, [r["baseline_max_gap_s"] * 1000 for r in rows], "k.", label="longest gap, fault-free stream")
    ax2.plot(xs, [r["baseline_median_gap_s"] * 1000 for r in rows], "k_",
             label="median gap, fault-free stream")
    ax2.set_xticks(xs)
    ax2.set_xlabel("run")
    ax2.set_ylabel("ms")
    ax2.set_title("client-visible pause across the relay")
    ax2.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
