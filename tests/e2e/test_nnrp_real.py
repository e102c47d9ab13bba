"""The NNRP door on real vLLM: conformance recipes and a multiplexed session with cancellations.

The conformance run needs every recipe selected (Levels 1 to 3), tool-call deltas included, so its
coordinator uses a render sidecar with the ``hermes`` tool parser (SmolLM2-135M answers the tool
recipe's few-shot prompt with ``<tool_call>{...}</tool_call>`` greedily, see test_wire_shape.py);
the generating engine is the session's real ``--tokens-only`` engine in both tests.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from typing import Any

import httpx
import pytest

from coordinator.nnrp.client import NnrpClient
from tests.conftest import CoordinatorFactory, ToolStack, VllmStack
from tests.support import CoordinatorServer, wait_until

pytestmark = pytest.mark.e2e

KEY = "sk-nnrp-real"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tool_render(tool_stack: ToolStack) -> Any:
    return tool_stack.render


def ws_url(coord: CoordinatorServer) -> str:
    return coord.url.replace("http://", "ws://") + "/nnrp/v1"


def test_conformance_runner_passes_every_recipe(vllm_stack: VllmStack, tool_render: Any,
                                                coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(str(tool_render.url), [vllm_stack.engine.url],
                                render={"url": str(tool_render.url), "parsers": True},
                                server={"api_keys": [KEY]})
    manifest = httpx.get(f"{coord.url}/nnrp/v1/capabilities", headers=AUTH, timeout=30).json()
    assert manifest["operations"][0]["tool_calls"] is True  # so the tool-call recipe is selected
    # The CLI as a user runs it; --model left out: the runner takes the first of GET /v1/models.
    proc = subprocess.run([sys.executable, "-m", "coordinator.nnrp.conformance", "--url", ws_url(coord),
                           "--api-key", KEY], capture_output=True, text=True, timeout=900)
    out = proc.stdout
    print(out)  # the table, for -s and for failure reports
    assert out.rstrip("\n").splitlines()[-1] == "14 passed, 0 failed", out + proc.stderr
    assert proc.returncode == 0, out + proc.stderr
    assert " skip " not in out and " FAIL " not in out, out
    assert coord.wait_idle() == 0


def engine_running(stack: VllmStack) -> float:
    text = httpx.get(f"{stack.engine.url}/metrics", timeout=30).text
    values = [float(m.group(1)) for m in re.finditer(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M)]
    assert values, "the engine exports no vllm:num_requests_running"
    return sum(values)


def body(i: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "messages": [{"role": "user", "content": f"Tell me a short story about the number {i}."}], **extra}


def http_greedy_text(coord: CoordinatorServer, b: dict[str, Any]) -> str:
    plain = {**b, "stream": False}
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=plain, headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


async def test_eight_operations_three_cancelled_on_the_real_engine(
        vllm_stack: VllmStack, coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(vllm_stack.render_url, [vllm_stack.engine.url], server={"api_keys": [KEY]})
    proc = vllm_stack.engine.process
    mark = proc.line_count()
    cancel = {1, 4, 6}
    # The cancelled ones would run far longer than the test waits; the others end at max_tokens or EOS.
    bodies = [body(i, 600, ignore_eos=True) if i in cancel else body(i, 48) for i in range(8)]
    async with await NnrpClient.connect(ws_url(coord), api_key=KEY) as client:
        ops = [await client.chat(bodies[i], op_id=f"op-{i}", policy={"diagnostics": "summary"})
               for i in range(8)]

        async def drive(i: int) -> list[dict[str, Any]]:
            events = []
            async for ev in ops[i]:
                events.append(ev)
                if i in cancel and len(events) == 4:
                    await ops[i].cancel(f"test cancels {i}")
            return events

        results = await asyncio.wait_for(asyncio.gather(*(drive(i) for i in range(8))), 600)
        await asyncio.sleep(0.5)  # anything sent after a terminal event would have arrived by now
        assert await asyncio.to_thread(wait_until, lambda: all(op.diagnostics for op in ops), 10)
        request_ids = {i: op.diagnostics[0]["record"]["request_id"] for i, op in enumerate(ops)}
    for i, op in enumerate(ops):
        seqs = [f["seq"] for f in op.results]
        assert seqs == list(range(len(seqs))), (i, seqs)
        kinds = [e["type"] for e in results[i]]
        terminal = "response.cancelled" if i in cancel else "response.completed"
        assert kinds[-1] == terminal and kinds.count(terminal) == 1, (i, kinds)
        assert sum(k in ("response.completed", "response.error", "response.cancelled") for k in kinds) == 1
        if i in cancel:
            diag = results[i][-1]["diagnostics"]
            assert diag["source"] == "client" and diag["reason"] == f"test cancels {i}", diag
            assert diag["operation_id"] == f"op-{i}"
    # Engine side: each cancelled operation's request was aborted at the real engine, and nothing runs.
    for i in sorted(cancel):
        pattern = rf"Aborted request\(s\) .*chatcmpl-{re.escape(request_ids[i])}(?![0-9])"
        line = await asyncio.to_thread(proc.wait_for_line, pattern, 10.0, mark)
        assert line is not None, f"no engine abort for op-{i} ({request_ids[i]}):\n{proc.tail()}"
    assert await asyncio.to_thread(wait_until, lambda: engine_running(vllm_stack) == 0, 30)
    assert await asyncio.to_thread(coord.wait_idle, 10) == 0
    # The five that completed carry exactly the HTTP door's greedy text for the same request.
    for i in sorted(set(range(8)) - cancel):
        streamed = "".join(e["delta"] for e in results[i] if e["type"] == "response.output_text.delta")
        assert streamed, i
        assert streamed == await asyncio.to_thread(http_greedy_text, coord, bodies[i]), i
