"""The indexer in a process of its own: started (and started again when it dies) by the coordinator's
supervisor beside the workers (``scheduling.prefix.indexer.mode: pod``), or as its own container for
several coordinator replicas (``python -m coordinator.indexer``)."""

from __future__ import annotations

import asyncio
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
    server = IndexServer(IndexService(settings.scheduling.prefix), addresses)
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
