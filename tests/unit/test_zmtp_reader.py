"""Our own ZMTP reader of the engines' KV-event feeds (``zmtp.ZmtpSubscription``).

Against libzmq's PUB socket (what vLLM publishes with) for what a user sees: batches applied, a
restarted publisher found again, ``ipc://`` endpoints. Against a PUB peer written out byte by byte in
the tests for what libzmq never does on a quiet machine: a stream cut at every byte, ``PING``,
frames of 8-byte sizes, and peers that break the protocol.
"""

from __future__ import annotations

import asyncio
import random
import struct
from typing import Any

import pytest
import zmq
import zmq.asyncio

from coordinator.pipeline.scheduling.prefix import zmtp
from coordinator.pipeline.scheduling.prefix.feeds import KvEventSubscriber
from coordinator.pipeline.scheduling.prefix.index import PrefixIndex
from coordinator.pipeline.scheduling.prefix.kv_events import NATIVE_MIRROR, KvEventMirror
from coordinator.pipeline.scheduling.prefix.source import PreciseIndexSource
from tests.unit.test_kv_events import (
    BS,
    ENGINE,
    MODEL,
    OTHER,
    PROMPT,
    free_port,
    ours,
    payload,
    removed,
    run_of,
    stored,
    wait_for,
)


def message(seq: int, body: bytes, topic: bytes = b"kv") -> bytes:
    """One KV-event message as a PUB socket writes it: topic, sequence number, payload."""
    return (zmtp.frame(topic, zmtp.MORE) + zmtp.frame(seq.to_bytes(8, "big"), zmtp.MORE)
            + zmtp.frame(body))


class HandWrittenPub:
    """A PUB peer of ZMTP bytes written here, serving every subscriber that connects the same stream,
    cut into pieces as the test says."""

    def __init__(self, greeting: bytes = zmtp.GREETING, ready: bytes = zmtp.ready(b"PUB")) -> None:
        self.greeting, self.ready = greeting, ready
        self.subscriptions: list[bytes] = []
        self.peers: list[tuple[asyncio.StreamWriter, bytearray]] = []
        self.accepted = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        return int(self._server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        writer.write(self.greeting)
        try:
            theirs = await reader.readexactly(64)
            assert theirs == zmtp.GREETING
            for _ in range(2):   # their READY, then their subscription
                flags, size = await reader.readexactly(2)
                body = await reader.readexactly(size)
                if not flags & zmtp.COMMAND:
                    self.subscriptions.append(body)
            writer.write(self.ready)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        heard = bytearray()
        self.peers.append((writer, heard))
        while data := await reader.read(4096):
            heard += data

    async def send(self, data: bytes, piece: int | None = None) -> None:
        """``data`` to every subscriber, in pieces of at most ``piece`` bytes, each flushed."""
        step = piece or len(data)
        for at in range(0, len(data), step):
            for writer, _ in self.peers:
                writer.write(data[at:at + step])
                await writer.drain()
            if piece:
                await asyncio.sleep(0)

    async def drop(self) -> None:
        for writer, _ in self.peers:
            writer.close()
        self.peers.clear()

    async def close(self) -> None:
        await self.drop()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def subscriber(port: int, native: bool, index: PrefixIndex | None = None,
               host: str = "127.0.0.1") -> KvEventSubscriber:
    sub = KvEventSubscriber(f"tcp://{host}:{port}", KvEventMirror(index or PrefixIndex(), ENGINE, MODEL, BS), "kv")
    assert sub.own_reader
    sub.native_drain = native and sub.native_drain
    return sub


def shape(ix: PrefixIndex) -> Any:
    lru, owners, leaves, shared = ix.state()
    return {e: [h for h, _ in blocks] for e, blocks in lru.items()}, owners, leaves, shared


@pytest.mark.skipif(not NATIVE_MIRROR, reason="the C reader needs the _mirror extension")
async def test_a_stream_cut_anywhere_applies_as_the_python_reader_applies_it() -> None:
    """The same stream to a C reader and a Python one, cut into pieces of 1 to 700 bytes: long frames
    (8-byte sizes), a PING between messages (answered with its context), a message of two frames, a
    batch only Python decodes. Both readers end with the same index, the same counters, and both
    answered the PING."""
    pub = HandWrittenPub()
    port = await pub.start()
    (c_ix, py_ix) = PrefixIndex(), PrefixIndex()
    c_sub, py_sub = subscriber(port, True, c_ix), subscriber(port, False, py_ix)
    assert c_sub.native_drain and not py_sub.native_drain
    rng = random.Random(5)
    try:
        c_sub.start()
        py_sub.start()
        assert await wait_for(lambda: len(pub.peers) == 2)
        assert pub.subscriptions == [b"\x01kv", b"\x01kv"]
        seq = 0
        stream = bytearray(message(seq, payload()))
        for k in range(1, 40):
            start = rng.randrange(0, 250)
            toks = PROMPT[start:start + 3 * BS]
            body = payload(stored(toks, [rng.randrange(2**63) for _ in range(3)]),
                           removed([rng.randrange(2**63)]))
            seq += 1
            stream += message(seq, body)
            if k == 10:
                stream += zmtp.command(b"PING", b"\x00\x0a" + b"ctx-7")
            if k == 20:
                stream += zmtp.frame(b"kv", zmtp.MORE) + zmtp.frame(b"short")   # two frames: bad
            if k == 30:   # LoRA: Python decodes it
                seq += 1
                stream += message(seq, payload(stored(PROMPT[:64], [1, 2, 3, 4], lora_name="a")))
            if k == 35:   # one batch lost
                seq += 1
        final = seq + 1
        big = payload(stored(*run_of(OTHER, BS)))   # 18 blocks: a frame of 8-byte size
        assert len(big) > 255
        stream += message(final, big)
        at = 0
        while at < len(stream):
            n = rng.randrange(1, 700)
            await pub.send(bytes(stream[at:at + n]), piece=rng.choice([1, 7, 64, None]))
            at += n
        assert await wait_for(lambda: c_sub.last_seq == final and py_sub.last_seq == final, within=10.0)
        assert shape(c_ix) == shape(py_ix)
        assert c_ix.match(ours(OTHER)) == {ENGINE: 18}
        counters = ("gaps", "missed", "restarts", "bad_frames")
        assert [getattr(c_sub, k) for k in counters] == [getattr(py_sub, k) for k in counters]
        assert c_sub.bad_frames == 1 and (c_sub.gaps, c_sub.missed) == (1, 1)
        assert c_sub.mirror.stats.direct_batches >= 30
        pong = zmtp.command(b"PONG", b"ctx-7")
        assert await wait_for(lambda: all(pong in heard for _, heard in pub.peers))
    finally:
        await c_sub.stop()
        await py_sub.stop()
        await pub.close()


@pytest.mark.parametrize("native", [True, False])
async def test_a_restarted_publisher_is_found_again(native: bool) -> None:
    """The feed starts before the engine binds (it keeps trying), follows it, and when the engine
    restarts (its PUB socket closed, a new one on the same port, sequence numbers from 0) connects
    again: the engine's blocks are forgotten and the new ones applied, as with libzmq's SUB. The
    endpoint names a host, resolved at each connect."""
    ctx = zmq.asyncio.Context()
    port = free_port()
    index = PrefixIndex()
    sub = subscriber(port, native, index, host="localhost")
    toks, hs = run_of(PROMPT, BS)
    seq = 0

    def bind() -> zmq.asyncio.Socket:
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(f"tcp://127.0.0.1:{port}")
        return pub

    async def send(*events: Any) -> None:
        nonlocal seq
        await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload(*events)])
        seq += 1

    pub = None
    try:
        sub.start()
        await asyncio.sleep(0.3)   # refused a few times meanwhile
        assert sub.connects == 0
        pub = bind()
        assert await wait_for(lambda: index.match(ours(PROMPT)) == {ENGINE: 18}, lambda: send(stored(toks, hs)))
        assert await wait_for(lambda: (sub.last_seq or 0) >= 10, send)
        assert sub.connects == 1
        pub.close(linger=0)
        await asyncio.sleep(0.2)
        pub, seq = bind(), 0
        assert await wait_for(lambda: sub.connects == 2)   # then its first batches are not missed
        b_toks, b_hs = run_of(OTHER, BS)
        assert await wait_for(lambda: index.match(ours(OTHER)) == {ENGINE: 18}, lambda: send(stored(b_toks, b_hs)))
        assert sub.connects == 2 and sub.restarts == 1
        assert index.match(ours(PROMPT)) == {}   # the restarted engine's cache starts empty
    finally:
        await sub.stop()
        if pub is not None:
            pub.close(linger=0)
        ctx.term()


async def test_an_ipc_endpoint_is_read_by_our_reader(tmp_path: Any) -> None:
    """vLLM may publish on ``ipc://``: our reader connects to the Unix socket; an endpoint it cannot
    read (``inproc://``, an abstract socket) is left to libzmq."""
    ctx = zmq.asyncio.Context()
    endpoint = f"ipc://{tmp_path / 'kv.sock'}"
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    index = PrefixIndex()
    source = PreciseIndexSource(index, lambda url: MODEL, BS, topic="kv", context=ctx)
    toks, hs = run_of(PROMPT, BS)
    seq = 0

    async def send() -> None:
        nonlocal seq
        await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload(stored(toks, hs))])
        seq += 1

    try:
        sub = await source.attach(ENGINE, endpoint)
        assert sub.own_reader
        assert await wait_for(lambda: index.match(ours(PROMPT)) == {ENGINE: 18}, send)
        for other in ("inproc://kv", "ipc://@kv", "tcp://*:5557"):
            assert not KvEventSubscriber(other, KvEventMirror(PrefixIndex(), ENGINE, MODEL, BS)).own_reader
    finally:
        await source.stop_all()
        pub.close(linger=0)
        ctx.term()


BAD_PEERS = {
    "not ZMTP": (b"HTTP/1.1 400 Bad Request\r\n\r\n" + bytes(64), zmtp.ready(b"PUB")),
    "CURVE": (zmtp.GREETING[:12] + b"CURVE".ljust(20, b"\x00") + zmtp.GREETING[32:], zmtp.ready(b"PUB")),
    "a ROUTER": (zmtp.GREETING, zmtp.ready(b"ROUTER")),
    "a message for READY": (zmtp.GREETING, zmtp.frame(b"hello")),
}


@pytest.mark.parametrize("peer", list(BAD_PEERS))
async def test_a_peer_that_is_not_a_null_pub_is_refused_and_tried_again(peer: str) -> None:
    """Whatever answers at the endpoint, the feed never applies anything from a peer that is not a
    ZMTP 3 PUB with NULL security, and keeps trying (the engine may come up there later)."""
    greeting, ready = BAD_PEERS[peer]
    pub = HandWrittenPub(greeting, ready)
    port = await pub.start()
    sub = subscriber(port, True)
    try:
        sub.start()
        assert await wait_for(lambda: pub.accepted >= 2, within=5.0)
        assert sub.connects == 0 and sub.mirror.stats.batches == 0
    finally:
        await sub.stop()
        await pub.close()


@pytest.mark.parametrize("native", [True, False])
async def test_a_broken_stream_is_dropped_and_made_again(native: bool) -> None:
    """A frame with reserved flags, or one claiming more than ``MAX_FRAME`` bytes, ends that
    connection; the feed connects again and what comes on the new one is applied."""
    pub = HandWrittenPub()
    port = await pub.start()
    index = PrefixIndex()
    sub = subscriber(port, native, index)
    toks, hs = run_of(PROMPT, BS)
    try:
        sub.start()
        assert await wait_for(lambda: len(pub.peers) == 1)
        await pub.send(message(0, payload(stored(toks[:BS], hs[:1]))))
        assert await wait_for(lambda: index.match(ours(PROMPT)) == {ENGINE: 1})
        await pub.send(b"\x41" + message(1, payload())[1:])                                # reserved flag
        assert await wait_for(lambda: sub.connects == 2 and len(pub.peers) == 2)
        await pub.drop()
        assert await wait_for(lambda: sub.connects == 3 and len(pub.peers) == 1)
        await pub.send(b"\x02" + struct.pack(">Q", zmtp.MAX_FRAME + 1))                     # too large
        assert await wait_for(lambda: sub.connects == 4 and len(pub.peers) == 2)
        await pub.drop()
        assert await wait_for(lambda: sub.connects == 5 and len(pub.peers) == 1)
        await pub.send(message(1, payload(stored(toks[BS:], hs[1:], parent=hs[0]))))
        assert await wait_for(lambda: index.match(ours(PROMPT)) == {ENGINE: 18})
        assert sub.gaps == 0
    finally:
        await sub.stop()
        await pub.close()


def test_frames_are_written_as_zmtp_says() -> None:
    """Short and long frames, commands, READY's metadata: what a libzmq peer reads."""
    assert zmtp.frame(b"ab", zmtp.MORE) == b"\x01\x02ab"
    assert zmtp.frame(bytes(256)) == b"\x02" + (256).to_bytes(8, "big") + bytes(256)
    assert zmtp.command(b"PING", b"\x00\x01") == b"\x04\x07\x04PING\x00\x01"
    ready = zmtp.ready(b"SUB")
    assert ready == b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03SUB"
    assert zmtp.properties(ready[8:]) == {b"socket-type": b"SUB"}
    with pytest.raises(zmtp.ZmtpError):
        zmtp.properties(ready[8:-1])
