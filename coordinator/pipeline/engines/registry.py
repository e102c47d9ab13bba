"""Engines from config, their health, and what each one has in flight."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import httpx

from coordinator.config import EngineRole, EngineSettings

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Engine:
    url: str
    role: EngineRole
    model: str | None
    weight: float
    healthy: bool = True          # optimistic until the first probe says otherwise
    inflight_requests: int = 0
    inflight_tokens: int = 0

    def serves(self, model: str) -> bool:
        return self.model is None or self.model == model


class EngineRegistry:
    """Holds the engine list; a background task probes ``GET /health`` of each engine."""

    def __init__(self, engines: list[EngineSettings], http: httpx.AsyncClient, interval_s: float) -> None:
        self.engines = [Engine(e.url.rstrip("/"), e.role, e.model, e.weight) for e in engines]
        self._http = http
        self._interval = interval_s
        self._task: asyncio.Task[None] | None = None

    def candidates(self, model: str, role: EngineRole = "union") -> list[Engine]:
        return [e for e in self.engines if e.healthy and e.role == role and e.serves(model)]

    def any_healthy(self) -> bool:
        return any(e.healthy for e in self.engines)

    async def probe_once(self) -> None:
        await asyncio.gather(*(self._probe(e) for e in self.engines))

    async def _probe(self, engine: Engine) -> None:
        try:
            ok = (await self._http.get(f"{engine.url}/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok != engine.healthy:
            log.warning("engine %s is now %s", engine.url, "healthy" if ok else "unhealthy")
        engine.healthy = ok

    def mark_failed(self, engine: Engine) -> None:
        """A connection failure takes the engine out of rotation until the next good probe."""
        engine.healthy = False

    async def start(self) -> None:
        await self.probe_once()
        self._task = asyncio.create_task(self._loop(), name="engine-health")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.probe_once()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
