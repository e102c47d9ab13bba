"""A coordinator process's line to the pod's indexer (``coordinator.indexer``): matches asked for before
a routing decision, lessons and engine feeds sent on, all over one connection.

The line can fail at any time (the indexer restarts, a shared service is unreachable): a match then
answers None at once, or after ``timeout_s``, and the decision routes on load and on this process's own
recent lessons (``PrefixMemory``); the line reconnects by itself and sends the feeds again, so a
restarted indexer learns the fleet back without anyone's help.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable

import msgspec

from coordinator.contracts.indexer import (
    HEAD_SIZE,
    Attach,
    Detach,
    Forget,
    Learn,
    Match,
    Matched,
    Request,
    Stats,
    Status,
    decode_reply,
    frame,
    frame_size,
    parse_address,
)

log = logging.getLogger(__name__)

_BACKLOG_BYTES = 4 << 20   # unsent bytes past which the indexer counts as stalled: lessons are dropped


async def _open(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    kind, where, port = parse_address(address)
    if kind == "unix":
        return await asyncio.open_unix_connection(where)
    return await asyncio.open_connection(where, port)


class RemoteIndex:
    """``start`` keeps the line up until ``aclose``. ``on_change(up)`` is told when it comes and goes."""

    RETRY_S = (0.05, 1.0)   # first and longest wait between connection attempts

    def __init__(self, address: str, *, timeout_s: float,
                 on_change: Callable[[bool], None] | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.on_change = on_change
        self.unanswered = 0        # matches that got no answer (line down, or too slow)
        self.connects = 0
        self.last_error: str | None = "not connected yet"
        self._writer: asyncio.StreamWriter | None = None
        self._waiting: dict[int, asyncio.Future[Matched | Stats]] = {}
        self._ids = itertools.count(1)
        self._feeds: dict[str, Attach] = {}   # sent again on every connection
        self._task: asyncio.Task[None] | None = None

    @property
    def up(self) -> bool:
        return self._writer is not None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._keep_up(), name="kv-indexer line")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- what the scheduler sends -----------------------------------------------------------------------
    async def match(self, hashes: list[int]) -> Matched | None:
        """The indexer's match, or None when it cannot answer within ``timeout_s``."""
        reply = await self._ask(lambda i: Match(i, hashes))
        return reply if isinstance(reply, Matched) else None

    async def status(self) -> Stats | None:
        reply = await self._ask(Status)
        return reply if isinstance(reply, Stats) else None

    def learn(self, engine: str, hashes: list[int], cold: bool = False) -> None:
        self._send(Learn(engine, hashes, cold))

    def forget(self, engine: str) -> None:
        self._send(Forget(engine))

    def attach(self, engine: str, endpoint: str, model: str, replay: str | None) -> None:
        message = Attach(engine, endpoint, model, replay)
        if self._feeds.get(engine) != message:
            self._feeds[engine] = message
            self._send(message)

    def detach(self, engine: str) -> None:
        if self._feeds.pop(engine, None) is not None:
            self._send(Detach(engine))

    @property
    def feeds(self) -> list[str]:
        return list(self._feeds)

    # -- the line ---------------------------------------------------------------------------------------
    def _send(self, message: Request) -> bool:
        writer = self._writer
        if writer is None or writer.transport.get_write_buffer_size() > _BACKLOG_BYTES:
            return False
        writer.write(frame(message))
        return True

    async def _ask(self, make: Callable[[int], Request]) -> Matched | Stats | None:
        request_id = next(self._ids)
        future: asyncio.Future[Matched | Stats] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        try:
            if not self._send(make(request_id)):
                self.unanswered += 1
                return None
            async with asyncio.timeout(self.timeout_s):
                return await future
        except (TimeoutError, ConnectionError):
            self.unanswered += 1
            return None
        finally:
            self._waiting.pop(request_id, None)

    async def _keep_up(self) -> None:
        wait = self.RETRY_S[0]
        while True:
            try:
                reader, writer = await _open(self.address)
            except (OSError, ValueError) as exc:
                self.last_error = f"cannot reach {self.address}: {exc}"
                await asyncio.sleep(wait)
                wait = min(self.RETRY_S[1], wait * 2)
                continue
            wait = self.RETRY_S[0]
            self._writer = writer
            self.connects += 1
            self.last_error = None
            for message in self._feeds.values():
                writer.write(frame(message))
            log.info("KV indexer at %s: connected", self.address)
            self._changed(True)
            try:
                await self._read(reader)
                self.last_error = "the indexer closed the connection"
            except (OSError, asyncio.IncompleteReadError, ValueError, msgspec.MsgspecError) as exc:
                self.last_error = f"lost {self.address}: {exc or type(exc).__name__}"
            finally:
                self._writer = None
                writer.close()
                for future in self._waiting.values():
                    if not future.done():
                        future.set_exception(ConnectionError(self.last_error))
            log.warning("KV indexer: %s; routing on load until it is back", self.last_error)
            self._changed(False)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while True:
            head = await reader.readexactly(HEAD_SIZE)
            reply = decode_reply(await reader.readexactly(frame_size(head)))
            future = self._waiting.get(reply.id)
            if future is not None and not future.done():
                future.set_result(reply)

    def _changed(self, up: bool) -> None:
        if self.on_change is not None:
            self.on_change(up)
