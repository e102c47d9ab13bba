"""Should a stream ever take vLLM 0.32's engine-side text path instead of our derender sidecar?

vLLM 0.32's ``/inference/v1/generate`` takes ``output_mode: "text"`` on an engine that loads a
tokenizer (``--enable-scale-out``, not ``--tokens-only``; ``sampling_params.detokenize: true``): the
engine's own output processor detokenizes and each stream chunk carries a text delta. Our default
path is a ``--tokens-only`` engine returning token ids, and one streaming derender call to the render
sidecar per engine chunk, ``stream_state`` carried from call to call.

Method: the real processes, started here with the repo's launchers: a ``--tokens-only`` engine and a
``--enable-scale-out`` engine (``VllmEngine``, 1 GiB KV cache each, the same model, dtype and
``--max-model-len``), and one render sidecar at a time (``RenderSidecar``: plain, then with
``--tool-call-parser hermes --enable-auto-tool-choice``), so never more than three vLLM servers. The
scale-out engine also has the hermes flags, so that its native ``/v1/chat/completions`` can parse tool
calls; its ``/inference/v1/generate`` does not use them (the question below). Each prompt is rendered
once by the sidecar; the same ``GenerateRequest`` (temperature 0, ``ignore_eos``, ``--max-tokens``
output tokens, streaming) then goes, interleaved and in alternating order, to

* **tokens**: the tokens-only engine, each engine chunk derendered by the sidecar. The wire is driven
  directly with httpx, not through the coordinator, but the way the coordinator's
  ``pipeline/derender`` does it: a reader task buffers engine chunks while a derender call is in
  flight, the buffered chunks are merged into the next call (at most 32 tokens), the state stays
  raw JSON and goes back byte for byte, the plain path sends the last 8 prompt ids on the first call
  only, the parser path the full prompt ids on the first call (our sidecar keeps the parser session)
  and again after a 409 ``stream_session_miss``; a chunk is "delivered" when its derender answer is
  back;
* **text**: the scale-out engine with ``output_mode: "text"``; a chunk is delivered when it arrives;
* **native**: the same chat request to the scale-out engine's own ``/v1/chat/completions`` (stream),
  the reference for the joined text;
* **control**: the scale-out engine with ``output_mode: "tokens"`` and ``detokenize: false``, nothing
  derendered: the same engine instance without any detokenization, so text minus control is what
  text mode adds there, apart from what differs between the two engine processes.

Per leg: CPU seconds per output token of each process tree (engine: its API-server process, where
the output processor detokenizes, and its EngineCore descendants; render sidecar), read from /proc
(psutil) before and after every stream; client-side inter-token latency (gaps between successive
deliveries that carry text or tool-call deltas, pooled over the streams, p50/p90) and time to the
first text; whether the token ids and the joined text are identical across the legs.

Parsers: ``ServingTokens.serve_tokens_stream_generator``
(``vllm/entrypoints/scale_out/token_in_token_out/serving.py``) puts the output processor's
``output.text`` into ``GenerateTextStreamChoice.text`` as is; that choice has no ``tool_calls``,
``reasoning`` or ``content`` fields, and no tool or reasoning parser is built on that path
(``reasoning_ended``/``reasoning_parser_kwargs`` only reach the engine's structured-output manager).
The parsers run only in derender (``OnlineDerenderer._derender_chat_stream_parsed``,
``vllm/renderers/online_derenderer.py``), whose ``generate_chunk`` must be ``output_mode: "tokens"``.
So a parser stream on the text path still needs a parse step somewhere else; this benchmark shows
that the sidecar refuses a text chunk (400), and measures what that step costs when done in-process
(vLLM's hermes ``Parser.parse_delta`` driven with the text engine's deltas, as ``vllm serve`` does)
and whether its result equals the tokens path's.

    python -m perf.text_paths [--max-tokens 256] [--rounds 2] [--no-parser] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

from perf._procs import SERVED, own_cpu_s, render_sidecars, reserved_port, sidecar_pid, tree_cpu_s
from perf._report import Progress, final_json, pct, save_figure, write_report
from perf.parser_chunking import WEATHER_TOOL  # the tool the parser measurements use

NAME = "text_paths"
SEED_SUFFIX = 8           # plain derender: prompt ids that seed detokenisation (coordinator: _SEED_SUFFIX)
COALESCE_TOKENS = 32      # coordinator default: stream.max_tokens_per_call
HERMES_FLAGS = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}
PLAIN_PROMPTS = ["Tell me a long story about a lighthouse keeper.",
                 "Explain how a bicycle gear system works, step by step.",
                 "Write a letter to a friend about a trip to the mountains."]


def _call(city: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': {'city': city}})}\n</tool_call>"


_FEW_SHOT = [
    {"role": "system", "content": "You call tools. Answer every question with exactly one tool call."},
    {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": _call("Paris")},
    {"role": "user", "content": "Weather in Rome?"}, {"role": "assistant", "content": _call("Rome")}]
HERMES_CHATS: list[list[dict[str, str]]] = [
    [*_FEW_SHOT, {"role": "user", "content": "Weather in Berlin?"}],      # a tool call, then free text
    [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],   # content only
    [*_FEW_SHOT, {"role": "user", "content": "Weather in Madrid?"}],
]
LEG_NAMES = ("tokens", "text", "native", "control")


class _Answer(msgspec.Struct):
    chunk: dict[str, Any]
    stream_state: msgspec.Raw = msgspec.Raw(b"null")


_encode = msgspec.json.Encoder().encode
_decode_answer = msgspec.json.Decoder(_Answer).decode


@dataclass
class Stream:
    """What the client saw of one stream."""

    token_ids: list[int] = field(default_factory=list)
    content: str = ""
    tool_calls: dict[int, list[str]] = field(default_factory=dict)   # index -> [name, arguments]
    deliveries: list[float] = field(default_factory=list)           # perf_counter of each text delta
    start: float = 0.0
    end: float = 0.0                                                 # the engine stream's end
    calls: int = 0                                                   # derender calls (tokens leg)
    chunks: list[tuple[str, list[int], bool]] = field(default_factory=list)  # text leg: raw engine chunks
    finish_reason: str | None = None

    def add_delta(self, delta: dict[str, Any], at: float) -> None:
        got = False
        if delta.get("content"):
            self.content += delta["content"]
            got = True
        for tc in delta.get("tool_calls") or ():
            slot = self.tool_calls.setdefault(int(tc.get("index", 0)), ["", ""])
            fn = tc.get("function") or {}
            slot[0] += fn.get("name") or ""
            slot[1] += fn.get("arguments") or ""
            got = True
        if got:
            self.deliveries.append(at)

    def calls_list(self) -> list[list[str]]:
        return [self.tool_calls[i] for i in sorted(self.tool_calls)]


async def _engine_lines(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Any:
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"{url}: {r.status_code} {r.text[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(f"{url}: {data['error']}")
            yield data


def _merge(group: list[dict[str, Any]]) -> dict[str, Any]:
    """Engine chunks of one choice as one (what the coordinator's ``merge_group`` does, no logprobs)."""
    last = group[-1]
    choice = dict(last["choices"][0])
    choice["token_ids"] = [t for c in group for t in (c["choices"][0].get("token_ids") or ())]
    return {**last, "choices": [choice]}


async def tokens_stream(client: httpx.AsyncClient, engine: str, sidecar: str, gen: dict[str, Any],
                        chat: dict[str, Any], parser: bool, rid: str) -> Stream:
    out = Stream()
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    body = {**gen, "request_id": rid, "stream": True, "output_mode": "tokens"}
    prompt: list[int] = gen["token_ids"]
    view = msgspec.Raw(_encode({**chat, "messages": [{"role": "user", "content": ""}]}))

    async def read() -> None:
        try:
            async for data in _engine_lines(client, f"{engine}/inference/v1/generate", body):
                if data.get("choices"):
                    await queue.put(data)
        finally:
            await queue.put(None)

    async def derender(chunk: dict[str, Any], state: Any, seed: list[int] | None) -> tuple[int, bytes]:
        req = {"stream": True, "model": SERVED, "generate_chunk": {**chunk, "request_id": rid},
               "stream_state": state, "prompt_tokens": len(prompt), "prompt_token_ids": seed,
               "chat_request": view}
        r = await client.post(f"{sidecar}/v1/chat/completions/derender", content=_encode(req),
                              headers={"content-type": "application/json"})
        out.calls += 1
        return r.status_code, r.content

    out.start = time.perf_counter()
    reader = asyncio.create_task(read())
    state: Any = None
    ended = False
    try:
        while not ended:
            first = await queue.get()
            if first is None:
                break
            group, n = [first], len(first["choices"][0].get("token_ids") or ())
            while n < COALESCE_TOKENS and not queue.empty():
                nxt = queue.get_nowait()
                if nxt is None:
                    ended = True
                    break
                group.append(nxt)
                n += len(nxt["choices"][0].get("token_ids") or ())
            chunk = _merge(group) if len(group) > 1 else first
            if parser:
                seed = prompt if state is None else None
            else:
                seed = prompt[-SEED_SUFFIX:] if state is None else None
            status, content = await derender(chunk, state, seed)
            if status == 409 and b"stream_session_miss" in content:
                status, content = await derender(chunk, state, prompt)
            if status != 200:
                raise RuntimeError(f"derender {status}: {content[:300]!r}")
            answer = _decode_answer(content)
            at = time.perf_counter()
            state = None if bytes(answer.stream_state) == b"null" else answer.stream_state
            out.token_ids += chunk["choices"][0].get("token_ids") or []
            for c in answer.chunk.get("choices") or ():
                out.add_delta(c.get("delta") or {}, at)
                out.finish_reason = c.get("finish_reason") or out.finish_reason
    finally:
        await reader
    out.end = time.perf_counter()
    return out


async def text_stream(client: httpx.AsyncClient, engine: str, gen: dict[str, Any], rid: str, *,
                      text: bool = True) -> Stream:
    """``output_mode: "text"``; ``text=False``: the control, the same engine with ``output_mode: "tokens"``
    and ``detokenize: false`` (no detokenization anywhere, no derender; a chunk with token ids is a
    delivery)."""
    out = Stream()
    body = {**gen, "request_id": rid, "stream": True, "output_mode": "text" if text else "tokens",
            "sampling_params": {**gen["sampling_params"], "detokenize": text}}
    out.start = time.perf_counter()
    async for data in _engine_lines(client, f"{engine}/inference/v1/generate", body):
        at = time.perf_counter()
        for c in data.get("choices") or ():
            ids = c.get("token_ids") or []
            out.token_ids += ids
            out.chunks.append((c.get("text") or "", ids, c.get("finish_reason") is not None))
            if text:
                out.add_delta({"content": c.get("text")}, at)
            elif ids:
                out.deliveries.append(at)
            out.finish_reason = c.get("finish_reason") or out.finish_reason
    out.end = time.perf_counter()
    return out


async def native_stream(client: httpx.AsyncClient, engine: str, chat: dict[str, Any]) -> Stream:
    out = Stream()
    out.start = time.perf_counter()
    async for data in _engine_lines(client, f"{engine}/v1/chat/completions", {**chat, "stream": True}):
        at = time.perf_counter()
        for c in data.get("choices") or ():
            out.add_delta(c.get("delta") or {}, at)
            out.finish_reason = c.get("finish_reason") or out.finish_reason
    out.end = time.perf_counter()
    return out


@dataclass
class Procs:
    tokens_engine: int
    text_engine: int
    sidecar: int

    def snapshot(self) -> dict[str, float]:
        snap: dict[str, float] = {}
        for name, pid in (("tokens_engine", self.tokens_engine), ("text_engine", self.text_engine),
                          ("sidecar", self.sidecar)):
            tree = tree_cpu_s(pid)
            if tree is None:
                raise RuntimeError(f"{name} (pid {pid}) is gone")
            snap[f"{name}_tree"] = tree
            snap[f"{name}_front"] = own_cpu_s(pid)
        return snap


@dataclass
class Leg:
    streams: list[Stream] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)

    def add(self, stream: Stream, before: dict[str, float], after: dict[str, float]) -> None:
        self.streams.append(stream)
        for k in before:
            self.cpu[k] = self.cpu.get(k, 0.0) + after[k] - before[k]


def _leg_figures(name: str, leg: Leg, max_tokens: int) -> dict[str, Any]:
    tokens = sum(len(s.token_ids) for s in leg.streams) or len(leg.streams) * max_tokens
    engine = "tokens_engine" if name == "tokens" else "text_engine"

    def per_token_ms(key: str) -> float:
        return round(leg.cpu.get(key, 0.0) / tokens * 1000, 4)

    gaps = [b - a for s in leg.streams for a, b in zip(s.deliveries, s.deliveries[1:], strict=False)]
    ttft = [s.deliveries[0] - s.start for s in leg.streams if s.deliveries]
    walls = [s.end - s.start for s in leg.streams]
    front, tree = per_token_ms(f"{engine}_front"), per_token_ms(f"{engine}_tree")
    sidecar = per_token_ms("sidecar_tree") if name == "tokens" else 0.0
    f: dict[str, Any] = {
        "streams": len(leg.streams), "output_tokens": tokens,
        "engine_cpu_ms_per_token": tree, "engine_front_cpu_ms_per_token": front,
        "engine_core_cpu_ms_per_token": round(tree - front, 4),
        "sidecar_cpu_ms_per_token": sidecar,
        "sidecar_cpu_ms_per_token_measured": per_token_ms("sidecar_tree"),
        "total_cpu_ms_per_token": round(tree + sidecar, 4),
        "other_engine_cpu_ms_per_token": per_token_ms(
            ("text_engine" if name == "tokens" else "tokens_engine") + "_tree"),
        "itl_p50_ms": round(pct(gaps, 50) * 1000, 3), "itl_p90_ms": round(pct(gaps, 90) * 1000, 3),
        "itl_p99_ms": round(pct(gaps, 99) * 1000, 3),
        "ttft_p50_ms": round(pct(ttft, 50) * 1000, 2),
        "tokens_per_s": round(tokens / sum(walls), 2) if walls else None,
        "deliveries_per_stream": round(statistics.fmean(len(s.deliveries) for s in leg.streams), 1),
    }
    if name == "tokens":
        f["derender_calls_per_token"] = round(sum(s.calls for s in leg.streams) / tokens, 4)
    return f


def _render(url: str, chat: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/chat/completions/render", json=chat, timeout=60)
    r.raise_for_status()
    gen: dict[str, Any] = r.json()
    sp = dict(gen["sampling_params"])
    sp.update({"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0})
    return {**gen, "sampling_params": sp}


def _text_chunk_refused(sidecar: str, gen: dict[str, Any], chat: dict[str, Any]) -> dict[str, Any]:
    """One text-mode chunk sent to the sidecar's streaming derender, as if to parse it there."""
    chunk = {"request_id": "text-probe", "output_mode": "text", "usage": None,
             "choices": [{"index": 0, "text": "Hello", "token_ids": [19556], "finish_reason": None}]}
    body = {"stream": True, "model": SERVED, "generate_chunk": chunk, "stream_state": None,
            "prompt_tokens": len(gen["token_ids"]), "prompt_token_ids": gen["token_ids"],
            "chat_request": {**chat, "messages": [{"role": "user", "content": ""}]}}
    r = httpx.post(f"{sidecar}/v1/chat/completions/derender", json=body, timeout=60)
    try:
        message = str(r.json().get("error", {}).get("message", ""))
    except (ValueError, AttributeError):
        message = r.text
    # FastAPI tries the batch and the stream model; the stream model's complaint is the one that counts.
    lines = [ln.strip() for ln in message.splitlines() if "output_mode" in ln]
    return {"status": r.status_code, "message": (lines[0] if lines else message)[:300]}


def run_legs(procs: Procs, engines: dict[str, str], sidecar: str, chats: list[dict[str, Any]],
             max_tokens: int, rounds: int, parser: bool, label: str, say: Progress) -> dict[str, Any]:
    gens = [_render(sidecar, c, max_tokens) for c in chats]
    legs = {n: Leg() for n in LEG_NAMES}
    per_prompt: list[dict[str, Stream]] = [{} for _ in chats]

    async def go() -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            async def one(name: str, rid: str, gen: dict[str, Any], chat: dict[str, Any]) -> Stream:
                if name == "tokens":
                    return await tokens_stream(client, engines["tokens"], sidecar, gen, chat, parser, rid)
                if name in ("text", "control"):
                    return await text_stream(client, engines["text"], gen, rid, text=name == "text")
                return await native_stream(client, engines["text"], chat)

            say(f"{label}: warm-up (one short stream per leg)")
            short = {**gens[0], "sampling_params": {**gens[0]["sampling_params"], "max_tokens": 8}}
            for name in LEG_NAMES:
                await one(name, f"{label}-warm-{name}", short, {**chats[0], "max_tokens": 8})
            for r in range(rounds):
                for i in range(len(chats)):
                    order = LEG_NAMES if (r + i) % 2 == 0 else tuple(reversed(LEG_NAMES))
                    for name in order:
                        before = procs.snapshot()
                        s = await one(name, f"{label}-{name}-{i}-r{r}", gens[i], chats[i])
                        after = procs.snapshot()
                        legs[name].add(s, before, after)
                        per_prompt[i][name] = s
                        cpu_key = ("tokens_engine" if name == "tokens" else "text_engine") + "_tree"
                        say(f"{label} round {r} prompt {i} {name}: {len(s.token_ids) or '-'} tokens, "
                            f"{len(s.deliveries)} deltas, {s.calls} derender calls, engine CPU "
                            f"{after[cpu_key] - before[cpu_key]:.2f} s, sidecar CPU "
                            f"{after['sidecar_tree'] - before['sidecar_tree']:.2f} s")

    asyncio.run(go())
    f: dict[str, Any] = {"prompt_tokens": [len(g["token_ids"]) for g in gens],
                         "legs": {n: _leg_figures(n, legs[n], max_tokens) for n in LEG_NAMES}}
    checks = []
    for i, by in enumerate(per_prompt):
        a, b, nat = by["tokens"], by["text"], by["native"]
        checks.append({
            "prompt": i, "tokens_identical": a.token_ids == b.token_ids == by["control"].token_ids,
            "tokens_path_output_tokens": len(a.token_ids),
            "text_identical": a.content == b.content and not a.tool_calls,
            "native_identical": a.content == nat.content and a.calls_list() == nat.calls_list(),
            "text_equals_native": b.content == nat.content and not nat.tool_calls,
            "tool_calls_tokens_path": a.calls_list(), "tool_calls_native": nat.calls_list(),
            "text_has_tool_markup": "<tool_call>" in b.content,
            "finish_reason": {"tokens": a.finish_reason, "text": b.finish_reason,
                              "native": nat.finish_reason},
            "head": {"tokens": a.content[:120], "text": b.content[:120], "native": nat.content[:120]},
        })
        say(f"{label} prompt {i}: token ids identical {checks[-1]['tokens_identical']}, text identical "
            f"{checks[-1]['text_identical']}, tokens path = native {checks[-1]['native_identical']}, "
            f"tool calls {a.calls_list()}")
    f["identity"] = checks
    f["last_streams"] = per_prompt  # dropped before the JSON is written
    f["gens"] = gens
    return f


def parse_locally(chats: list[dict[str, Any]], gens: list[dict[str, Any]], streams: list[dict[str, Stream]],
                  say: Progress) -> dict[str, Any]:
    """The parse step the text path would still need: vLLM's hermes parser driven in this process with
    the text engine's own deltas (one ``parse_delta`` per engine chunk, as ``vllm serve`` does)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager
    from vllm.tokenizers import get_tokenizer

    from token_engine.model_prep import ensure_model

    model = str(ensure_model())
    tokenizer = get_tokenizer(model)
    cls = ParserManager.get_parser(tool_parser_name="hermes", enable_auto_tools=True, model_name=model,
                                   tokenizer=tokenizer)
    assert cls is not None
    cpu, tokens, same = 0.0, 0, []
    for chat, gen, by in zip(chats, gens, streams, strict=True):
        request = ChatCompletionRequest(**chat)
        parser = cls(tokenizer, request.tools, chat_template_kwargs={}, model_config=None)  # type: ignore[arg-type]
        parsed = Stream()
        t0 = time.process_time()
        deltas = [parser.parse_delta(text, ids, request, prompt_token_ids=gen["token_ids"], finished=fin)
                  for text, ids, fin in by["text"].chunks]
        cpu += time.process_time() - t0
        tokens += len(by["text"].token_ids)
        for d in deltas:
            if d is not None:
                parsed.add_delta(d.model_dump(exclude_none=True), 0.0)
        a = by["tokens"]
        same.append(parsed.content == a.content and parsed.calls_list() == a.calls_list())
    f = {"parse_cpu_ms_per_token": round(cpu / max(1, tokens) * 1000, 4), "equals_tokens_path": same}
    say(f"hermes parse step in-process on the text deltas: {f}")
    return f


@contextmanager
def engines_up(out_dir: Path, say: Progress) -> Iterator[tuple[Any, Any]]:
    from token_engine.launch import VllmEngine
    from token_engine.model_prep import ensure_model

    model = ensure_model()
    with ExitStack() as stack:
        tok = VllmEngine(model, port=reserved_port(), mode="tokens-only", enable_log_requests=False,
                         kvcache_space_gib=1, echo=False, log_path=out_dir / "engine-tokens.log",
                         name="engine-tokens")
        txt = VllmEngine(model, port=reserved_port(), mode="scale-out", enable_log_requests=False,
                         kvcache_space_gib=1, echo=False, log_path=out_dir / "engine-text.log",
                         name="engine-text",
                         extra_args=["--tool-call-parser", "hermes", "--enable-auto-tool-choice"])
        for e in (tok, txt):
            e.start()
            stack.callback(e.stop)
        say("waiting for the tokens-only and the scale-out engine (real vLLM, 1 GiB KV cache each)")
        for e in (tok, txt):
            e.wait_ready(timeout=600)
        yield tok, txt


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="streams per prompt and leg")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per part (plain, hermes)")
    ap.add_argument("--no-parser", action="store_true", help="skip the hermes part")
    ap.add_argument("--quick", action="store_true", help="smoke run: 32 tokens, one prompt, one round")
    args = ap.parse_args(argv)
    if args.quick:
        args.max_tokens, args.rounds, args.prompts = 32, 1, 1
    say = Progress(NAME)
    out_dir = write_report(NAME, {}, "# Engine-side text vs tokens + derender\n\n(running)\n")
    f: dict[str, Any] = {"max_tokens": args.max_tokens, "rounds": args.rounds, "quick": args.quick,
                         "coalesce_tokens": COALESCE_TOKENS, "parts": {}}
    plain_chats = [{"model": SERVED, "messages": [{"role": "user", "content": q}], "temperature": 0,
                    "max_tokens": args.max_tokens, "ignore_eos": True}
                   for q in PLAIN_PROMPTS[:args.prompts]]
    hermes_chats = [{"model": SERVED, "messages": m, "tools": [WEATHER_TOOL], "temperature": 0,
                     "max_tokens": args.max_tokens, "ignore_eos": True} for m in HERMES_CHATS[:args.prompts]]
    parts: list[tuple[str, dict[str, Any], list[dict[str, Any]]]] = [("plain", {}, plain_chats)]
    if not args.no_parser:
        parts.append(("hermes", HERMES_FLAGS, hermes_chats))
    with engines_up(out_dir, say) as (tok, txt):
        engines = {"tokens": tok.url, "text": txt.url}
        for label, flags, chats in parts:
            say(f"{label}: render sidecar starting{' with ' + str(flags) if flags else ''}")
            with render_sidecars(1, say, log_dir=out_dir / label, **flags) as (sc,):
                pid = sidecar_pid(sc)
                assert pid is not None and tok.process is not None and txt.process is not None
                procs = Procs(tok.process.pid, txt.process.pid, pid)
                part = run_legs(procs, engines, sc.url, chats, args.max_tokens, args.rounds,
                                bool(flags), label, say)
                if flags:
                    part["text_chunk_to_derender"] = _text_chunk_refused(sc.url, part["gens"][0], chats[0])
                    say(f"{label}: a text-mode chunk sent to derender -> {part['text_chunk_to_derender']}")
            if flags:
                part["parse_step"] = parse_locally(chats, part["gens"], part["last_streams"], say)
            del part["last_streams"], part["gens"]
            legs = part["legs"]
            part["text_cpu_vs_tokens_total"] = round(
                legs["text"]["engine_cpu_ms_per_token"] / legs["tokens"]["total_cpu_ms_per_token"], 3)
            tokens_leg = legs["tokens"]
            part["text_front_vs_tokens_front_plus_sidecar"] = round(
                legs["text"]["engine_front_cpu_ms_per_token"]
                / (tokens_leg["engine_front_cpu_ms_per_token"] + tokens_leg["sidecar_cpu_ms_per_token"]), 3)
            # Same engine instance, with and without detokenization: what text mode itself adds there.
            text_leg, control = legs["text"], legs["control"]
            part["detok_front_ms_per_token"] = round(
                text_leg["engine_front_cpu_ms_per_token"] - control["engine_front_cpu_ms_per_token"], 4)
            part["detok_tree_ms_per_token"] = round(
                text_leg["engine_cpu_ms_per_token"] - control["engine_cpu_ms_per_token"], 4)
            part["text_core_vs_control_core"] = round(
                text_leg["engine_core_cpu_ms_per_token"] / control["engine_core_cpu_ms_per_token"], 3)
            part["itl_p50_ratio"] = round(legs["text"]["itl_p50_ms"] / legs["tokens"]["itl_p50_ms"], 3)
            part["itl_p90_ratio"] = round(legs["text"]["itl_p90_ms"] / legs["tokens"]["itl_p90_ms"], 3)
            f["parts"][label] = part
            say(f"{label}: text/tokens total CPU per token {part['text_cpu_vs_tokens_total']}, "
                f"ITL p50 ratio {part['itl_p50_ratio']}")
    plain = f["parts"]["plain"]
    f["text_identical"] = all(c["text_identical"] for c in plain["identity"])
    f["tokens_identical"] = all(c["tokens_identical"] for p in f["parts"].values() for c in p["identity"])
    out = write_report(NAME, f, _markdown(f))
    _plot(f, out / f"{NAME}.png")
    say(f"report: {out}/report.md, plot: {out}/{NAME}.png")
    head: dict[str, Any] = {"benchmark": NAME, "max_tokens": args.max_tokens}
    for label, part in f["parts"].items():
        p = "" if label == "plain" else f"{label}_"
        head[f"{p}text_cpu_vs_tokens_total"] = part["text_cpu_vs_tokens_total"]
        head[f"{p}text_front_vs_tokens_front_plus_sidecar"] = part["text_front_vs_tokens_front_plus_sidecar"]
        head[f"{p}itl_p50_ratio"] = part["itl_p50_ratio"]
        head[f"{p}detok_front_ms_per_token"] = part["detok_front_ms_per_token"]
        head[f"{p}sidecar_cpu_ms_per_token"] = part["legs"]["tokens"]["sidecar_cpu_ms_per_token"]
        head[f"{p}tokens_total_cpu_ms_per_token"] = part["legs"]["tokens"]["total_cpu_ms_per_token"]
        head[f"{p}text_cpu_ms_per_token"] = part["legs"]["text"]["engine_cpu_ms_per_token"]
    head["text_identical"] = f["text_identical"]
    head["tokens_identical"] = f["tokens_identical"]
    if "hermes" in f["parts"]:
        h = f["parts"]["hermes"]
        head["hermes_text_path_parses"] = False
        head["hermes_text_identical"] = all(c["text_identical"] for c in h["identity"])
        head["hermes_tokens_path_equals_native"] = all(c["native_identical"] for c in h["identity"])
        head["hermes_text_chunk_derender_status"] = h["text_chunk_to_derender"]["status"]
        head["hermes_parse_step_cpu_ms_per_token"] = h["parse_step"]["parse_cpu_ms_per_token"]
    final_json(head)


def _markdown(f: dict[str, Any]) -> str:
    cols = ["engine CPU ms/token (front + core)", "sidecar CPU ms/token", "**total CPU ms/token**",
            "ITL p50 / p90 / p99 ms", "first text p50 ms", "tokens/s", "deltas per stream"]
    lines = [f"# Engine-side text vs tokens + derender\n\n{f['max_tokens']} output tokens per stream "
             f"(greedy, `ignore_eos`), {f['rounds']} rounds, legs interleaved in alternating order, one "
             "stream at a time. `tokens`: `--tokens-only` engine + the render sidecar's streaming derender "
             "per engine chunk (httpx on the wire, the coordinator's call pattern; merged up to "
             f"{f['coalesce_tokens']} tokens when chunks queue up); `text`: `--enable-scale-out` engine with "
             "`output_mode: \"text\"`; `native`: that engine's `/v1/chat/completions`; `control`: that "
             "engine with `output_mode: \"tokens\"` and `detokenize: false`, no derender (what its "
             "instance costs without any detokenization; a delivery is a chunk of token ids). Engine CPU = "
             "its process tree (front = the API-server process, where the output processor detokenizes; "
             "core = EngineCore and workers)."]
    for label, part in f["parts"].items():
        note = ("" if label == "plain" else " With a parser, the tokens and native legs deliver what the "
                "parser releases (a tool call in a few pieces, once its markup is complete), the text leg "
                "the raw markup token by token: their ITL and time to first text measure different things; "
                "tokens/s is over the whole engine stream.")
        lines.append(f"\n## {label}\n\nPrompt tokens {part['prompt_tokens']}.{note}\n")
        lines.append("| leg | " + " | ".join(cols) + " |")
        lines.append("|---" * (len(cols) + 1) + "|")
        for name, leg in part["legs"].items():
            lines.append(
                f"| {name} | {leg['engine_cpu_ms_per_token']} ({leg['engine_front_cpu_ms_per_token']} + "
                f"{leg['engine_core_cpu_ms_per_token']}) | {leg['sidecar_cpu_ms_per_token']} | "
                f"**{leg['total_cpu_ms_per_token']}** | {leg['itl_p50_ms']} / {leg['itl_p90_ms']} / "
                f"{leg['itl_p99_ms']} | {leg['ttft_p50_ms']} | {leg['tokens_per_s']} | "
                f"{leg['deliveries_per_stream']} |")
        lines.append(f"\ntext / tokens total CPU per token: **{part['text_cpu_vs_tokens_total']}**; "
                     "text front / (tokens front + sidecar): "
                     f"{part['text_front_vs_tokens_front_plus_sidecar']}; ITL p50 ratio text / tokens: "
                     f"**{part['itl_p50_ratio']}** (p90 {part['itl_p90_ratio']}); derender calls per token "
                     f"{part['legs']['tokens'].get('derender_calls_per_token')}. Text mode on the same "
                     f"engine instance (text - control): front {part['detok_front_ms_per_token']} CPU ms per "
                     f"token, whole tree {part['detok_tree_ms_per_token']}; core text / control "
                     f"{part['text_core_vs_control_core']}.\n")
        lines.append("| prompt | token ids identical | text identical (tokens vs text) | tokens path = "
                     "native | tool calls (tokens path) | tool markup in engine text |")
        lines.append("|---|---|---|---|---|---|")
        for c in part["identity"]:
            lines.append(f"| {c['prompt']} | {c['tokens_identical']} | {c['text_identical']} | "
                         f"{c['native_identical']} | {c['tool_calls_tokens_path']} | "
                         f"{c['text_has_tool_markup']} |")
        if "text_chunk_to_derender" in part:
            t = part["text_chunk_to_derender"]
            lines.append(f"\nA text-mode chunk sent to the sidecar's streaming derender: HTTP {t['status']} "
                         f"(`{t['message'][:160]}`).")
        if "parse_step" in part:
            ps = part["parse_step"]
            lines.append("\nParse step the text path still needs (vLLM's hermes `parse_delta` in-process "
                         f"on the text engine's deltas): {ps['parse_cpu_ms_per_token']} CPU ms per token; "
                         f"result equals the tokens path's per prompt: {ps['equals_tokens_path']}.")
    lines.append(f"\n![plot]({NAME}.png)\n")
    return "\n".join(lines)


def _plot(f: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    labels, front, side, p50, p90 = [], [], [], [], []
    for label, part in f["parts"].items():
        for name, leg in part["legs"].items():
            labels.append(f"{label}\n{name}")
            front.append(leg["engine_front_cpu_ms_per_token"])
            side.append(leg["sidecar_cpu_ms_per_token"])
            p50.append(leg["itl_p50_ms"])
            p90.append(leg["itl_p90_ms"])
    xs = list(range(len(labels)))
    ax = axes[0]  # the model's forward (engine core, ~100 ms/token on CPU) is in the table, not here
    ax.bar(xs, front, label="engine front (API server)")
    ax.bar(xs, side, bottom=front, label="render sidecar")
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_ylabel("CPU ms per output token")
    ax.set_title("serving-side CPU per token (engine core left out)")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.bar([x - 0.2 for x in xs], p50, 0.4, label="p50")
    ax.bar([x + 0.2 for x in xs], p90, 0.4, label="p90")
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_ylabel("ms between text deltas (client)")
    ax.set_title("inter-token latency")
    ax.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
