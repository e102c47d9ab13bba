"""Which vLLM parsers give the same stream whether engine chunks are derendered one token per call or
merged (3, 7, 32 tokens per call)?

Why: the coordinator merges the engine chunks that pile up while a derender call is in flight. For a
plain stream that never changes what the client gets; for a parser it may (vLLM 0.32's olmo3 drops
content that shares a delta with ``</think>``). The coordinator merges calls only for parsers listed
in ``EXACT_UNDER_COALESCING`` (coordinator/pipeline/derender/features.py); this measures that list.

Method: one real render sidecar per parser (ours, with the session cache), a chat request (with
``tools`` for tool parsers), a fixed model output tokenized by the sidecar, then the output's tokens
derendered as a stream in calls of k tokens, ``stream_state`` carried from call to call. What a
client assembles (content, reasoning, each tool call's name and arguments, finish reason) at each k is
compared with k = 1.

SmolLM2's vocabulary spells ``<think>`` with several tokens, which ``qwen3`` and ``deepseek_r1``
refuse (they look their markers up as single vocabulary entries), so those two run on a copy of the
tokenizer in which two unused special tokens (``<jupyter_script>``, ``<empty_output>``) are renamed
``<think>`` and ``</think>`` (same ids, same vocabulary size: render loads no weights).

    python -m perf.parser_chunking [--sizes 1,3,7,32] [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from coordinator.embedded import free_port
from perf._procs import SERVED
from perf._report import OUT_ROOT, Progress, final_json, save_figure, write_report

NAME = "parser_chunking"
EOS = 2
RENAMED = {"<jupyter_script>": "<think>", "<empty_output>": "</think>"}
THOUGHT = "The user asks about the weather, so I should look it up before I answer."
ANSWER = "It is sunny in Paris today, with a light wind from the west."
CALL = json.dumps({"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}})
OUTPUTS = {
    "reasoning": f"<think>{THOUGHT}</think>{ANSWER}",
    "reasoning_then_tool": f"<think>{THOUGHT}</think>\n<tool_call>\n{CALL}\n</tool_call>",
    "tool": f"I will check.\n<tool_call>\n{CALL}\n</tool_call>",
    "two_tools": f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>",
}
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather in a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                 "unit": {"type": "string"}},
                                "required": ["city"]}},
}
# name: sidecar flags, tokenizer ("think" = the renamed copy), the outputs it is measured on
PARSERS: dict[str, tuple[dict[str, Any], str, tuple[str, ...]]] = {
    "hermes": ({"tool_call_parser": "hermes", "enable_auto_tool_choice": True}, "smollm2",
               ("tool", "two_tools")),
    "olmo3": ({"reasoning_parser": "olmo3"}, "smollm2", ("reasoning",)),
    "qwen3": ({"reasoning_parser": "qwen3"}, "think", ("reasoning",)),
    "deepseek_r1": ({"reasoning_parser": "deepseek_r1"}, "think", ("reasoning",)),
    "qwen3+hermes": ({"reasoning_parser": "qwen3", "tool_call_parser": "hermes",
                      "enable_auto_tool_choice": True}, "think", ("reasoning", "reasoning_then_tool")),
}


def think_tokenizer(model: Path, out: Path) -> Path:
    """A copy of the model folder whose tokenizer spells <think> and </think> as one token each."""
    if (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.name == "model.safetensors":
            (out / f.name).symlink_to(f.resolve())
        elif f.is_file() and f.name not in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(f, out / f.name)
    tok = json.loads((model / "tokenizer.json").read_text())
    for added in tok["added_tokens"]:
        if added["content"] in RENAMED:
            vocab = tok["model"]["vocab"]
            vocab[RENAMED[added["content"]]] = vocab.pop(added["content"])
            added["content"] = RENAMED[added["content"]]
            added["special"] = False
    (out / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    for entry in cfg.get("added_tokens_decoder", {}).values():
        if entry.get("content") in RENAMED:
            entry["content"] = RENAMED[entry["content"]]
            entry["special"] = False
    specials = cfg.get("additional_special_tokens", [])
    cfg["additional_special_tokens"] = [t for t in specials if t not in RENAMED]
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def assemble(http: httpx.Client, prompt: list[int], chat_request: dict[str, Any], ids: list[int],
             size: int, rid: str) -> dict[str, Any]:
    state = None
    content, reasoning, finish = "", "", None
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for lo in range(0, len(ids), size):
        last = lo + size >= len(ids)
        choice = {"index": 0, "token_ids": ids[lo:lo + size], "finish_reason": "stop" if last else None,
                  "stop_reason": EOS if last else None}
        r = http.post("/v1/chat/completions/derender", json={
            "stream": True, "model": SERVED, "generate_chunk": {"request_id": rid, "choices": [choice]},
            "stream_state": state, "prompt_tokens": len(prompt), "prompt_token_ids": prompt,
            "chat_request": chat_request})
        r.raise_for_status()
        out = r.json()
        state = out["stream_state"]
        for ch in out["chunk"]["choices"]:
            delta = ch.get("delta") or {}
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning") or ""
            for tc in delta.get("tool_calls") or []:
                fn = tc.get("function") or {}
                names[tc["index"]] = names.get(tc["index"], "") + (fn.get("name") or "")
                args[tc["index"]] = args.get(tc["index"], "") + (fn.get("arguments") or "")
            finish = ch.get("finish_reason") or finish
    return {"content": content, "reasoning": reasoning, "tool_names": names, "tool_args": args,
            "finish_reason": finish}


def measure(name: str, url: str, outputs: tuple[str, ...], sizes: list[int], say: Progress) -> dict[str, Any]:
    http = httpx.Client(base_url=url, timeout=60)
    flags = PARSERS[name][0]
    body: dict[str, Any] = {"model": SERVED, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                            "stream": True}
    if "tool_call_parser" in flags:
        body.update(tools=[WEATHER_TOOL], tool_choice="auto")
    r = http.post("/v1/chat/completions/render", json=body)
    r.raise_for_status()
    prompt = r.json()["token_ids"]
    chat_request = {**body, "messages": [{"role": "user", "content": ""}]}
    res: dict[str, Any] = {}
    for output in outputs:
        t = http.post("/tokenize", json={"prompt": OUTPUTS[output], "add_special_tokens": False})
        t.raise_for_status()
        ids = [*t.json()["tokens"], EOS]
        got = {k: assemble(http, prompt, chat_request, ids, k, f"{name}-{output}-{k}") for k in sizes}
        one = got[sizes[0]]
        res[output] = {"tokens": len(ids), "one_token": one,
                       "exact": {str(k): got[k] == one for k in sizes},
                       "differs": {str(k): _diff(one, got[k]) for k in sizes if got[k] != one}}
        say(f"  {name} / {output}: exact at " + ", ".join(f"{k}: {got[k] == one}" for k in sizes))
    return res


def _diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: {"one_token": a[k], "merged": b[k]} for k in a if a[k] != b[k]}


def main(argv: list[str] | None = None) -> None:
    from render_sidecar.launch import RenderSidecar
    from token_engine.model_prep import ensure_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,3,7,32",
                    help="tokens per derender call; the first is the reference")
    ap.add_argument("--parsers", default=",".join(PARSERS), help="which of " + ", ".join(PARSERS))
    ap.add_argument("--quick", action="store_true", help="hermes and olmo3 only")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    names = ["hermes", "olmo3"] if args.quick else args.parsers.split(",")
    say = Progress(NAME)
    model = ensure_model()
    think = think_tokenizer(model, OUT_ROOT / NAME / "smollm2-think")
    out_dir = write_report(NAME, {}, "# Parser chunking\n\n(running)\n")
    f: dict[str, Any] = {"sizes": sizes, "parsers": {}}
    with ExitStack() as stack:
        servers = {}
        for name in names:
            flags, tokenizer, _ = PARSERS[name]
            s = RenderSidecar(think if tokenizer == "think" else model, port=free_port(),
                              served_model_name=SERVED, echo=False,
                              log_path=out_dir / f"render-{name.replace('+', '-')}.log", **flags)
            s.start()
            stack.callback(s.stop)
            servers[name] = s
        say(f"waiting for {len(servers)} render sidecars (real vLLM): {', '.join(servers)}")
        for s in servers.values():
            s.wait_ready(timeout=900)
        for name, s in servers.items():
            f["parsers"][name] = measure(name, str(s.url), PARSERS[name][2], sizes, say)
    f["exact_parsers"] = sorted(n for n, r in f["parsers"].items()
                                if all(all(o["exact"].values()) for o in r.values()))
    out = write_report(NAME, f, _markdown(f))
    _plot(f, out / f"{NAME}.png")
    say(f"report: {out}/report.md, plot: {out}/{NAME}.png")
    final_json({"benchmark": NAME, "exact_parsers": f["exact_parsers"],
                "measured": sorted(f["parsers"]), "sizes": sizes})


def _markdown(f: dict[str, Any]) -> str:
    sizes = f["sizes"]
    rows = ["| parser | output | tokens | " + " | ".join(f"{k} per call" for k in sizes) + " |",
            "|---" * (3 + len(sizes)) + "|"]
    notes = []
    for name, res in f["parsers"].items():
        for output, r in res.items():
            rows.append(f"| {name} | {output} | {r['tokens']} | "
                        + " | ".join("same" if r["exact"][str(k)] else "**differs**" for k in sizes) + " |")
            for k, d in r["differs"].items():
                notes.append(f"- {name} / {output} at {k} per call: "
                             + "; ".join(f"`{field}` {v['one_token']!r} → {v['merged']!r}"
                                         for field, v in d.items()))
    return ("# Parser output by derender call size\n\nWhat a client assembles (content, reasoning, tool "
            "calls, finish reason) when the same tokens are derendered in calls of k tokens, against "
            "one token per call; vLLM 0.32 parsers on SmolLM2's tokenizer (qwen3 and deepseek_r1 on a "
            "copy whose `<think>`/`</think>` are single tokens).\n\n" + "\n".join(rows)
            + ("\n\nWhere they differ:\n" + "\n".join(notes) if notes else "")
            + f"\n\nExact at every size: {', '.join(f['exact_parsers']) or 'none'}.\n\n![plot]({NAME}.png)\n")


def _plot(f: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, grid = [], []
    for name, res in f["parsers"].items():
        for output, r in res.items():
            labels.append(f"{name} / {output}")
            grid.append([1.0 if r["exact"][str(k)] else 0.0 for k in f["sizes"]])
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(labels) + 1.5))
    ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(f["sizes"])), [f"{k} per call" for k in f["sizes"]])
    ax.set_yticks(range(len(labels)), labels)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, "same" if v else "differs", ha="center", va="center", fontsize=8, color="white")
    ax.set_title("what a client assembles, vs 1 token per call", fontsize=10)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
