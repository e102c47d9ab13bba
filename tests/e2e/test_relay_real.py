"""Mid-stream relay on real vLLM engines: the engine serving a stream is SIGKILLed, the client still
gets the fault-free text.

Two ``--enable-scale-out`` CPU engines of this module's own (they are killed, so not the session's;
scale-out so they can also run grammars, which the second test relays),
booted in parallel, and the session's render sidecar. A greedy chat stream is measured fault-free
first; the same request is then streamed again and, a few tokens in, the process group of the
engine serving it (API server and EngineCore) gets SIGKILL. The client must see one continuous
stream: text byte-identical to the baseline, one role delta, one finish, no error event, one
``[DONE]``, the baseline's usage, and ``coordinator_relays_total`` must count one relay. No process
of the killed engine may survive it or hold its port. The 20-run proof with restarts is
``make relay-proof`` (docs/relay.md).

A grammar-constrained stream (a JSON document held to a regex) cannot resume mid-document, so the new engine
regenerates it from the start and the tokens the client already has are checked off: the client
still gets the fault-free document, and it still parses.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from perf.relay_proof import (
    chat_body,
    relays_total,
    serving_engine,
    sigkill_engine,
    stream_chat,
    wait_engine_gone,
)
from tests.conftest import MAX_MODEL_LEN, SERVED, CoordinatorFactory, _echo
from tests.support import free_port

pytestmark = pytest.mark.e2e

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
MAX_TOKENS = 64
KILL_AFTER = 12   # output tokens the client has seen when the engine is killed
ATTEMPTS = 3


@pytest.fixture(scope="module")
def relay_engines(request: pytest.FixtureRequest, model_dir: Path, logs_dir: Path) -> Iterator[dict[str, Any]]:
    """Started before the session's render sidecar is resolved, so that all three boot in parallel."""
    from token_engine.launch import VllmEngine

    engines = [VllmEngine(model_dir, port=free_port(), served_model_name=SERVED, mode="scale-out",
                          max_model_len=MAX_MODEL_LEN, log_path=logs_dir / f"relay-{name}.log", echo=_echo(),
                          name=f"relay-{name}")
               for name in ("a", "b")]
    try:
        for e in engines:
            e.start()
        request.getfixturevalue("render_sidecar")
        for e in engines:
            e.wait_ready(timeout=600)
        yield {e.url: e for e in engines}
    finally:
        for e in engines:
            e.stop()


def test_sigkilled_engine_mid_stream_is_relayed_byte_exact(
        render_sidecar: Any, relay_engines: dict[str, Any], coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, list(relay_engines))
    body = chat_body(PROMPT, MAX_TOKENS)
    with httpx.Client(timeout=httpx.Timeout(180, connect=10)) as client:
        baseline = stream_chat(client, coord.url, body)
        assert not baseline.errors and baseline.done == 1
        assert baseline.finishes == ["length"], "the kill must land mid-stream"

        before = relays_total(coord)
        faulted, victim = _faulted(client, coord, relay_engines, body, baseline.text)

    assert faulted.kill_tokens is not None and faulted.kill_tokens < MAX_TOKENS
    assert len(victim["pids"]) >= 2, "API server and EngineCore"
    assert not faulted.errors, faulted.errors
    assert faulted.text.encode() == baseline.text.encode()
    assert faulted.roles == 1 and faulted.finishes == ["length"] and faulted.done == 1
    assert faulted.usage is not None and baseline.usage is not None
    assert faulted.usage["completion_tokens"] == baseline.usage["completion_tokens"] == MAX_TOKENS
    assert faulted.usage["prompt_tokens"] == baseline.usage["prompt_tokens"]
    assert relays_total(coord) - before == 1
    gone = wait_engine_gone(victim["engine"])
    assert gone == {"orphans": [], "port_in_use": False}
    assert coord.wait_idle() == 0


# A JSON document of bounded length (six short strings), so it always completes within max_tokens.
STEPS = r'\{"steps": \[("[A-Za-z ]{1,16}", ){5}"[A-Za-z ]{1,16}"\]\}'


def test_a_grammar_stream_is_regenerated_on_the_next_engine_and_still_parses(
        render_sidecar: Any, relay_engines: dict[str, Any], coordinator_factory: CoordinatorFactory) -> None:
    for engine in relay_engines.values():  # the previous test killed one
        if not _healthy(engine.url):
            engine.stop()
            engine.start()
            engine.wait_ready(timeout=600)
    coord = coordinator_factory(render_sidecar.url, list(relay_engines))
    body = {**chat_body("List the steps to bake bread.", 160), "structured_outputs": {"regex": STEPS}}
    with httpx.Client(timeout=httpx.Timeout(180, connect=10)) as client:
        baseline = stream_chat(client, coord.url, body)
        assert not baseline.errors and baseline.done == 1
        assert len(json.loads(baseline.text)["steps"]) == 6
        before = relays_total(coord)
        faulted, _victim = _faulted(client, coord, relay_engines, body)
    assert not faulted.errors, faulted.errors
    assert faulted.text == baseline.text
    assert json.loads(faulted.text) == json.loads(baseline.text)
    assert faulted.roles == 1 and faulted.finishes == baseline.finishes and faulted.done == 1
    assert faulted.usage is not None and faulted.usage == baseline.usage
    assert relays_total(coord) - before == 1
    assert coord.wait_idle() == 0


def _faulted(client: httpx.Client, coord: Any, engines: dict[str, Any], body: dict[str, Any],
             clean: str | None = None) -> tuple[Any, dict[str, Any]]:
    """Stream ``body`` and SIGKILL the serving engine once the client has seen ``KILL_AFTER`` tokens.
    The client reads behind the engine (derender, a loaded CI box): when the engine has finished
    before the client saw them, nothing is left to kill, so it streams again (each such run must
    equal ``clean``, the fault-free text, when given)."""
    victim: dict[str, Any] = {}

    def kill() -> None:
        try:
            url = serving_engine(coord, timeout=0.5)
        except RuntimeError:
            return   # the engine already sent its last token: this run's kill would not land mid-stream
        victim["engine"] = engines[url]
        victim["pids"] = sigkill_engine(engines[url])

    for _attempt in range(ATTEMPTS):
        faulted = stream_chat(client, coord.url, body, kill_after=KILL_AFTER, kill=kill)
        if victim:
            return faulted, victim
        assert clean is None or (not faulted.errors and faulted.text == clean)
    raise AssertionError(f"the engine finished before the client saw {KILL_AFTER} tokens in {ATTEMPTS} runs")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
