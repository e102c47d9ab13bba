"""Chunk-size invariance of the streaming path, on the real render sidecar.

The same deterministic engine output (the simulated engine echoes the prompt, with zero decode
cost so chunks pile up while derender runs) is streamed as engine chunks of 1, 3, 7 and 64 tokens
(vLLM's ``--stream-interval``) through a coordinator that coalesces chunks into calls of up to 64
tokens. Every variant must give what one derender call per token gives (the reference: chunks of
1, coalescing off): identical text per choice, finish and stop reasons, usage and logprob tokens,
for stop strings (hold-back, earliest match, ``min_tokens``, ``include_stop_str_in_output``), stop
token ids, ``n=2``, multi-prompt completions and logprobs; every case asks for ``include_usage``, so
a stop string found inside a merged call must still count exactly the tokens up to it. The parser case
(tool calls and reasoning) is in test_parsers.py.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from tests.conftest import SERVED, make_settings
from tests.support import CoordinatorServer, sse_events
from token_engine.simulator import SimConfig, SimulatedEngine

SIZES = (1, 3, 7, 64)
TEXT = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
        "upsilon phi chi psi omega")


@pytest.fixture(scope="module")
def coordinators(render_sidecar: Any) -> Iterator[dict[str, CoordinatorServer]]:
    """``ref``: one call per engine token; ``1``…``64``: engine chunks of that size, coalesced."""
    with ExitStack() as stack:
        out: dict[str, CoordinatorServer] = {}
        for name, size, coalesce in [("ref", 1, False), *((str(k), k, True) for k in SIZES)]:
            sim = stack.enter_context(SimulatedEngine(SimConfig(model=SERVED, stream_interval=size, seed=0)))
            settings = make_settings(render_sidecar.url, [sim.url],
                                     stream={"coalesce": coalesce, "max_tokens_per_call": 64})
            out[name] = stack.enter_context(CoordinatorServer(settings))
        yield out


def assemble(events: list[Any], kind: str) -> dict[str, Any]:
    """What a client assembles from a stream: text, finish/stop reason and logprob tokens per choice."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for ev in events:
        if not isinstance(ev, dict):
            continue
        assert "error" not in ev, ev
        usage = ev.get("usage") or usage
        for ch in ev["choices"]:
            c = choices.setdefault(ch["index"], {"text": "", "finish": None, "stop": None, "lp": []})
            c["text"] += ((ch.get("delta") or {}).get("content") if kind == "chat" else ch.get("text")) or ""
            if ch.get("finish_reason") is not None:
                assert c["finish"] is None, "finish_reason sent twice"
                c["finish"], c["stop"] = ch["finish_reason"], ch.get("stop_reason")
            lp = ch.get("logprobs")
            if lp:
                c["lp"] += [e["token"] for e in lp["content"]] if kind == "chat" else list(lp["tokens"])
    return {"choices": choices, "usage": usage}


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "plain": ("chat", {"max_tokens": 60}),
    "stop-string": ("chat", {"max_tokens": 80, "stop": ["kappa", "omega"]}),
    "stop-earliest-and-holdback": ("chat", {"max_tokens": 80, "stop": ["lambda mu", "eta"]}),
    "stop-with-min-tokens": ("chat", {"max_tokens": 80, "stop": ["beta", "iota"], "min_tokens": 20}),
    "stop-included": ("completion", {"max_tokens": 80, "stop": [" theta"], "include_stop_str_in_output": True}),
    "stop-token-ids": ("chat", {"max_tokens": 80, "stop_token_ids": [12565]}),  # " lambda"
    "n2-logprobs": ("chat", {"max_tokens": 40, "n": 2, "logprobs": True, "top_logprobs": 2}),
    "multi-prompt-logprobs": ("completion", {"max_tokens": 30, "logprobs": 2,
                                             "prompt": ["one two three four", "five six seven", TEXT]}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_streams_are_identical_for_every_chunk_size(coordinators: dict[str, CoordinatorServer], case: str) -> None:
    kind, extra = CASES[case]
    if kind == "chat":
        body: dict[str, Any] = {"model": SERVED, "messages": [{"role": "user", "content": TEXT}], **extra}
        path = "/v1/chat/completions"
    else:
        body = {"model": SERVED, "prompt": TEXT, **extra}
        path = "/v1/completions"
    body = {**body, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    results = {}
    for name, coord in coordinators.items():
        r = httpx.post(f"{coord.url}{path}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        results[name] = assemble(sse_events(r), kind)
    ref = results.pop("ref")
    assert ref["choices"] and all(c["text"] and c["finish"] for c in ref["choices"].values())
    if "stop" in extra or "stop_token_ids" in extra:
        assert all(c["finish"] == "stop" for c in ref["choices"].values()), ref  # the case does stop
        assert ref["usage"]["completion_tokens"] < extra["max_tokens"]
    for name, got in results.items():
        assert got == ref, f"engine chunks of {name} tokens differ from one call per token"
    for coord in coordinators.values():
        assert coord.wait_idle() == 0


def test_a_slow_reader_keeps_coordinator_buffers_bounded(render_sidecar: Any) -> None:
    """A client that stops reading a long, fast stream: the coordinator holds at most
    ``stream.buffer_tokens`` engine tokens (the rest waits in the engine's socket), and the whole
    answer still arrives once the client reads again. The answer (4 choices x 1,900 tokens with
    logprobs) is far larger than what the sockets between engine, coordinator and client can hold,
    so the stall must reach the coordinator's buffers."""
    with ExitStack() as stack:
        sim = stack.enter_context(SimulatedEngine(SimConfig(model=SERVED)))
        settings = make_settings(render_sidecar.url, [sim.url],
                                 stream={"buffer_tokens": 64, "max_tokens_per_call": 16, "queue_chunks": 4})
        coord = stack.enter_context(CoordinatorServer(settings))
        body = json.dumps({"model": SERVED, "prompt": "hi", "max_tokens": 1900, "ignore_eos": True, "n": 4,
                           "logprobs": 5, "stream": True, "stream_options": {"include_usage": True}}).encode()
        seen: list[float] = []
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a slow client on a small window
            s.settimeout(120)
            s.connect(("127.0.0.1", coord.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n%s" % (len(body), body))
            received = s.recv(4096)
            for _ in range(40):  # the client stalls; sample what the coordinator holds meanwhile
                time.sleep(0.05)
                seen.append(_sample(coord))
            while chunk := s.recv(1 << 16):
                received += chunk
                if received.endswith(b"data: [DONE]\n\n0\r\n\r\n") or b"data: [DONE]" in received[-64:]:
                    break
        assert max(seen) <= 64, seen
        assert max(seen) > 0, "the buffer was never used: the stall did not reach the coordinator"
        assert b'"completion_tokens":7600' in received
        assert coord.wait_idle() == 0


def _sample(coord: CoordinatorServer) -> float:
    return float(coord.components.metrics.registry.get_sample_value("coordinator_stream_buffered_tokens") or 0)
