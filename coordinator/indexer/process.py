"""The indexer in a process of its own: started (and started again when it dies) by the coordinator's
supervisor beside the workers (``scheduling.prefix.indexer.mode: pod``), or as its own container for
several coordinator replicas (``python -m coordinator.indexer``)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.config import Settings
from coordinator.indexer.server import IndexServer
from coordinator.indexer.service import IndexService
from coordinator.runtime.server import configure_logging, watch_parent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IndexerSpec:
    """What the supervisor starts the pod's indexer with (pickled into the spawned child)."""

    settings: Settings
    addresses: tuple[str, ...]
    parent_pid: int


GC_THRESHOLDS = (100_000, 50, 1000)


def quiet_collector() -> None:
    """The cyclic garbage collector, tuned for an index. The index is millions of dict entries and
    small tuples that never form cycles, yet a full collection walks all of them: with Python's
    default thresholds that stalled the indexer for 50-200 ms several times a minute at 256 engines,
    so matches timed out and decisions routed blind. Collections of the young generations stay
    (asyncio makes short-lived cycles); full ones become rare."""
    gc.collect()
    gc.freeze()   # what start-up made is never collected again
    gc.set_threshold(*GC_THRESHOLDS)


def indexer_main(spec: IndexerSpec) -> None:
    """The pod's indexer process; it exits with its supervisor."""
    os.setpgrp()  # signals come from the supervisor only (a terminal's Ctrl-C reaches the group)
    configure_logging(spec.settings, role="indexer")
    threading.Thread(target=watch_parent, args=(spec.parent_pid,), name="watch-supervisor",
                     daemon=True).start()
    asyncio.run(serve(spec.settings, list(spec.addresses)))


async def serve(settings: Settings, addresses: list[str],
                started: Callable[[list[str]], None] | None = None) -> None:
    """Serve the index on ``addresses`` until SIGTERM or SIGINT. ``started`` is told what was bound."""
    quiet_collector()
    server = IndexServer(IndexService(settings.scheduling.prefix,
                                       window_s=settings.scheduling.bounded_load.window_s), addresses)
    await server.start()
    if started is not None:
        started(server.bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("KV indexer stopping")
        await server.stop()
