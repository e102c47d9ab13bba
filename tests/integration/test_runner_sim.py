"""The door-agnostic request runner (``Pipeline.serve``) and ``Components.start/aclose`` without FastAPI:
what a second front door (NNRP) or an embedding application relies on."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from coordinator.app import build_components
from coordinator.pipeline.errors import BadRequest, ClientGone
from tests.conftest import SERVED, make_settings
from token_engine.simulator import SimConfig, SimulatedEngine


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 12, "temperature": 0, **extra}


def test_serve_answers_streams_and_releases_outside_any_web_framework(render_sidecar: Any) -> None:
    with SimulatedEngine(SimConfig(model=SERVED, decode_s_per_token=0.05)) as sim:
        async def main() -> None:
            c = build_components(make_settings(render_sidecar.url, [sim.url]))
            await c.start()
            try:
                p = c.pipeline
                served = await p.serve("chat", chat(), "runner-1")
                assert served.stream is None and served.response is not None
                assert served.response["id"] == "chatcmpl-runner-1" and p.inflight == 0

                served = await p.serve("chat", chat(stream=True), "runner-2")
                assert served.stream is not None and p.inflight == 1
                chunks = [c async for c in served.stream.events()]
                assert chunks[-1]["choices"][0]["finish_reason"] == "length"
                await served.aclose()
                await served.aclose()  # idempotent
                assert p.inflight == 0 and p.derender.open_sessions == 0

                with pytest.raises(BadRequest):
                    await p.serve("chat", {"model": "gpt-4o-mini", "messages": []}, "runner-3")
                assert p.inflight == 0

                # The client leaves while the answer is being generated: ClientGone, nothing held.
                async def gone() -> None:
                    await asyncio.sleep(0.2)

                with pytest.raises(ClientGone):
                    await p.serve("chat", chat(max_tokens=200), "runner-4", gone=gone)
                assert p.inflight == 0 and c.ledger.global_inflight == 0
                for _ in range(100):
                    if any("runner-4" in i for i in sim.state()["aborted"]):
                        break
                    await asyncio.sleep(0.05)
                assert any("runner-4" in i for i in sim.state()["aborted"])

                # The door's priority applies only when the body has none.
                served = await p.serve("chat", chat(), "runner-5", priority=-2)
                assert served.ctx.priority == -2
                served = await p.serve("chat", chat(priority=3), "runner-6", priority=-2)
                assert served.ctx.priority == 3
            finally:
                await c.aclose()

        asyncio.run(main())
