"""``server.workers: N``: N coordinator processes serving one port, each on its own event loop.

One process is one event loop, so about one core (docs/operations.md, "Sizing workers"). With
``workers > 1``, ``python -m coordinator`` becomes a supervisor, as uvicorn's ``--workers`` does:

* The supervisor binds the listening socket once (``--port 0`` works, no two binds race) and starts N
  worker processes (spawn) that all accept on that one socket; each runs the single-process server
  (``build_app`` + ``draining_server``) unchanged.
* SIGTERM/SIGINT are forwarded, so every worker runs its own drain (docs/shutdown.md); the supervisor
  closes its copy of the socket at once, so the port stops accepting when the last worker closes its
  listener; it exits 0 once every worker did. A second signal is forwarded too (workers exit at once)
  and the supervisor then dies of it, as a single process does.
* A worker that dies while nothing is draining is started again (``coordinator_worker_restarts``).

What a client sees must not depend on which worker accepted its connection, so ``/ready`` and
``/metrics`` answer for the pod: each worker also serves its own on a private unix socket, and the
worker a client reached asks its siblings there and merges (``Pod``). Budgets: with the local fleet
backend each worker admits against 1/N of every budget (``app.build_fleet``); with Redis each
worker is one more fleet process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_sentinels
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from coordinator.api.server import QuietServer, configure_logging, uvicorn_config
from coordinator.api.shutdown import draining_server
from coordinator.config import Settings

log = logging.getLogger(__name__)

_SUMMED = frozenset({"counter", "histogram", "summary", "gaugehistogram"})
_RESTART_BACKOFF_S = (0.5, 30.0)  # first and longest wait before starting a worker that died young
_YOUNG_S = 10.0  # a worker that dies sooner than this after its start is restarted with backoff
_PARENT_POLL_S = 0.5


# -- merging the workers' /metrics ------------------------------------------------------------------

class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def merge_metrics(texts: Mapping[int, str | None]) -> bytes:
    """One exposition for the pod from each worker's (None: the worker did not answer).

    As prometheus_client's multiprocess mode: counters, histograms and summaries are summed over the
    workers by (sample name, labels); gauges keep one sample per worker with a ``worker`` label. A
    ``<family>_created`` timestamp of a summed family keeps the earliest. ``coordinator_worker_up``
    says which workers answered."""
    families: dict[str, Metric] = {}
    summed: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for index, text in sorted(texts.items()):
        if text is None:
            continue
        for fam in text_string_to_metric_families(text):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            if fam.type in _SUMMED:
                acc = summed.setdefault(fam.name, {})
                for s in fam.samples:
                    key = (s.name, tuple(s.labels.items()))
                    acc[key] = acc.get(key, 0.0) + s.value
            else:
                for s in fam.samples:
                    merged.samples.append(Sample(s.name, {**s.labels, "worker": str(index)}, s.value))
    for name, acc in summed.items():
        families[name].samples = [Sample(n, dict(labels), v) for (n, labels), v in acc.items()]
    for name in list(families):
        base = name.removesuffix("_created")
        if base != name and families.get(base) is not None and families[base].type in _SUMMED:
            earliest: dict[tuple[tuple[str, str], ...], Sample] = {}
            for s in families[name].samples:
                labels = {k: v for k, v in s.labels.items() if k != "worker"}
                series = tuple(labels.items())
                if series not in earliest or s.value < earliest[series].value:
                    earliest[series] = Sample(s.name, labels, s.value)
            families[name].samples = list(earliest.values())
    up = Metric("coordinator_worker_up", "1 for each worker process of this pod that answered this scrape",
                "gauge")
    for index, text in sorted(texts.items()):
        up.add_sample("coordinator_worker_up", {"worker": str(index)}, 0.0 if text is None else 1.0)
    families[up.name] = up
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


# -- one worker's view of the pod -------------------------------------------------------------------

class Pod:
    """What a worker needs to answer for the pod: its index, and its siblings over unix sockets."""

    def __init__(self, index: int, count: int, socket_dir: str, timeout_s: float = 1.0) -> None:
        self.index = index
        self.count = count
        self.socket_dir = socket_dir
        self.timeout_s = timeout_s
        self._clients: dict[int, httpx.AsyncClient] = {}

    def socket_path(self, index: int) -> str:
        return os.path.join(self.socket_dir, f"worker-{index}.sock")

    @property
    def siblings(self) -> list[int]:
        return [i for i in range(self.count) if i != self.index]

    async def _ask(self, index: int, path: str) -> httpx.Response | None:
        """A sibling's answer on its private socket; None when it does not answer in time (dead,
        restarting, or too busy: for /ready that counts as not ready)."""
        client = self._clients.get(index)
        if client is None:
            client = self._clients[index] = httpx.AsyncClient(
                transport=httpx.AsyncHTTPTransport(uds=self.socket_path(index)), base_url="http://worker",
                timeout=self.timeout_s)
        try:
            return await client.get(path)
        except httpx.HTTPError as exc:
            log.debug("worker %d did not answer %s: %r", index, path, exc)
            return None

    async def ready(self, ok: bool, body: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        """Ready when every worker is: this worker's body with each worker's readiness added."""
        answers = await asyncio.gather(*(self._ask(i, "/ready") for i in self.siblings))
        workers = {self.index: ok}
        for i, r in zip(self.siblings, answers, strict=True):
            workers[i] = r is not None and r.status_code == 200 and bool(_json(r).get("ready"))
        pod_ok = all(workers.values())
        return pod_ok, {**body, "ready": pod_ok, "workers": {str(i): workers[i] for i in sorted(workers)}}

    async def metrics(self, own: bytes) -> bytes:
        answers = await asyncio.gather(*(self._ask(i, "/metrics") for i in self.siblings))
        texts: dict[int, str | None] = {self.index: own.decode()}
        for i, r in zip(self.siblings, answers, strict=True):
            texts[i] = r.text if r is not None and r.status_code == 200 else None
        return merge_metrics(texts)

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()


def _json(r: httpx.Response) -> dict[str, Any]:
    try:
        body = r.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


class PrivateServer:
    """This worker's own /ready and /metrics on its unix socket, for its siblings to merge."""

    def __init__(self, app: FastAPI, path: str) -> None:
        async def ready(request: Request) -> Response:
            ok, body = await app.state.ready_here()
            return JSONResponse(body, status_code=200 if ok else 503)

        async def metrics(request: Request) -> Response:
            return Response(app.state.metrics_here(), media_type="text/plain; version=0.0.4")

        private = Starlette(routes=[Route("/ready", ready), Route("/metrics", metrics)])
        config = uvicorn.Config(private, uds=path, lifespan="off", access_log=False, log_level="warning")
        self._server = QuietServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(), name="worker-private")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the worker's private server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


# -- the worker process -----------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process is started with (pickled into the spawned child)."""

    index: int
    count: int
    restarts: int  # how often this worker's slot was started again so far
    settings: Settings
    host: str
    port: int
    socket_dir: str
    parent_pid: int


def _watch_parent(parent_pid: int) -> None:
    """A worker whose supervisor is gone (SIGKILLed) drains and exits instead of living on alone."""
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_S)
    log.warning("the supervisor (pid %d) is gone: draining", parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)


def _worker_gauges(app: FastAPI, spec: WorkerSpec) -> None:
    """Per-worker gauges (the pod's /metrics labels them with ``worker``)."""
    from coordinator.app import Components

    c: Components = app.state.components
    registry = c.metrics.registry
    restarts = Gauge("coordinator_worker_restarts", "Times this worker process was started again after it "
                     "died while the pod was not shutting down", registry=registry)
    restarts.set(spec.restarts)
    requests = Gauge("coordinator_worker_requests", "Client requests this worker process ended since it "
                     "started (coordinator_requests_total is the pod's sum)", registry=registry)
    counter = c.metrics.requests

    def ended() -> float:
        return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))

    requests.set_function(ended)


def worker_main(spec: WorkerSpec, sock: socket.socket) -> None:
    """A worker's process: today's single-process server on the shared socket, plus its private one."""
    os.setpgrp()  # signals come from the supervisor only (a terminal's Ctrl-C reaches the group)
    configure_logging(spec.settings, worker=spec.index)
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), name="watch-supervisor",
                     daemon=True).start()
    from coordinator.app import build_app

    settings = spec.settings
    app = build_app(settings)
    pod = Pod(spec.index, spec.count, spec.socket_dir)
    app.state.pod = pod
    _worker_gauges(app, spec)
    config = uvicorn_config(app, settings, host=spec.host, port=spec.port, access_log=False,
                            log_level=settings.server.log_level, timeout_graceful_shutdown=5)
    server = draining_server(app, config)

    async def serve() -> None:
        private = PrivateServer(app, pod.socket_path(spec.index))
        await private.start()
        try:
            await server.serve(sockets=[sock])
        finally:
            await private.stop()
            await pod.aclose()

    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(serve())


# -- the supervisor ---------------------------------------------------------------------------------

def bind_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The pod's one listening socket (as uvicorn binds it), shared by every worker."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


@dataclass
class _Slot:
    index: int
    process: BaseProcess | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 0.0
    start_after: float = 0.0
    exitcode: int | None = None  # of the last process, once it exited during shutdown


class Supervisor:
    """Starts the workers, restarts the ones that die, and forwards shutdown signals to them."""

    def __init__(self, settings: Settings, host: str, port: int) -> None:
        self.settings = settings
        self.host = host
        self.port = port
        self.count = settings.server.workers
        self.slots = [_Slot(i) for i in range(self.count)]
        self.signals: list[int] = []
        self._ctx = multiprocessing.get_context("spawn")
        self._sock: socket.socket | None = None
        self._dir = ""

    @property
    def draining(self) -> bool:
        return bool(self.signals)

    def _start(self, slot: _Slot) -> None:
        assert self._sock is not None
        spec = WorkerSpec(slot.index, self.count, slot.restarts, self.settings, self.host, self.port,
                          self._dir, os.getpid())
        process = self._ctx.Process(target=worker_main, args=(spec, self._sock),
                                    name=f"coordinator-worker-{slot.index}")
        process.start()
        slot.process, slot.started_at, slot.exitcode = process, time.monotonic(), None

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        first = not self.signals
        self.signals.append(sig)
        for slot in self.slots:
            if slot.process is not None and slot.process.pid is not None and slot.process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.process.pid, sig)
        if first:
            # No worker will be started again; once each worker closed its listener the kernel must stop
            # accepting, so this process holds no copy of the socket from now on.
            if self._sock is not None:
                self._sock.close()
            log.warning("%s: draining %d worker(s) (a second signal stops them at once)",
                        signal.Signals(sig).name, self.count)
        else:
            log.warning("%s again: stopping the workers now", signal.Signals(sig).name)

    def _reap(self, slot: _Slot) -> None:
        process = slot.process
        if process is None or process.exitcode is None:
            return
        process.join()
        code = process.exitcode
        slot.process = None
        if self.draining:
            slot.exitcode = code
            if code != 0:
                log.warning("worker %d exited with status %s", slot.index, code)
            return
        lived = time.monotonic() - slot.started_at
        low, high = _RESTART_BACKOFF_S
        slot.backoff_s = 0.0 if lived >= _YOUNG_S else min(high, max(low, 2 * slot.backoff_s))
        slot.start_after = time.monotonic() + slot.backoff_s
        slot.restarts += 1
        log.error("worker %d (pid %s) exited with status %s after %.1f s; starting it again in %.1f s "
                  "(restart %d)", slot.index, process.pid, code, lived, slot.backoff_s, slot.restarts)

    def run(self) -> int:
        """Serve until the workers drained after a signal; the exit status for the process."""
        self._sock = bind_socket(self.host, self.port)
        self.port = self._sock.getsockname()[1]
        self._dir = tempfile.mkdtemp(prefix="coordinator-workers-")
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            shown = f"[{self.host}]" if ":" in self.host else self.host
            log.warning("supervisor pid %d: %d workers on http://%s:%d", os.getpid(), self.count, shown,
                        self.port)
            for slot in self.slots:
                self._start(slot)
            while True:
                for slot in self.slots:
                    self._reap(slot)
                    if slot.process is None and not self.draining and time.monotonic() >= slot.start_after:
                        self._start(slot)
                if self.draining and all(s.process is None for s in self.slots):
                    break
                alive = [s.process.sentinel for s in self.slots if s.process is not None]
                waits = [s.start_after - time.monotonic() for s in self.slots if s.process is None]
                timeout = max(0.0, min([1.0, *waits]))
                if alive:
                    wait_sentinels(alive, timeout=timeout)
                else:
                    time.sleep(timeout)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self._sock is not None:
                self._sock.close()
            shutil.rmtree(self._dir, ignore_errors=True)
        if len(self.signals) > 1:  # a forced stop: die of the signal, as one process would
            log.warning("workers stopped")
            signal.signal(self.signals[-1], signal.SIG_DFL)
            signal.raise_signal(self.signals[-1])
        failed = [s.index for s in self.slots if s.exitcode not in (0, None)]
        log.warning("all %d workers exited%s", self.count, f"; failed: {failed}" if failed else "")
        return 1 if failed else 0

