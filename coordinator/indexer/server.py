"""The indexer's sockets: a Unix socket in the pod, TCP for a shared service; one connection per worker,
its messages handled in order (``coordinator.contracts.indexer``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import msgspec

from coordinator.contracts.indexer import HEAD_SIZE, decode_request, frame, frame_size, parse_address
from coordinator.indexer.service import IndexService

log = logging.getLogger(__name__)


class IndexServer:
    """Serves ``service`` on ``addresses`` until ``stop``."""

    def __init__(self, service: IndexService, addresses: list[str]) -> None:
        self.service = service
        self.addresses = addresses
        self.bound: list[str] = []   # what was bound (a tcp port 0 resolved)
        self._servers: list[asyncio.Server] = []
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        for address in self.addresses:
            kind, where, port = parse_address(address)
            if kind == "unix":
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(where)   # a socket file left by an indexer that died
                server = await asyncio.start_unix_server(self._serve, path=where)
                self.bound.append(f"unix:{where}")
            else:
                server = await asyncio.start_server(self._serve, host=where, port=port)
                bound_port = server.sockets[0].getsockname()[1]
                self.bound.append(f"tcp://{where}:{bound_port}")
            self._servers.append(server)
        log.info("KV indexer (%s source) listening on %s", self.service.source, ", ".join(self.bound))

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._connections):
            task.cancel()
        for server in self._servers:
            await server.wait_closed()
        await self.service.aclose()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        peer = writer.get_extra_info("peername") or "a worker"
        try:
            while True:
                head = await reader.readexactly(HEAD_SIZE)
                body = await reader.readexactly(frame_size(head))
                try:
                    message = decode_request(body)
                except msgspec.MsgspecError as exc:
                    log.warning("KV indexer: dropping an undecodable message from %s: %s", peer, exc)
                    continue
                reply = await self.service.handle(message, task)
                if reply is not None:
                    writer.write(frame(reply))
                    if writer.transport.get_write_buffer_size() > 1 << 20:
                        await writer.drain()   # a worker that stopped reading holds no more than this
        except (asyncio.IncompleteReadError, ConnectionError):
            pass   # the worker went away (or restarts): its lessons are in, nothing else to do
        except ValueError as exc:
            log.warning("KV indexer: closing the connection of %s: %s", peer, exc)
        finally:
            self._connections.discard(task)
            writer.close()
            self.service.gone(task)
