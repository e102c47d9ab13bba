"""The sidecar's parser-session cache against vLLM's own stateless derender, on real render servers.

Three real sidecars with SmolLM2's tokenizer: ``cached`` (our render server, hermes + olmo3, at most
two sessions so that interleaved streams evict each other), ``stateless`` (vLLM's render server,
same flags: the reference) and ``hermes`` (ours, the hermes tool parser alone). Every stream is
derendered call by call as the coordinator does it (the state of each answer passed to the next
call; on our server the prompt ids only where it asks for them) and compared chunk for chunk with the
reference. Tool-call ids are random per replay in vLLM, so they are compared by shape only.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

# The model outputs and tool of the coalescing measurement, so the test re-checks what it measured.
from perf.parser_chunking import OUTPUTS as MEASURED
from perf.parser_chunking import THOUGHT, WEATHER_TOOL
from tests.conftest import SERVED, make_settings
from tests.support import CoordinatorServer, free_port, sse_events
from token_engine.simulator import SimConfig, SimulatedEngine

MAX_LEN = 4096
EOS = 2
REASONING = MEASURED["reasoning"]        # <think>…</think> then an answer
TOOL = MEASURED["reasoning_then_tool"]   # <think>…</think> then a hermes tool call
TOOL_ONLY = MEASURED["tool"]             # a sentence then a hermes tool call
PLAIN = "The lighthouse keeper climbed the stairs at dusk and lit the lamp for the ships."
# Characters whose UTF-8 bytes span several tokens: the detokenizer's window must carry over calls.
UNICODE = "<think>晴れ 🌞 → ☀️?</think>Il fait beau à Paris 🌤️, 晴天です。"


class Sidecar:
    def __init__(self, server: Any) -> None:
        self.server = server
        self.http = httpx.Client(base_url=str(server.url), timeout=60)

    @property
    def url(self) -> str:
        return str(self.server.url)

    def metric(self, name: str, label: str = "") -> float:
        text = self.http.get("/metrics").text
        pattern = rf"^{re.escape(name)}{re.escape(label)} ([0-9.e+-]+)$"
        found = re.search(pattern, text, re.M)
        assert found, f"{name}{label} not on /metrics"
        return float(found[1])


@pytest.fixture(scope="module")
def sidecars(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Sidecar]]:
    from render_sidecar.launch import RenderSidecar

    logs = tmp_path_factory.mktemp("session-logs")
    both = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True, "reasoning_parser": "olmo3"}
    servers = {
        "cached": RenderSidecar(model_dir, port=free_port(), served_model_name=SERVED, max_model_len=MAX_LEN,
                                session_cache=True, session_cache_entries=2, log_path=logs / "cached.log",
                                echo=False, **both),
        "stateless": RenderSidecar(model_dir, port=free_port(), served_model_name=SERVED,
                                   max_model_len=MAX_LEN, session_cache=False, log_path=logs / "stateless.log",
                                   echo=False, **both),
        "hermes": RenderSidecar(model_dir, port=free_port(), served_model_name=SERVED, max_model_len=MAX_LEN,
                                session_cache=True, tool_call_parser="hermes", enable_auto_tool_choice=True,
                                log_path=logs / "hermes.log", echo=False),
    }
    with contextlib.ExitStack() as stack:
        for server in servers.values():
            server.start()
            stack.callback(server.stop)
        for server in servers.values():
            server.wait_ready(timeout=600)
        yield {name: Sidecar(server) for name, server in servers.items()}


class Stream:
    """One prompt/choice stream derendered call by call, the coordinator's way."""

    def __init__(self, sidecar: Sidecar, request_id: str, prompt_ids: list[int], chat_request: dict[str, Any],
                 *, lean: bool) -> None:
        self.sidecar = sidecar
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.chat_request = chat_request
        self.lean = lean           # prompt ids only on the first call and when asked (409)
        self.state: dict[str, Any] | None = None
        self.chunks: list[dict[str, Any]] = []
        self.resent = 0

    def call(self, tokens: list[int], finish: str | None = None, *,
             state: dict[str, Any] | None = None, rewind: bool = False) -> dict[str, Any]:
        st = state if rewind else self.state
        choice = {"index": 0, "token_ids": tokens, "finish_reason": finish,
                  "stop_reason": EOS if finish else None}
        body = {"stream": True, "model": SERVED, "generate_chunk": {"request_id": self.request_id,
                                                                     "choices": [choice]},
                "stream_state": st, "prompt_tokens": len(self.prompt_ids),
                "prompt_token_ids": None if self.lean and st is not None else self.prompt_ids,
                "chat_request": self.chat_request}
        r = self.sidecar.http.post("/v1/chat/completions/derender", json=body)
        if r.status_code == 409:
            assert r.json()["error"]["type"] == "stream_session_miss", r.text
            self.resent += 1
            r = self.sidecar.http.post("/v1/chat/completions/derender",
                                       json={**body, "prompt_token_ids": self.prompt_ids})
        assert r.status_code == 200, r.text
        out = r.json()
        self.state = out["stream_state"]
        chunk = out["chunk"]
        self.chunks.append(chunk)
        return chunk


def render(sidecar: Sidecar, tools: bool) -> tuple[list[int], dict[str, Any]]:
    body: dict[str, Any] = {"model": SERVED, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                            "stream": True}
    if tools:
        body.update(tools=[WEATHER_TOOL], tool_choice="auto")
    r = sidecar.http.post("/v1/chat/completions/render", json=body)
    assert r.status_code == 200, r.text
    return r.json()["token_ids"], {**body, "messages": [{"role": "user", "content": ""}]}


def tokens(sidecar: Sidecar, text: str) -> list[int]:
    r = sidecar.http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    return [*r.json()["tokens"], EOS]


def comparable(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chunks without what differs by design: ``created``, the id (request-derived) and tool-call ids
    (fresh per replay in vLLM, pinned per stream)."""
    out = []
    for chunk in chunks:
        c = {k: v for k, v in chunk.items() if k not in ("created", "id")}
        c["choices"] = []
        for choice in chunk["choices"]:
            delta = dict(choice.get("delta") or {})
            if delta.get("tool_calls"):
                delta["tool_calls"] = [{**tc, "id": bool(tc.get("id"))} for tc in delta["tool_calls"]]
            c["choices"].append({**choice, "delta": delta})
        out.append(c)
    return out


def assembled(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    content, reasoning, args, names, finish = "", "", {}, {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning") or ""
            for tc in delta.get("tool_calls") or []:
                fn = tc.get("function") or {}
                args[tc["index"]] = args.get(tc["index"], "") + (fn.get("arguments") or "")
                if fn.get("name"):
                    names[tc["index"]] = names.get(tc["index"], "") + fn["name"]
            finish = choice.get("finish_reason") or finish
    return {"content": content, "reasoning": reasoning, "args": args, "names": names, "finish": finish}


def run(stream: Stream, ids: list[int], size: int) -> list[dict[str, Any]]:
    for lo in range(0, len(ids), size):
        last = lo + size >= len(ids)
        stream.call(ids[lo:lo + size], "stop" if last else None)
    return stream.chunks


TOOL_BODY: dict[str, Any] = {"model": SERVED, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                             "stream": True, "tools": [WEATHER_TOOL], "tool_choice": "auto", "temperature": 0}


def client_chunks(events: list[Any]) -> list[dict[str, Any]]:
    """A whole SSE answer as a client sees it: ends with [DONE], no error event; its chunks."""
    assert events and events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert not any("error" in c for c in chunks), chunks[-2:]
    return chunks


def through(coord: CoordinatorServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    """``body`` streamed through the coordinator; the chunks the client got."""
    return client_chunks(sse_events(httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=120)))


OUTPUTS = {"reasoning": (REASONING, False), "tool": (TOOL, True), "plain": (PLAIN, False),
           "unicode": (UNICODE, False)}


@pytest.mark.parametrize("size", [1, 3, 7, 32])
@pytest.mark.parametrize("output", list(OUTPUTS))
def test_cached_streams_equal_vllms_replay(sidecars: dict[str, Sidecar], output: str, size: int) -> None:
    cached, stateless = sidecars["cached"], sidecars["stateless"]
    text, tools = OUTPUTS[output]
    prompt, chat_request = render(cached, tools)
    ids = tokens(cached, text)
    hits = cached.metric("render_sidecar_session_hits_total")
    want = run(Stream(stateless, f"ref-{output}-{size}", prompt, chat_request, lean=False), ids, size)
    got = run(Stream(cached, f"c-{output}-{size}", prompt, chat_request, lean=True), ids, size)
    assert comparable(got) == comparable(want)
    calls = len(want)
    assert cached.metric("render_sidecar_session_hits_total") - hits == calls - 1  # every call after the first
    if output in ("reasoning", "tool"):
        assert assembled(got)["reasoning"] == THOUGHT  # the parsers do work on this tokenizer
    if output == "unicode":
        assert "🌞" in assembled(got)["reasoning"] and "晴天" in assembled(got)["content"]


def test_interleaved_streams_evicted_each_call_still_equal_the_replay(sidecars: dict[str, Sidecar]) -> None:
    """Three streams taking turns on a sidecar that holds two sessions: every call finds its session
    evicted, gets a 409, and is answered by a replay."""
    cached, stateless = sidecars["cached"], sidecars["stateless"]
    prompt, chat_request = render(cached, True)
    ids = tokens(cached, TOOL)
    evictions = cached.metric("render_sidecar_session_evictions_total", '{reason="entries"}')
    ours = [Stream(cached, f"evict-{i}", prompt, chat_request, lean=True) for i in range(3)]
    refs = [Stream(stateless, f"evict-ref-{i}", prompt, chat_request, lean=False) for i in range(3)]
    for lo in range(0, len(ids), 3):
        finish = "stop" if lo + 3 >= len(ids) else None
        for s in [*ours, *refs]:
            s.call(ids[lo:lo + 3], finish)
    for mine, ref in zip(ours, refs, strict=True):
        assert comparable(mine.chunks) == comparable(ref.chunks)
        assert mine.resent >= len(mine.chunks) - 2
    assert cached.metric("render_sidecar_session_evictions_total", '{reason="entries"}') > evictions
    assert cached.metric("render_sidecar_sessions") <= 2


def test_a_rolled_back_state_is_replayed_not_served_from_the_session(sidecars: dict[str, Sidecar]) -> None:
    """A call the coordinator did not commit (its chunk never reached the client) is sent again with
    the state before it: the session has moved on, so the sidecar must replay, not continue."""
    cached, stateless = sidecars["cached"], sidecars["stateless"]
    prompt, chat_request = render(cached, True)
    ids = tokens(cached, TOOL)
    mine = Stream(cached, "rollback", prompt, chat_request, lean=True)
    ref = Stream(stateless, "rollback-ref", prompt, chat_request, lean=False)
    for s in (mine, ref):
        for tok in ids[:20]:
            s.call([tok])
    before = mine.state
    mismatches = cached.metric("render_sidecar_session_misses_total", '{reason="state_mismatch"}')
    mine.call(ids[20:23])             # answered, but "never reached the client"
    mine.state = before               # so the coordinator sends the same chunk from the committed state
    mine.chunks.pop()
    for s in (mine, ref):
        run_rest = ids[20:]
        for lo in range(0, len(run_rest), 3):
            s.call(run_rest[lo:lo + 3], "stop" if lo + 3 >= len(run_rest) else None)
    assert comparable(mine.chunks) == comparable(ref.chunks)
    assert cached.metric("render_sidecar_session_misses_total", '{reason="state_mismatch"}') > mismatches


def test_sessions_are_freed_when_streams_finish_and_stay_bounded(sidecars: dict[str, Sidecar]) -> None:
    hermes = sidecars["hermes"]
    prompt, chat_request = render(hermes, True)
    ids = tokens(hermes, TOOL_ONLY)
    streams = [Stream(hermes, f"mem-{i}", prompt, chat_request, lean=True) for i in range(4)]
    for s in streams:
        for tok in ids[:10]:
            s.call([tok])
    held = hermes.metric("render_sidecar_session_resident_bytes")
    assert hermes.metric("render_sidecar_sessions") == 4 and held > 0
    for s in streams:
        s.call(ids[10:], "stop")
    assert hermes.metric("render_sidecar_sessions") == 0
    assert hermes.metric("render_sidecar_session_resident_bytes") == 0


@pytest.mark.parametrize("size", [3, 7, 32])
def test_hermes_is_chunking_invariant_and_olmo3_is_not(sidecars: dict[str, Sidecar], size: int) -> None:
    """The measurement behind the coalescing table (coordinator/pipeline/derender/features.py):
    hermes alone assembles the same tool call from calls of any size; olmo3 loses content that
    shares a call with ``</think>``, which is why its streams go one token per call."""
    hermes, cached = sidecars["hermes"], sidecars["cached"]
    prompt, chat_request = render(hermes, True)
    ids = tokens(hermes, TOOL_ONLY)
    one = assembled(run(Stream(hermes, f"inv1-{size}", prompt, chat_request, lean=True), ids, 1))
    merged = assembled(run(Stream(hermes, f"inv{size}-{size}", prompt, chat_request, lean=True), ids, size))
    assert merged == one and one["names"] == {0: "get_weather"} and one["finish"] == "tool_calls"

    prompt, chat_request = render(cached, False)
    ids = tokens(cached, REASONING)
    one = assembled(run(Stream(cached, f"olmo1-{size}", prompt, chat_request, lean=True), ids, 1))
    merged = assembled(run(Stream(cached, f"olmo{size}-{size}", prompt, chat_request, lean=True), ids, size))
    assert one["reasoning"] == THOUGHT
    if size >= 7:
        assert merged["content"] != one["content"]


def test_capabilities_say_what_the_coordinator_must_mirror(sidecars: dict[str, Sidecar]) -> None:
    caps = sidecars["cached"].http.get("/derender/capabilities").json()
    assert (caps["tool_call_parser"], caps["reasoning_parser"], caps["parsers"]) == ("hermes", "olmo3", True)
    assert caps["session_cache"]["max_entries"] == 2
    assert sidecars["stateless"].http.get("/derender/capabilities").status_code == 404  # vLLM's own
    # Calls the cache answers still go through vLLM's middleware: its request metrics count them.
    prompt, chat_request = render(sidecars["cached"], True)
    run(Stream(sidecars["cached"], "caps", prompt, chat_request, lean=True), tokens(sidecars["cached"], TOOL), 1)
    served = sidecars["cached"].metric("http_requests_total",
                                       '{handler="/v1/chat/completions/derender",method="POST",status="2xx"}')
    assert served >= sidecars["cached"].metric("render_sidecar_session_hits_total") > 0


def test_a_restarted_sidecar_replays_the_streams_it_had(sidecars: dict[str, Sidecar]) -> None:
    hermes = sidecars["hermes"]
    prompt, chat_request = render(hermes, True)
    ids = tokens(hermes, TOOL_ONLY)
    mine = Stream(hermes, "restart", prompt, chat_request, lean=True)
    for tok in ids[:15]:
        mine.call([tok])
    hermes.server.stop()
    hermes.server.start()
    hermes.server.wait_ready(timeout=600)
    run(mine, ids[15:], 1)
    assert mine.resent == 1  # one 409 after the restart, then the new session serves the rest
    ref = Stream(hermes, "restart-ref", prompt, chat_request, lean=False)
    run(ref, ids, 1)
    assert comparable(mine.chunks) == comparable(ref.chunks)


def test_a_stream_survives_its_sidecar_dying_mid_stream(sidecars: dict[str, Sidecar]) -> None:
    """Through the coordinator: a tool-call stream whose sidecar is stopped after a few chunks goes on
    on the pool's other sidecar (which replays it) and the client assembles the same answer."""
    cached, stateless = sidecars["cached"], sidecars["stateless"]
    ids = tokens(cached, TOOL)[:-1]
    body = TOOL_BODY
    with contextlib.ExitStack() as stack:
        sim = stack.enter_context(SimulatedEngine(SimConfig(mode="script", script_tokens=ids,
                                                            max_model_len=MAX_LEN, decode_s_per_token=0.05)))
        settings = make_settings(cached.url, [sim.url], render={"urls": [cached.url, stateless.url]})
        coord = stack.enter_context(CoordinatorServer(settings))
        reference = assembled(through(coord, body))
        events: list[Any] = []
        with httpx.stream("POST", f"{coord.url}/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                if len(events) == 10:
                    cached.server.stop()  # the stream's sidecar (the pool's first takes the first call)
        cached.server.start()
        cached.server.wait_ready(timeout=600)
        got = assembled(client_chunks(events))
        assert got == reference and got["names"] == {0: "get_weather"} and got["finish"] == "tool_calls"
        assert coord.wait_idle() == 0


def test_a_parser_stream_relayed_to_another_engine_gives_the_same_answer(sidecars: dict[str, Sidecar]) -> None:
    """The engine drops the stream after 7 tokens; the relay continues on the other engine (its
    prompt: the original plus the tokens sent), derendered on the same sidecar session."""
    hermes = sidecars["hermes"]
    ids = tokens(hermes, TOOL_ONLY)[:-1]
    body = TOOL_BODY
    cfg = SimConfig(mode="script", script_tokens=ids, max_model_len=MAX_LEN, decode_s_per_token=0.003)
    with SimulatedEngine(cfg) as a, SimulatedEngine(cfg) as b:
        settings = make_settings(hermes.url, [a.url, b.url], engine_client={"stream_idle_timeout_s": 1.0})
        with CoordinatorServer(settings) as coord:
            before = [a.state()["generate_calls"], b.state()["generate_calls"]]
            baseline = assembled(through(coord, body))
            victim = a if a.state()["generate_calls"] > before[0] else b
            victim.set_faults(calls=1, drop_after_tokens=7)
            hits = hermes.metric("render_sidecar_session_hits_total")
            relayed = assembled(through(coord, body))
            assert coord.components.metrics.relays._value.get() == 1
            assert relayed == baseline and baseline["names"] == {0: "get_weather"}
            assert hermes.metric("render_sidecar_session_hits_total") > hits  # the session survived the relay
            assert coord.wait_idle() == 0


@contextlib.contextmanager
def scripted_coordinator(sidecar: Sidecar, text: str) -> Iterator[CoordinatorServer]:
    """A coordinator in front of ``sidecar`` and one engine that answers ``text`` (as token ids)."""
    ids = tokens(sidecar, text)[:-1]
    with SimulatedEngine(SimConfig(mode="script", script_tokens=ids, max_model_len=MAX_LEN)) as sim, \
            CoordinatorServer(make_settings(sidecar.url, [sim.url])) as coord:
        yield coord


def test_n2_parser_stream_keeps_a_session_per_choice(sidecars: dict[str, Sidecar]) -> None:
    hermes = sidecars["hermes"]
    body = TOOL_BODY
    with scripted_coordinator(hermes, TOOL_ONLY) as coord:
        one = assembled(through(coord, body))
        misses = hermes.metric("render_sidecar_session_misses_total", '{reason="absent"}')
        both = through(coord, {**body, "n": 2, "temperature": 1.0})
        for index in (0, 1):
            chunks = [{**e, "choices": [c for c in e["choices"] if c["index"] == index]} for e in both]
            assert assembled(chunks) == one, index
        assert hermes.metric("render_sidecar_session_misses_total", '{reason="absent"}') == misses
        assert coord.wait_idle() == 0


def test_a_plain_vllm_parser_sidecar_under_a_config_that_says_nothing(sidecars: dict[str, Sidecar]) -> None:
    """vLLM's own render server, started with hermes and olmo3, and no word of parsers in the
    coordinator's config: the coordinator finds out by probing and streams the tool call."""
    stateless = sidecars["stateless"]
    body = TOOL_BODY
    with scripted_coordinator(stateless, TOOL) as coord:
        got = assembled(through(coord, body))
        assert got["reasoning"] == THOUGHT and got["names"] == {0: "get_weather"}
        assert got["finish"] == "tool_calls"
        features = coord.components.derenderer.features.current  # type: ignore[union-attr]
        assert features is not None and features.parsers and not features.session_cache
