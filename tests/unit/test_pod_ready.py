"""The pod's /ready from its workers' (coordinator/runtime/pod.py), over the workers' real private
sockets: a sibling that already drains makes the whole pod drain, even while the worker that answers
has not yet received its own signal (the supervisor passes SIGTERM on to one worker after another)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI

from coordinator.runtime.pod import Pod, PrivateServer


def sibling(ready: bool, draining: bool) -> FastAPI:
    app = FastAPI()

    async def ready_here() -> tuple[bool, dict[str, Any]]:
        return ready, {"ready": ready, "draining": draining}

    app.state.ready_here = ready_here
    app.state.metrics_here = lambda: b""
    return app


async def answer(tmp_path: Path, *, mine: bool, theirs: tuple[bool, bool]) -> tuple[bool, dict[str, Any]]:
    pod = Pod(0, 2, str(tmp_path))
    server = PrivateServer(sibling(*theirs), pod.socket_path(1))
    await server.start()
    try:
        return await pod.ready(mine, {"ready": mine, "draining": not mine})
    finally:
        await pod.aclose()
        await server.stop()


async def test_a_draining_sibling_makes_the_pod_drain(tmp_path: Path) -> None:
    ok, body = await answer(tmp_path, mine=True, theirs=(False, True))
    assert not ok and body["draining"] is True and body["workers"] == {"0": True, "1": False}


async def test_the_pod_is_ready_when_every_worker_is(tmp_path: Path) -> None:
    ok, body = await answer(tmp_path, mine=True, theirs=(True, False))
    assert ok and body["draining"] is False and body["workers"] == {"0": True, "1": True}


async def test_a_sibling_not_ready_for_another_reason_is_not_draining(tmp_path: Path) -> None:
    ok, body = await answer(tmp_path, mine=True, theirs=(False, False))
    assert not ok and body["draining"] is False


async def test_a_silent_sibling_is_not_ready_and_says_nothing_of_draining(tmp_path: Path) -> None:
    pod = Pod(0, 2, str(tmp_path), timeout_s=0.5)
    try:
        ok, body = await pod.ready(True, {"ready": True, "draining": False})
    finally:
        await pod.aclose()
    assert not ok and body["draining"] is False and body["workers"]["1"] is False
