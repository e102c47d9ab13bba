"""Conversations that re-send their image: media-aware KV affinity against media-blind hashing and
round robin, and encoder disaggregation (EPD) against union at the same engine count.

Why: every image has the same placeholder tokens, so a router that hashes token ids alone takes
every conversation's image for every other's. It sees all engines holding "the same" prompt, places
by load, and the engine it picks has to prefill the image and everything after it again. The
coordinator keys image blocks by the image's hash, as vLLM does (docs/multimodal.md), so each
conversation goes back to the engine holding its KV.

Set-up, one run: ``--engines`` simulated engines (their prefix caches key image blocks like vLLM's;
``--prefill-ms`` per uncached prompt token; ``--max-running`` running at once, the rest waiting, so
an engine that gets more than its share queues) in a child process, the real render sidecar of the tiny
vision model (``token_engine.vision_prep``), and one coordinator process per policy, each with fresh
engines: ``media`` (the affinity preset; the default), ``text_only`` (the same, with
``scheduling.prefix.media: false``: a media-blind router), ``round_robin`` and ``epd`` (``media`` with
the first engine an encode-only one and the others reading its encoder-cache store; every engine spends
``--encode-ms`` per image token on an image it encodes itself). Load: ``--conversations``
conversations, each opening with its own image and the same long question, then ``--turns`` - 1
follow-ups that re-send the whole history; each round of turns arrives as Poisson at ``--rate``.
The first turn of every conversation is the warm-up (its TTFT is reported apart: every image is new
there, which is where EPD can help); the follow-ups are measured.

Reported per policy: TTFT p50/p90/p99 of the follow-ups at the client and the engines' prefix-cache
hit rate over them (their own counters), beside the oracle's (each follow-up finds its whole previous
prompt). Targets (docs/benchmarks.md): TTFT p90 at least 3 x better than round robin's; hit rate within
10 % of the oracle's. The media-blind router's ratio is reported beside them: it takes every
conversation for the first one (they differ only by their image), keeps them all on one engine (each
"continues" a chain there, which the bounded-load picker never moves) and that engine queues; the
load (``--rate``, ``--decode-ms``, ``--max-running``) is set near the fleet's capacity so that shows.

    python -m perf.multimodal [--engines 4] [--conversations 24] [--turns 3] [--rate 12] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import shutil
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from perf import _report
from perf._procs import CoordinatorProcess, render_config, render_sidecars, sim_cache_counts, sim_engines
from perf._report import Progress, final_json, pct, save_figure, write_report

NAME = "multimodal"
VISION = "smolvlm-tiny"
POLICIES = ("media", "text_only", "round_robin", "epd")
TARGET_TTFT = 3.0   # round robin's TTFT p90 at least this times ours
TARGET_HIT = 0.9    # our prefix hit rate at least this times the oracle's
BLOCK = 16
QUESTION = " ".join(f"Point {i}: look closely at the picture and say what part {i} shows." for i in range(30))


@dataclass
class Turn:
    conversation: int
    ttft_s: float | None
    status: int
    prompt_tokens: int = 0
    text: str = ""


@dataclass
class Run:
    policy: str
    turns: list[Turn] = field(default_factory=list)
    first: list[Turn] = field(default_factory=list)   # the opening turns: every image is new
    hits: float = 0.0
    queries: float = 0.0
    oracle_hits: float = 0.0

    def summary(self) -> dict[str, Any]:
        ok = [t for t in self.turns if t.status == 200 and t.ttft_s is not None]
        ttft = [t.ttft_s for t in ok if t.ttft_s is not None]
        first = [t.ttft_s for t in self.first if t.status == 200 and t.ttft_s is not None]
        return {"policy": self.policy, "requests": len(self.turns), "failed": len(self.turns) - len(ok),
                "first_ttft_p50_ms": round(pct(first, 50) * 1000, 1),
                "first_ttft_p90_ms": round(pct(first, 90) * 1000, 1),
                "ttft_p50_ms": round(pct(ttft, 50) * 1000, 1), "ttft_p90_ms": round(pct(ttft, 90) * 1000, 1),
                "ttft_p99_ms": round(pct(ttft, 99) * 1000, 1),
                "prefix_hit_rate": round(self.hits / self.queries, 3) if self.queries else 0.0,
                "oracle_hit_rate": round(self.oracle_hits / self.queries, 3) if self.queries else 0.0}


def image(k: int) -> str:
    """A distinct small PNG per conversation (a seeded pattern, so no two are equal)."""
    from PIL import Image

    rng = random.Random(k)
    img = Image.new("RGB", (48, 48), (rng.randrange(256), rng.randrange(256), rng.randrange(256)))
    for _ in range(30):
        img.putpixel((rng.randrange(48), rng.randrange(48)), (rng.randrange(256),) * 3)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def opening(k: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image(k)}},
                                         {"type": "text", "text": QUESTION}]}]


async def one(client: httpx.AsyncClient, url: str, k: int, messages: list[dict[str, Any]],
              max_tokens: int) -> Turn:
    body = {"model": VISION, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    first: float | None = None
    status, prompt, parts = 0, 0, []
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    status = -1
                for c in chunk.get("choices") or ():
                    if first is None:
                        first = time.monotonic()
                    parts.append((c.get("delta") or {}).get("content") or "")
                if chunk.get("usage"):
                    prompt = int(chunk["usage"]["prompt_tokens"])
    except httpx.HTTPError:
        status = 0
    return Turn(k, None if first is None else first - sent, status, prompt, "".join(parts))


async def conversations(url: str, args: argparse.Namespace, sims: list[str], say: Progress) -> Run:
    """Round t sends every conversation's turn t (Poisson at ``rate``); rounds after the first are
    measured (TTFT at the client, prefix-cache tokens at the engines)."""
    histories = {k: opening(k) for k in range(args.conversations)}
    rng = random.Random(args.seed)
    run = Run("")
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        previous: dict[int, int] = {}
        for t in range(args.turns):
            before = await sim_cache_counts(client, sims)
            tasks = []
            order = list(histories)
            rng.shuffle(order)
            for k in order:
                await asyncio.sleep(rng.expovariate(args.rate))
                tasks.append(asyncio.create_task(one(client, url, k, histories[k], args.max_tokens)))
            done = await asyncio.gather(*tasks)
            after = await sim_cache_counts(client, sims)
            for turn in done:
                histories[turn.conversation] += [
                    {"role": "assistant", "content": turn.text},
                    {"role": "user", "content": f"Tell me more about part {t + 1}."}]
            if t == 0:
                run.first += done
            else:
                run.turns += done
                run.hits += after[0] - before[0]
                run.queries += after[1] - before[1]
                # The oracle: each follow-up finds its previous prompt's full blocks (the engine always
                # recomputes at least the last token, and the new turn's tokens are new).
                run.oracle_hits += sum(previous.get(x.conversation, 0) // BLOCK * BLOCK for x in done)
            previous = {x.conversation: x.prompt_tokens for x in done}
            bad = sum(1 for x in done if x.status != 200)
            say(f"  turn {t + 1}/{args.turns}: {len(done)} requests, {bad} failed")
    return run


def engine_configs(args: argparse.Namespace, policy: str, store: Path) -> list[dict[str, Any]]:
    """Every engine encodes the images it must (``--encode-ms`` per image token); under ``epd`` the
    first is an encode-only engine and the others read its store (ECExampleConnector's layout)."""
    configs: list[dict[str, Any]] = [
        {"model": VISION, "seed": i, "vocab_size": 49156, "block_size": BLOCK, "capacity_blocks": 65536,
         "prefill_s_per_token": args.prefill_ms / 1000, "decode_s_per_token": args.decode_ms / 1000,
         "encode_s_per_image_token": args.encode_ms / 1000,
         "stream_interval": args.max_tokens, "max_concurrency": args.max_running}
        for i in range(args.engines)]
    if policy == "epd":
        for i, c in enumerate(configs):
            c.update(ec_role="ec_producer" if i == 0 else "ec_consumer", ec_storage_path=str(store))
    return configs


def coordinator_config(policy: str, render_url: str, urls: list[str]) -> dict[str, Any]:
    scheduling: dict[str, Any] = {"policy": "round_robin" if policy == "round_robin" else "affinity",
                                  "prefix": {"block_size": BLOCK, "media": policy != "text_only"}}
    return {"render": {**render_config([render_url]), "timeout_s": 30},
            "models": [{"name": VISION, "max_model_len": 2048}],
            "engines": [{"url": u, "role": "encode" if policy == "epd" and i == 0 else "union"}
                        for i, u in enumerate(urls)],
            "engine_client": {"health_interval_s": 1.0},
            "scheduling": scheduling, "resilience": {"retries": 2}}


def run_policy(policy: str, args: argparse.Namespace, render_url: str, say: Progress, out_dir: Path) -> Run:
    store = out_dir / f"ec-store-{policy}"
    shutil.rmtree(store, ignore_errors=True)
    with ExitStack() as stack:
        urls, _ = stack.enter_context(sim_engines(engine_configs(args, policy, store)))
        coord = stack.enter_context(CoordinatorProcess(coordinator_config(policy, render_url, urls),
                                                       log_path=out_dir / f"coordinator-{policy}.log"))
        say(f"{policy}: {args.conversations} conversations x {args.turns} turns over {args.engines} engines")
        run = asyncio.run(conversations(coord.url, args, urls, say))
        run.policy = policy
        return run


def warm_render(render_url: str, conversations: int) -> None:
    """Render every opening once before any policy runs: vLLM's render keeps processed images in its
    multimodal cache, and the policy run first would otherwise pay for all of them alone."""
    with httpx.Client(timeout=120) as client:
        for k in range(conversations):
            body = {"model": VISION, "messages": opening(k), "max_tokens": 1}
            client.post(f"{render_url}/v1/chat/completions/render", json=body).raise_for_status()


def plot(runs: dict[str, Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"media": "tab:blue", "text_only": "tab:red", "round_robin": "tab:orange", "epd": "tab:green"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for policy, run in runs.items():
        ttft = sorted(t.ttft_s * 1000 for t in run.turns if t.ttft_s is not None)
        if ttft:
            a.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=policy, color=colors[policy])
    a.set_xscale("log")
    a.set_xlabel("TTFT of follow-up turns (ms, log)")
    a.set_ylabel("fraction of requests")
    a.legend()
    summaries = [r.summary() for r in runs.values()]
    b.bar([s["policy"] for s in summaries], [s["prefix_hit_rate"] for s in summaries],
          color=[colors[s["policy"]] for s in summaries])
    if summaries:
        b.axhline(summaries[0]["oracle_hit_rate"], color="black", linestyle="--", label="oracle")
        b.legend()
    b.set_ylabel("engines' prefix-cache hit rate")
    save_figure(fig, path)


def headline(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ours, blind, rr = summaries["media"], summaries["text_only"], summaries["round_robin"]
    vs_rr = rr["ttft_p90_ms"] / ours["ttft_p90_ms"] if ours["ttft_p90_ms"] else float("nan")
    vs_blind = blind["ttft_p90_ms"] / ours["ttft_p90_ms"] if ours["ttft_p90_ms"] else float("nan")
    hit = ours["prefix_hit_rate"] / ours["oracle_hit_rate"] if ours["oracle_hit_rate"] else float("nan")
    failed = sum(s["failed"] for s in summaries.values())
    epd = summaries["epd"]
    return {"benchmark": NAME, "ttft_p90_vs_round_robin": round(vs_rr, 2),
            "ttft_p90_vs_text_only": round(vs_blind, 2), "hit_vs_oracle": round(hit, 3), "failed": failed,
            "epd_first_ttft_p90_vs_union": _ratio(ours["first_ttft_p90_ms"], epd["first_ttft_p90_ms"]),
            "epd_followup_ttft_p90_vs_union": _ratio(ours["ttft_p90_ms"], epd["ttft_p90_ms"]),
            "targets_met": bool(vs_rr >= TARGET_TTFT and hit >= TARGET_HIT and failed == 0)}


def _ratio(union_ms: float, epd_ms: float) -> float:
    """Union's TTFT over EPD's: above 1, EPD answered sooner."""
    return round(union_ms / epd_ms, 2) if epd_ms else float("nan")


def markdown(args: argparse.Namespace, summaries: dict[str, dict[str, Any]], head: dict[str, Any]) -> str:
    rows = "\n".join(f"| {s['policy']} | {s['requests']} | {s['failed']} | {s['ttft_p50_ms']} | "
                     f"{s['ttft_p90_ms']} | {s['ttft_p99_ms']} | {s['prefix_hit_rate']} | "
                     f"{s['oracle_hit_rate']} | {s['first_ttft_p50_ms']} | {s['first_ttft_p90_ms']} |"
                     for s in summaries.values())
    return f"""# Images: media-aware affinity vs a media-blind router vs round robin

{args.engines} simulated engines ({args.prefill_ms:g} ms per uncached prompt token, {args.max_running}
running at once), the real render sidecar of the tiny vision model, {args.conversations} conversations
each opening with its own image and the same long question, {args.turns} turns each (the first is the
warm-up), {args.rate:g} requests/s per round, {args.max_tokens} output tokens, {args.encode_ms:g} ms of
vision encoder per image token. "1st": TTFT of the opening turns, whose images are all new.

| policy | follow-ups | failed | TTFT p50 ms | p90 ms | p99 ms | hit rate | oracle | 1st p50 | 1st p90 |
|---|---|---|---|---|---|---|---|---|---|
{rows}

- TTFT p90, round robin / media-aware: **{head['ttft_p90_vs_round_robin']}** (target ≥ {TARGET_TTFT})
- TTFT p90, media-blind / media-aware: **{head['ttft_p90_vs_text_only']}** (reported)
- EPD (1 encode engine + {args.engines - 1} answering, media-aware) against union ({args.engines} engines,
  media-aware), union TTFT p90 / EPD's: opening turns (new images) **{head['epd_first_ttft_p90_vs_union']}**,
  follow-ups **{head['epd_followup_ttft_p90_vs_union']}** (reported; above 1 EPD is faster)
- prefix hit rate, media-aware / oracle: **{head['hit_vs_oracle']}** (target ≥ {TARGET_HIT})
- targets met: **{head['targets_met']}**

![TTFT and hit rate](multimodal.png)
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--rate", type=float, default=12.0, help="requests per second within a round (Poisson)")
    ap.add_argument("--prefill-ms", type=float, default=1.0, help="simulated ms per uncached prompt token")
    ap.add_argument("--decode-ms", type=float, default=25.0, help="simulated ms per output token")
    ap.add_argument("--encode-ms", type=float, default=5.0,
                    help="simulated vision-encoder ms per image placeholder token (19 per image)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-running", type=int, default=2, help="requests an engine runs at once (more wait)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--render-url", help="a running vision-model render sidecar instead of starting one")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 engines, 4 conversations, 2 turns")
    args = ap.parse_args(argv)
    if args.quick:
        args.engines, args.conversations, args.turns, args.rate = 2, 4, 2, 8.0
    say = Progress(NAME)
    out_dir = _report.OUT_ROOT / NAME
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Run] = {}
    with ExitStack() as stack:
        render_url = args.render_url
        if render_url is None:
            from token_engine.vision_prep import ensure_vision_model

            folder = ensure_vision_model()
            sidecars = render_sidecars(1, say, log_dir=out_dir, model=folder, served=VISION)
            sidecar = stack.enter_context(sidecars)[0]
            render_url = str(sidecar.url)
        warm_render(render_url, args.conversations)
        say(f"render warmed with the {args.conversations} opening images")
        for policy in POLICIES:
            runs[policy] = run_policy(policy, args, render_url, say, out_dir)
            s = runs[policy].summary()
            say(f"{policy}: TTFT p90 {s['ttft_p90_ms']} ms, hit rate {s['prefix_hit_rate']} "
                f"(oracle {s['oracle_hit_rate']}), failed {s['failed']}")
    summaries = {p: r.summary() for p, r in runs.items()}
    head = headline(summaries)
    plot(runs, out_dir / "multimodal.png")
    write_report(NAME, {**head, "quick": args.quick, "runs": list(summaries.values()), "config": vars(args)},
                 markdown(args, summaries, head))
    final_json(head)


if __name__ == "__main__":
    main()
