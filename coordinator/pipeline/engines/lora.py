"""Loading LoRA adapters onto engines on demand: one load in flight per adapter and engine, room made
by unloading the least recently used idle adapter, pins kept loaded.

The engine's side is vLLM's runtime adapter API (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``):
``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` answers 200 once the weights are read (it
validates them and warms the engine's LoRA cache), 400 when the name is registered already, 404 when
the path holds no adapter, 500 for an adapter the engine cannot take (a rank above ``--max-lora-rank``,
a bad file), with the engine alive; ``POST /v1/unload_lora_adapter {"lora_name"}`` forgets the name
(404 when unknown). An engine started without the variable has neither route (a bare 404).

A request waits for its load (``lora.load_timeout_s`` at most); the load runs in a task of its own, so
a client that leaves does not cancel it for the requests that joined it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

import httpx

from coordinator.config import LoraSettings
from coordinator.observability.metrics import Metrics
from coordinator.pipeline.engines.adapters import Adapter
from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.errors import EngineBusy

log = logging.getLogger(__name__)


class AdapterLoadFailed(EngineBusy):
    """An engine did not load an adapter. Retryable on another engine (an ``EngineBusy``: the engine
    is alive); when none is left, the client gets it: 400 when the engine refused the adapter itself
    (vLLM answers a resolver-loaded adapter that will not load so), 503 when it could not be asked."""

    def __init__(self, adapter: str, engine: str, reason: str, *, refused: bool) -> None:
        status = 400 if refused else 503
        message = f"LoRA adapter '{adapter}' could not be loaded on engine {engine}: {reason}"
        etype = "BadRequestError" if refused else "ServiceUnavailableError"
        super().__init__(status, {"error": {"message": message, "type": etype, "param": "model"}}, message)
        self.refused = refused
        self.engine_status: int | None = None


def _reason(resp: httpx.Response) -> str:
    with contextlib.suppress(ValueError):
        data: Any = resp.json()
        if isinstance(data, dict):
            err = data.get("error")
            if isinstance(err, dict) and err.get("message"):
                return str(err["message"])
            if data.get("message"):
                return str(data["message"])
            if data.get("detail"):
                return str(data["detail"])
    return resp.text[:300] or f"HTTP {resp.status_code}"


def _route_missing(resp: httpx.Response) -> bool:
    """FastAPI's own 404 (no such route), not vLLM's error body for an unknown adapter."""
    with contextlib.suppress(ValueError):
        data = resp.json()
        return isinstance(data, dict) and data.get("detail") == "Not Found" and "error" not in data
    return False


class AdapterLoader:
    """Makes an engine hold an adapter before a request for it is sent there."""

    def __init__(self, http: httpx.AsyncClient, settings: LoraSettings,
                 metrics: Metrics | None = None) -> None:
        self._http = http
        self._settings = settings
        self._metrics = metrics
        self._tasks: set[asyncio.Task[None]] = set()   # loads in flight (per engine: Residency.loading)
        self._configured: set[tuple[str, str]] = set()   # (engine, adapter) config pins applied

    # -- requests ---------------------------------------------------------------------------------
    async def ensure(self, engine: Engine, adapter: Adapter) -> None:
        """Return once ``engine`` holds ``adapter`` (loading it, or joining the load in flight);
        raises ``AdapterLoadFailed``."""
        res = engine.adapters
        if res.holds(adapter.name):
            res.touch(adapter.name)
            self._placed("held")
            return
        task = res.loading.get(adapter.name)
        self._placed("joined" if task is not None else "loaded")
        if task is None:
            task = self._start(engine, adapter)
        try:
            await asyncio.wait_for(asyncio.shield(task), self._settings.load_timeout_s)
        except TimeoutError:
            waited = f"no answer within {self._settings.load_timeout_s:g}s"
            raise AdapterLoadFailed(adapter.name, engine.url, waited, refused=False) from None

    def _placed(self, residency: str) -> None:
        if self._metrics is not None:
            self._metrics.lora_placements.labels(residency).inc()

    def _start(self, engine: Engine, adapter: Adapter) -> asyncio.Future[None]:
        async def run() -> None:
            # Load first, then make room: a load that fails (a bad adapter, a busy engine) must not
            # have cost the engine an adapter (vLLM's unload only forgets a name, so holding one more
            # for a moment costs nothing).
            try:
                await self.load(engine, adapter)
            finally:
                engine.adapters.loading.pop(adapter.name, None)
            await self._make_room(engine, adapter.name)

        task = asyncio.create_task(run(), name=f"lora-load {adapter.name}")
        engine.adapters.loading[adapter.name] = task  # before it runs: one load per adapter and engine
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # no "never retrieved" noise
        return task

    async def _make_room(self, engine: Engine, name: str) -> None:
        """Unload least recently used idle adapters while ``engine`` holds more than it may (never
        ``name``, just loaded, a pinned one, one with requests running or one being loaded); when none
        may go, the engine is left over its size (vLLM then defers requests beyond ``--max-loras`` in
        its own queue). An unload that fails is logged and left: the next load tries again."""
        res = engine.adapters
        while len(res.held) + len(res.loading) > res.capacity:
            victim = res.evictable(keep=name)
            if victim is None:
                log.info("engine %s holds %d adapters (room for %d) and none is idle: loading %s beyond it",
                         engine.url, len(res.held), res.capacity, name)
                return
            try:
                await self.unload(engine, victim)
            except AdapterLoadFailed as exc:
                log.warning("engine %s: could not unload idle adapter %s: %s", engine.url, victim,
                            exc.message)
                return
            if self._metrics is not None:
                self._metrics.lora_evictions.labels(engine.url).inc()
            log.info("engine %s: unloaded idle adapter %s to load %s", engine.url, victim, name)

    # -- engine calls (also the operator's, through /admin) ----------------------------------------
    async def load(self, engine: Engine, adapter: Adapter) -> None:
        """``POST /v1/load_lora_adapter``; raises ``AdapterLoadFailed``."""
        started = time.monotonic()
        body = {"lora_name": adapter.name, "lora_path": adapter.path}
        try:
            resp = await self._http.post(f"{engine.url}/v1/load_lora_adapter", json=body,
                                         headers=engine.credentials(), timeout=self._settings.load_timeout_s)
        except httpx.HTTPError as exc:
            self._count(engine, "unreachable")
            raise AdapterLoadFailed(adapter.name, engine.url, f"{type(exc).__name__} {exc}".strip(),
                                    refused=False) from exc
        reason = "" if resp.status_code == 200 else _reason(resp)
        if resp.status_code == 200 or (resp.status_code == 400 and "already been loaded" in reason):
            engine.adapters.loaded(adapter.name)
            self._count(engine, "loaded")
            if self._metrics is not None:
                self._metrics.lora_load_seconds.observe(time.monotonic() - started)
            log.info("engine %s loaded adapter %s from %s in %.3fs", engine.url, adapter.name, adapter.path,
                     time.monotonic() - started)
            return
        if _route_missing(resp):
            reason = "the engine does not load adapters at run time"
            log.warning("engine %s has no /v1/load_lora_adapter: start it with --enable-lora and "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True to load adapters on demand", engine.url)
        # Not the adapter's fault: a busy engine, or one that cannot load adapters at all.
        busy = resp.status_code in (408, 425, 429, 502, 503, 504) or _route_missing(resp)
        self._count(engine, "busy" if busy else "refused")
        log.warning("engine %s did not load adapter %s (HTTP %d): %s", engine.url, adapter.name,
                    resp.status_code, reason)
        error = AdapterLoadFailed(adapter.name, engine.url, reason, refused=not busy)
        error.engine_status = resp.status_code
        raise error

    async def unload(self, engine: Engine, name: str) -> None:
        """``POST /v1/unload_lora_adapter``; an engine that does not know the name holds it no more
        either. Raises ``AdapterLoadFailed`` (refused=False) when the engine could not be asked."""
        try:
            resp = await self._http.post(f"{engine.url}/v1/unload_lora_adapter", json={"lora_name": name},
                                         headers=engine.credentials(), timeout=self._settings.load_timeout_s)
        except httpx.HTTPError as exc:
            raise AdapterLoadFailed(name, engine.url, f"unload failed: {type(exc).__name__}",
                                    refused=False) from exc
        if resp.status_code not in (200, 404):
            raise AdapterLoadFailed(name, engine.url, f"unload failed: {_reason(resp)}", refused=False)
        engine.adapters.unloaded(name)

    def _count(self, engine: Engine, result: str) -> None:
        if self._metrics is not None:
            self._metrics.lora_loads.labels(engine.url, result).inc()

    # -- pins -------------------------------------------------------------------------------------
    def keep_pins(self, engines: Iterable[Engine], adapters: Iterable[Adapter]) -> None:
        """Start a load of every adapter pinned on a healthy engine that does not hold it (at start-up,
        and after each probe round: a restarted engine holds nothing). The configuration's pins apply
        once per engine; from then on the engine's pin set is the truth (``/admin`` may change it)."""
        by_name = {a.name: a for a in adapters}
        for engine in engines:
            for adapter in by_name.values():
                if engine.url in {u.rstrip("/") for u in adapter.pinned} \
                        and (engine.url, adapter.name) not in self._configured:
                    self._configured.add((engine.url, adapter.name))
                    engine.adapters.pinned.add(adapter.name)
            if not engine.healthy:
                continue
            for name in engine.adapters.pinned:
                found = by_name.get(name)
                if found is None or engine.adapters.holds(name) or engine.adapters.is_loading(name):
                    continue
                self._start(engine, found)

    def export_metrics(self, engines: Iterable[Engine]) -> None:
        if self._metrics is None:
            return
        self._metrics.lora_resident.clear()
        for e in engines:
            if e.adapters.held:
                self._metrics.lora_resident.labels(e.url).set(len(e.adapters.held))

    async def aclose(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
