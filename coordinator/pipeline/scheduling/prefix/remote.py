"""A coordinator process's line to the pod's indexer (``coordinator.indexer``): matches asked for before
a routing decision, lessons and engine feeds sent on, all over one connection.

The line can fail at any time (the indexer restarts, a shared service is unreachable): a match then
answers None at once, or after ``timeout_s``, and the decision routes on load and on this process's own
recent lessons (``PrefixMemory``); the line reconnects by itself and sends the feeds again, so a
restarted indexer learns the fleet back without anyone's help. With a standby there is a second line,
told everything the first is, asked when the first is down or slow.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Iterable

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


class _Line:
    """One connection to one indexer, kept up until closed."""

    def __init__(self, address: str, feeds: Callable[[], Iterable[Attach]],
                 changed: Callable[[], None]) -> None:
        """``feeds``: what to send first on every connection; ``changed``: told when the line comes
        and goes."""
        self.address = address
        self.feeds = feeds
        self.changed = changed
        self.writer: asyncio.StreamWriter | None = None
        self.waiting: dict[int, asyncio.Future[Matched | Stats]] = {}
        self.connects = 0
        self.last_error: str | None = "not connected yet"
        self.slow = False   # its last question went unanswered in time: ask the other first
        self.task: asyncio.Task[None] | None = None

    @property
    def up(self) -> bool:
        return self.writer is not None

    def send(self, message: Request) -> bool:
        writer = self.writer
        if writer is None or writer.transport.get_write_buffer_size() > _BACKLOG_BYTES:
            return False
        writer.write(frame(message))
        return True

    async def keep_up(self) -> None:
        wait = RemoteIndex.RETRY_S[0]
        while True:
            try:
                reader, writer = await _open(self.address)
            except (OSError, ValueError) as exc:
                self.last_error = f"cannot reach {self.address}: {exc}"
                await asyncio.sleep(wait)
                wait = min(RemoteIndex.RETRY_S[1], wait * 2)
                continue
            wait = RemoteIndex.RETRY_S[0]
            self.writer, self.slow = writer, False
            self.connects += 1
            self.last_error = None
            for message in self.feeds():
                writer.write(frame(message))
            log.info("KV indexer at %s: connected", self.address)
            self.changed()
            try:
                await self.read(reader)
                self.last_error = "the indexer closed the connection"
            except (OSError, asyncio.IncompleteReadError, ValueError, msgspec.MsgspecError) as exc:
                self.last_error = f"lost {self.address}: {exc or type(exc).__name__}"
            finally:
                self.writer = None
                writer.close()
                for future in self.waiting.values():
                    if not future.done():
                        future.set_exception(ConnectionError(self.last_error))
            log.warning("KV indexer: %s", self.last_error)
            self.changed()

    async def read(self, reader: asyncio.StreamReader) -> None:
        while True:
            head = await reader.readexactly(HEAD_SIZE)
            reply = decode_reply(await reader.readexactly(frame_size(head)))
            self.slow = False
            future = self.waiting.get(reply.id)
            if future is not None and not future.done():
                future.set_result(reply)


class RemoteIndex:
    """``start`` keeps the line up until ``aclose``. ``on_change(up)`` is told when it comes and goes.

    With a ``standby`` (an HA pair of indexer services) there is a line to each, and both are told
    everything (the engines' feeds, every lesson), so each holds the whole index; a match asks the
    first that is up and answered its last question in time, so a lost or stalled indexer costs
    no decision its prefix hits (docs/scheduling.md, "An HA pair")."""

    RETRY_S = (0.05, 1.0)   # first and longest wait between connection attempts

    def __init__(self, address: str, *, timeout_s: float, standby: str | None = None,
                 on_change: Callable[[bool], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.on_change = on_change
        self.unanswered = 0        # matches that got no answer (every line down, or too slow)
        self._feeds: dict[str, Attach] = {}   # sent again on every connection
        self._lines = [_Line(where, self._feeds.values, self._changed)
                       for where in (address, standby) if where]
        self._ids = itertools.count(1)
        self._was_up = False
        self.answered_by: str | None = None   # the address of the indexer that answered last

    @property
    def address(self) -> str:
        return ", ".join(line.address for line in self._lines)

    @property
    def up(self) -> bool:
        return any(line.up for line in self._lines)

    @property
    def connects(self) -> int:
        return sum(line.connects for line in self._lines)

    @property
    def last_error(self) -> str | None:
        errors = [line.last_error for line in self._lines if line.last_error]
        return "; ".join(errors) if errors else None

    @property
    def lines(self) -> dict[str, bool]:
        """Each indexer's address and whether its line is up."""
        return {line.address: line.up for line in self._lines}

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for line in self._lines:
            if line.task is None:
                line.task = loop.create_task(line.keep_up(), name=f"kv-indexer line {line.address}")

    async def aclose(self) -> None:
        for line in self._lines:
            task, line.task = line.task, None
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

    # -- the lines --------------------------------------------------------------------------------------
    def _send(self, message: Request) -> None:
        for line in self._lines:
            line.send(message)

    def _asked(self) -> _Line | None:
        """The line to ask: the first up and not slow, else the first up."""
        up = [line for line in self._lines if line.up]
        return next((line for line in up if not line.slow), up[0] if up else None)

    async def _ask(self, make: Callable[[int], Request]) -> Matched | Stats | None:
        line = self._asked()
        if line is None:
            self.unanswered += 1
            return None
        request_id = next(self._ids)
        future: asyncio.Future[Matched | Stats] = asyncio.get_running_loop().create_future()
        line.waiting[request_id] = future
        try:
            if not line.send(make(request_id)):
                self.unanswered += 1
                return None
            async with asyncio.timeout(self.timeout_s):
                reply = await future
            self.answered_by = line.address
            return reply
        except TimeoutError:
            line.slow = True
            self.unanswered += 1
            return None
        except ConnectionError:
            self.unanswered += 1
            return None
        finally:
            line.waiting.pop(request_id, None)

    def _changed(self) -> None:
        up = self.up
        if up != self._was_up:
            self._was_up = up
            if self.on_change is not None:
                self.on_change(up)
