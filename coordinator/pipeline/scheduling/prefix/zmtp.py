"""A ZMQ SUB peer of our own: ZMTP 3.0 (RFC 23/ZMTP, NULL mechanism) over a plain TCP or Unix socket.

Why not libzmq, which the rest of the coordinator uses: a libzmq socket is served by libzmq's own I/O
thread, which wakes for every TCP arrival, decodes the frames and signals the reading thread through
a mailbox. At 256 engines publishing 2,560 batches a second that thread and its signalling were a
third of the pod's intake CPU (docs/scheduling.md, "Our own ZMTP reader"). Here the event loop's own
socket is read: the bytes wait in the kernel until the feed's (gathered) drain reads them all in one
``recv``, and ``_mirror.Feed`` parses and applies them in place (``_mirror.sweep``: every ready feed
in one call).

Only what a subscriber of vLLM's KV-event publisher needs: connect, greet, ``READY``, one
subscription, then read messages (and answer ``PING``). Replays stay on libzmq (a DEALER, rare).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

log = logging.getLogger(__name__)

GREETING = (b"\xff" + bytes(8) + b"\x7f"    # signature
            + b"\x03\x00"                     # ZMTP 3.0
            + b"NULL".ljust(20, b"\x00")      # mechanism
            + b"\x00"                         # as-server: no
            + bytes(31))                      # filler
"""The 64 bytes a ZMTP 3.0 peer opens with."""

MORE, LONG, COMMAND = 0x01, 0x02, 0x04
MAX_FRAME = 64 << 20
"""The largest frame accepted: a KV-event batch is a few KiB; a size past this is a broken stream."""
CHUNK = 1 << 16
"""Bytes asked of the kernel per read (``_mirror.c`` reads as much)."""
DRAINED, MORE_WAITING, PYTHON, CLOSED = 0, 1, 2, 3
"""``_mirror.Feed.drain``'s states: the socket is read dry and no whole message waits; more may wait;
the buffer's head is for ``take``; the stream ended."""


class ZmtpError(Exception):
    """The peer broke the protocol: the connection is dropped and made again."""


def command(name: bytes, body: bytes = b"") -> bytes:
    """A command frame: ``name`` (length-prefixed) and its body."""
    data = bytes([len(name)]) + name + body
    return frame(data, COMMAND)


def frame(data: bytes, flags: int = 0) -> bytes:
    if len(data) > 255:
        return bytes([flags | LONG]) + struct.pack(">Q", len(data)) + data
    return bytes([flags, len(data)]) + data


def ready(socket_type: bytes) -> bytes:
    """The NULL mechanism's ``READY`` command with one property, ``Socket-Type``."""
    name = b"Socket-Type"
    return command(b"READY", bytes([len(name)]) + name + struct.pack(">I", len(socket_type)) + socket_type)


def subscription(topic: bytes) -> bytes:
    """ZMTP 3.0's subscription: a message whose first byte is 1 (3.1 peers, libzmq's, accept it too)."""
    return frame(b"\x01" + topic)


def properties(body: bytes) -> dict[bytes, bytes]:
    """A ``READY`` command's metadata."""
    props: dict[bytes, bytes] = {}
    at = 0
    while at < len(body):
        n = body[at]
        name = body[at + 1:at + 1 + n]
        at += 1 + n
        if at + 4 > len(body):
            raise ZmtpError("READY: a property is cut short")
        (size,) = struct.unpack_from(">I", body, at)
        at += 4
        if at + size > len(body):
            raise ZmtpError("READY: a property is cut short")
        props[name.lower()] = body[at:at + size]
        at += size
    return props


def split_frame(buf: bytearray | bytes, at: int) -> tuple[int, bytes, int] | None:
    """The frame at ``buf[at:]``: ``(flags, body, end)``, or None while it is incomplete."""
    if len(buf) - at < 2:
        return None
    flags = buf[at]
    if flags & ~(MORE | LONG | COMMAND):
        raise ZmtpError(f"reserved frame flags {flags:#x}")
    if flags & LONG:
        if len(buf) - at < 9:
            return None
        (size,) = struct.unpack_from(">Q", buf, at + 1)
        start = at + 9
    else:
        size = buf[at + 1]
        start = at + 2
    if size > MAX_FRAME:
        raise ZmtpError(f"a frame of {size} bytes")
    end = start + size
    if len(buf) < end:
        return None
    return flags, bytes(buf[start:end]), end


def address(endpoint: str) -> tuple[int, str | tuple[str, int]] | None:
    """The socket family and address of a ``tcp://host:port`` or ``ipc://path`` endpoint this reader
    can connect to; None for anything else (libzmq then reads that feed). A host name is resolved at
    each connect, to IPv4 unless the host is an IPv6 literal, as libzmq does by default: a restarted
    engine behind the same name is found at its new address."""
    parts = urlsplit(endpoint)
    if parts.scheme == "ipc":
        path = endpoint[len("ipc://"):]
        return (socket.AF_UNIX, path) if path and not path.startswith("@") else None
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        return None
    if parts.hostname in ("*", "0.0.0.0", "::"):
        return None
    return (socket.AF_INET6 if ":" in parts.hostname else socket.AF_INET), (parts.hostname, parts.port)


class ZmtpSubscription:
    """One SUB connection to a PUB socket, remade whenever it drops, as libzmq's SUB does.

    ``on_up(fd)`` is called once the handshake is done (the caller watches ``fd`` and drains the
    connection), ``on_down(fd)`` when it is lost, before the next try. The bytes received and not yet
    taken are ``buffer``: ``take`` parses a message off its head in Python; ``_mirror.Feed``
    reads and applies in C, leaving in it what it did not take.
    """

    RECONNECT_S = 0.1     # libzmq's ZMQ_RECONNECT_IVL
    RECONNECT_MAX_S = 2.0
    HANDSHAKE_S = 5.0

    def __init__(self, endpoint: str, topic: bytes, on_up: Callable[[int], None],
                 on_down: Callable[[int], None]) -> None:
        where = address(endpoint)
        if where is None:
            raise ValueError(f"not a tcp:// or ipc:// endpoint to connect to: {endpoint}")
        self.endpoint = endpoint
        self.topic = topic
        self.buffer = bytearray()
        self.connects = 0
        self._family, self._address = where
        self._on_up, self._on_down = on_up, on_down
        self.sock: socket.socket | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def fd(self) -> int | None:
        return self.sock.fileno() if self.sock is not None else None

    def start(self) -> None:
        """Connect in the background (needs a running loop); retried until ``close``."""
        self._closed = False
        if self._connecting is None and self.sock is None:
            self._connecting = asyncio.get_running_loop().create_task(
                self._connect(), name=f"zmtp connect {self.endpoint}")

    async def close(self) -> None:
        self._closed = True
        task, self._connecting = self._connecting, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._drop(notify=True)

    def lost(self, why: str) -> None:
        """The connection broke (end of stream, a read error, a protocol error): drop it, try again."""
        log.info("KV events at %s: connection lost (%s); reconnecting", self.endpoint, why)
        self._drop(notify=True)
        if not self._closed:
            self.start()

    def _drop(self, *, notify: bool) -> None:
        sock, self.sock = self.sock, None
        self.buffer.clear()
        if sock is not None:
            if notify:
                self._on_down(sock.fileno())
            sock.close()

    async def _connect(self) -> None:
        try:
            async for attempt in AsyncRetrying(
                    wait=wait_exponential(multiplier=self.RECONNECT_S, max=self.RECONNECT_MAX_S),
                    retry=retry_if_exception_type((OSError, ZmtpError, TimeoutError)), reraise=True):
                with attempt:
                    family, where = await self._resolve()
                    sock = socket.socket(family, socket.SOCK_STREAM)
                    try:
                        async with asyncio.timeout(self.HANDSHAKE_S):
                            await self._handshake(sock, where)
                    except BaseException:
                        sock.close()
                        self.buffer.clear()
                        raise
        finally:
            self._connecting = None
        self.sock = sock
        self.connects += 1
        self._on_up(sock.fileno())

    async def _resolve(self) -> tuple[int, str | tuple[Any, ...]]:
        if isinstance(self._address, str):   # a Unix socket's path
            return self._family, self._address
        host, port = self._address
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, family=self._family,
                                                             type=socket.SOCK_STREAM)
        if not infos:
            raise OSError(f"{host} resolves to no address")
        family, _, _, _, sockaddr = infos[0]
        return family, sockaddr

    async def _handshake(self, sock: socket.socket, where: str | tuple[Any, ...]) -> None:
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await loop.sock_connect(sock, where)
        await loop.sock_sendall(sock, GREETING)
        buf = self.buffer
        buf.clear()
        while len(buf) < 64:
            await self._receive(loop, sock)
        if buf[0] != 0xFF or buf[9] != 0x7F or buf[10] < 3:
            raise ZmtpError("not a ZMTP 3 peer")
        mechanism = bytes(buf[12:32]).rstrip(b"\x00")
        if mechanism != b"NULL":
            raise ZmtpError(f"mechanism {mechanism!r}: only NULL is spoken")
        del buf[:64]
        await loop.sock_sendall(sock, ready(b"SUB") + subscription(self.topic))
        while (got := split_frame(buf, 0)) is None:
            await self._receive(loop, sock)
        flags, body, end = got
        del buf[:end]
        if not flags & COMMAND or body[:6] != b"\x05READY":
            name = body[1:1 + body[0]] if flags & COMMAND and body else b""
            raise ZmtpError(f"expected READY, got {name.decode(errors='replace') or 'a message'}")
        kind = properties(body[6:]).get(b"socket-type", b"")
        if kind not in (b"PUB", b"XPUB"):
            named = kind.decode(errors="replace") or "socket of no type"
            raise ZmtpError(f"the peer is a {named}, not a PUB")

    async def _receive(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        data = await loop.sock_recv(sock, CHUNK)
        if not data:
            raise ConnectionResetError("closed during the handshake")
        self.buffer += data

    def fill(self) -> bool:
        """One read of what the kernel holds into ``buffer``; False at the end of the stream (the
        caller calls ``lost``). Nothing waiting is not an end."""
        assert self.sock is not None
        try:
            data = self.sock.recv(CHUNK)
        except (BlockingIOError, InterruptedError):
            return True
        if not data:
            return False
        self.buffer += data
        return True

    def take(self) -> list[bytes] | None:
        """The message at the head of ``buffer``, its frames; None while it is incomplete. Commands
        before it are taken and handled (``PING`` answered, ``ERROR`` raised as ``ZmtpError``)."""
        buf = self.buffer
        while True:
            frames: list[bytes] = []
            at = 0
            while True:
                got = split_frame(buf, at)
                if got is None:
                    return None
                flags, body, at = got
                if flags & COMMAND:
                    if frames:
                        raise ZmtpError("a command inside a message")
                    del buf[:at]
                    self._command(body)
                    break
                frames.append(body)
                if not flags & MORE:
                    del buf[:at]
                    return frames

    def _command(self, body: bytes) -> None:
        name = body[1:1 + body[0]] if body else b""
        rest = body[1 + len(name):]
        if name == b"PING":   # TTL (2 bytes), then a context the PONG echoes
            if self.sock is not None:
                with contextlib.suppress(BlockingIOError, InterruptedError):
                    self.sock.send(command(b"PONG", rest[2:18]))
        elif name == b"ERROR":
            raise ZmtpError(f"the peer reports an error: {rest[1:1 + rest[0]].decode(errors='replace')}"
                            if rest else "the peer reports an error")
        # anything else (PONG, a newer command) is not for a subscriber: skipped
