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
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_sentinels
from multiprocessing.process import BaseProcess
from types import FrameType

from fastapi import FastAPI
from prometheus_client import Gauge

from coordinator.config import Settings
from coordinator.runtime.pod import Pod, PrivateServer
from coordinator.runtime.server import configure_logging, draining_server, uvicorn_config, watch_parent

log = logging.getLogger(__name__)

_RESTART_BACKOFF_S = (0.5, 30.0)  # first and longest wait before starting a worker that died young
_YOUNG_S = 10.0  # a worker that dies sooner than this after its start is restarted with backoff


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
    threading.Thread(target=watch_parent, args=(spec.parent_pid,), name="watch-supervisor",
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


INDEXER = -1   # the slot index of the pod's KV indexer process


class Supervisor:
    """Starts the workers (and the pod's KV indexer, ``scheduling.prefix.indexer.mode: pod``), restarts
    the ones that die, and forwards shutdown signals to the workers; the indexer serves them until the
    last one has exited."""

    def __init__(self, settings: Settings, host: str, port: int) -> None:
        self.settings = settings
        self.host = host
        self.port = port
        self.count = settings.server.workers
        self.slots = [_Slot(i) for i in range(self.count)]
        self.indexer: _Slot | None = _Slot(INDEXER) if settings.indexer_mode() == "pod" else None
        self.signals: list[int] = []
        self._ctx = multiprocessing.get_context("spawn")
        self._sock: socket.socket | None = None
        self._dir = ""
        self._worker_settings = settings

    def _indexer_address(self) -> str:
        return f"unix:{os.path.join(self._dir, 'indexer.sock')}"

    @property
    def draining(self) -> bool:
        return bool(self.signals)

    def _start(self, slot: _Slot) -> None:
        assert self._sock is not None
        if slot.index == INDEXER:
            from coordinator.indexer.process import IndexerSpec, indexer_main

            process = self._ctx.Process(
                target=indexer_main, name="coordinator-indexer",
                args=(IndexerSpec(self.settings, (self._indexer_address(),), os.getpid()),))
            process.start()
            slot.process, slot.started_at, slot.exitcode = process, time.monotonic(), None
            return
        spec = WorkerSpec(slot.index, self.count, slot.restarts, self._worker_settings, self.host, self.port,
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
        what = "the KV indexer" if slot.index == INDEXER else f"worker {slot.index}"
        log.error("%s (pid %s) exited with status %s after %.1f s; starting it again in %.1f s "
                  "(restart %d)", what, process.pid, code, lived, slot.backoff_s, slot.restarts)

    def _stop_indexer(self) -> None:
        """After the workers: nothing routes any more."""
        process = self.indexer.process if self.indexer is not None else None
        if process is None or process.exitcode is not None:
            return
        process.terminate()
        process.join(5.0)
        if process.exitcode is None:
            process.kill()
            process.join()

    def run(self) -> int:
        """Serve until the workers drained after a signal; the exit status for the process."""
        self._sock = bind_socket(self.host, self.port)
        self.port = self._sock.getsockname()[1]
        self._dir = tempfile.mkdtemp(prefix="coordinator-workers-")
        if self.indexer is not None:
            # The workers reach the pod's indexer on a unix socket in the pod's private folder.
            worker_settings = self.settings.model_copy(deep=True)
            line = worker_settings.scheduling.prefix.indexer
            line.mode, line.address = "service", self._indexer_address()
            self._worker_settings = worker_settings
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            shown = f"[{self.host}]" if ":" in self.host else self.host
            log.warning("supervisor pid %d: %d workers on http://%s:%d", os.getpid(), self.count, shown,
                        self.port)
            kept = [self.indexer, *self.slots] if self.indexer is not None else list(self.slots)
            for slot in kept:
                self._start(slot)
            while True:
                for slot in kept:
                    self._reap(slot)
                    if slot.process is None and not self.draining and time.monotonic() >= slot.start_after:
                        self._start(slot)
                if self.draining and all(s.process is None for s in self.slots):
                    break
                alive = [s.process.sentinel for s in kept if s.process is not None]
                waits = [s.start_after - time.monotonic() for s in kept if s.process is None]
                timeout = max(0.0, min([1.0, *waits]))
                if alive:
                    wait_sentinels(alive, timeout=timeout)
                else:
                    time.sleep(timeout)
        finally:
            self._stop_indexer()
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

