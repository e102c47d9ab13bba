"""The client's priority reaches a real engine run with ``--scheduling-policy priority``.

The engine runs one sequence at a time (``--max-num-seqs 1``), so its own waiting queue decides who
goes next. A long request holds the engine; then a request with priority 10 arrives, then one with
priority -10 (vLLM: lower runs sooner). An engine that received the priorities runs the -10 request
first although it came second; one that did not would run them in arrival order. The coordinator's
own admission lets all three through at once (its budget is large), so the order is the engine's.

Each of the two is long enough (32 tokens) that running one before the other puts a whole run
between their last tokens; first tokens alone were a tenth of a second apart on a loaded machine,
where one stream's delivery can lag the other's by that much.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import SERVED, CoordinatorFactory, VllmStack, _echo, _ready
from tests.support import free_port

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def priority_engine(model_dir: Path, logs_dir: Path) -> Iterator[Any]:
    from token_engine.launch import VllmEngine

    engine = VllmEngine(model_dir, port=free_port(), served_model_name=SERVED, mode="tokens-only",
                        max_model_len=1024, log_path=logs_dir / "engine-priority.log", echo=_echo(),
                        name="engine-priority",
                        extra_args=["--scheduling-policy", "priority", "--max-num-seqs", "1"])
    engine.start()
    try:
        _ready(engine)
        yield engine
    finally:
        engine.stop()


def test_the_engine_runs_the_more_urgent_request_first(
        vllm_stack: VllmStack, priority_engine: Any, coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(vllm_stack.render_url, [priority_engine.url])
    first_token: dict[str, float] = {}
    last_token: dict[str, float] = {}
    errors: list[str] = []

    def ask(name: str, max_tokens: int, headers: dict[str, str], started: threading.Event | None = None) -> None:
        body = {"model": SERVED, "prompt": f"Count slowly, {name}:", "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{coord.url}/v1/completions", json=body, headers=headers,
                          timeout=300) as r:
            if r.status_code != 200:
                errors.append(f"{name}: {r.status_code} {r.read()!r}")
                return
            for line in r.iter_lines():
                if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                    first_token.setdefault(name, time.monotonic())
                    last_token[name] = time.monotonic()
                    if started is not None:
                        started.set()

    holding = threading.Event()
    threads = [threading.Thread(target=ask, args=("hold", 160, {}, holding))]
    threads[0].start()
    assert holding.wait(120), errors
    for name, priority in (("later", "10"), ("urgent", "-10")):  # the urgent one arrives second
        t = threading.Thread(target=ask, args=(name, 32, {"X-Request-Priority": priority}))
        t.start()
        threads.append(t)
        time.sleep(0.5)
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert set(first_token) == {"hold", "later", "urgent"}, first_token
    # Run one after the other, the urgent one first: it ends before the later one has even begun
    # its second half.
    assert last_token["urgent"] < last_token["later"], (first_token, last_token)
    assert last_token["urgent"] < (first_token["later"] + last_token["later"]) / 2, (first_token, last_token)
    assert coord.wait_idle() == 0
