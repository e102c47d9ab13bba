"""One engine's KV-event feed: a subscription to the engine's publisher (``KvEventSubscriber``) that
applies its batches to the engine's ``KvEventMirror`` (``kv_events``), in sequence, replaying what it
missed. The set of them kept in step with the fleet is ``source.PreciseIndexSource``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any, cast

import zmq
import zmq.asyncio

from coordinator.pipeline.scheduling.prefix import zmtp
from coordinator.pipeline.scheduling.prefix.gather import Gatherer
from coordinator.pipeline.scheduling.prefix.kv_events import KvEventMirror
from coordinator.pipeline.scheduling.prefix.libzmq_receive import NATIVE_DRAIN, more_waiting, receive
from coordinator.pipeline.scheduling.prefix.zmtp import ZmtpError, ZmtpSubscription

log = logging.getLogger(__name__)


# --- one engine's feed ------------------------------------------------------------------------

class KvEventSubscriber:
    """SUB socket on one engine's publisher, applying every batch to ``mirror``.

    vLLM's ``tcp://*:PORT`` endpoint binds, so we connect, and reconnect whenever the engine restarts:
    with our own ZMTP reader (``zmtp``, ``reader="zmtp"``: no libzmq I/O thread) for ``tcp://`` and
    ``ipc://`` endpoints, else with a libzmq SUB socket. Sequence numbers are checked: a gap means lost
    batches, which are fetched from the engine's ``replay_endpoint`` (vLLM's ROUTER socket: send the
    first missing sequence number, get the buffered batches and an end marker) when one is configured;
    otherwise, or if the replay comes back short, the gap is logged and counted and the index may hold
    stale blocks or miss some until they are evicted or re-stored. A sequence that goes backwards means
    the publisher restarted, so the engine's cache is empty and we reset the mirror.

    The socket is watched with the loop's ``add_reader`` (or the ``Gatherer``) and drained with
    non-blocking receives: a batch costs no future, task switch or coroutine, which at 256 engines
    was two thirds of the intake's CPU (docs/scheduling.md, "The pod's KV index").
    """

    END_SEQ = (-1).to_bytes(8, "big", signed=True)
    REPLAY_TIMEOUT_S = 2.0
    BATCH_S = 0.002  # the most one engine's batches hold the event loop at a time
    DRAIN_MESSAGES = 32  # messages per native drain call, between looks at the clock

    def __init__(self, endpoint: str, mirror: KvEventMirror, topic: str = "", *,
                 context: zmq.Context[Any] | None = None, replay_endpoint: str | None = None,
                 bootstrap: bool = False, gatherer: Gatherer | None = None, reader: str = "zmtp") -> None:
        """``gatherer``: watch the socket through it rather than with a reader of its own.
        ``reader``: ``zmtp`` reads the feed with ``zmtp.ZmtpSubscription`` where its endpoint allows
        (``tcp://``, ``ipc://``), ``libzmq`` always with a libzmq SUB socket.
        ``bootstrap``: on a start with nothing seen yet, first apply everything the engine's replay
        socket still buffers, so a fresh index (a restarted indexer) holds what the engine holds now,
        as far as the buffer reaches (vLLM keeps its last 10,000 batches by default)."""
        self.endpoint = endpoint
        self.bootstrap = bootstrap
        self.duplicates = 0
        self.own_reader = reader == "zmtp" and zmtp.address(endpoint) is not None
        # Our reader's feed in C (``_mirror.Feed``): it holds the position in the stream, and the
        # gathered sweep drains it while it is live (``_sync_live``).
        self._feed = mirror.stream_feed(self.DRAIN_MESSAGES) if self.own_reader and mirror.drains else None
        self._last_seq: int | None = None
        # Receive in C while the stream is plain (the next sequence number, the common batch), Python
        # handling whatever it hands back (``KvEventMirror.drain``).
        self._native_drain = NATIVE_DRAIN and mirror.drains
        # After the start-up replay: live batches the replay already applied are skipped (in Python).
        self._catching_up = False
        self._sync_live()
        self.replay_endpoint = replay_endpoint
        self.replayed = 0
        self.mirror = mirror
        self.topic = topic
        self.gaps = 0
        self.missed = 0
        self.restarts = 0
        self.bad_frames = 0
        ctx = context if context is not None else zmq.asyncio.Context.instance()
        self._ctx = zmq.asyncio.Context.shadow(ctx.underlying)      # replay's DEALER: awaited
        self._sync_ctx: zmq.Context[Any] = zmq.Context.shadow(ctx.underlying)  # the SUB: drained in callbacks
        self._sock: zmq.Socket[bytes] | None = None
        self._zmtp: ZmtpSubscription | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None   # the descriptor watched (a ZMTP feed's while it is connected)
        self._gatherer = gatherer
        self._held: list[bytes] | None = None   # a batch after a gap, applied once the replay is done
        self._replaying: asyncio.Task[None] | None = None
        self._again: asyncio.Handle | None = None

    @property
    def last_seq(self) -> int | None:
        """The sequence number of the last batch applied (None before the first)."""
        return self._feed.last_seq if self._feed is not None else self._last_seq

    @last_seq.setter
    def last_seq(self, seq: int | None) -> None:
        if self._feed is not None:
            self._feed.last_seq = seq
        else:
            self._last_seq = seq

    @property
    def native_drain(self) -> bool:
        """Whether batches are received and applied in C while the stream is plain."""
        return self._native_drain

    @native_drain.setter
    def native_drain(self, on: bool) -> None:
        self._native_drain = on
        self._sync_live()

    def _sync_live(self) -> None:
        """The sweep drains our feed in C only where ``_drain_stream`` would (and from a known
        position, which the feed checks itself)."""
        if self._feed is not None:
            self._feed.live = self._native_drain and not self._catching_up

    @property
    def running(self) -> bool:
        return self._sock is not None or self._zmtp is not None

    @property
    def connects(self) -> int:
        """Connections made by our own reader (0 with libzmq, which does not say)."""
        return self._zmtp.connects if self._zmtp is not None else 0

    def start(self) -> None:
        """Connect and start receiving; needs a running event loop."""
        if self.running:
            return
        self._loop = asyncio.get_running_loop()
        if self.own_reader:
            self._zmtp = ZmtpSubscription(self.endpoint, self.topic.encode(), self._connected,
                                          self._disconnected)
            if self._feed is not None:
                self._feed.buffer = self._zmtp.buffer
            self._zmtp.start()
            if self.bootstrap and self.replay_endpoint is not None and self.last_seq is None:
                self._replaying = self._loop.create_task(self._bootstrap(),
                                                         name=f"kv-events bootstrap {self.mirror.engine}")
            return
        sock = self._sync_ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sock.connect(self.endpoint)
        self._sock = sock
        self._watch(cast(int, sock.getsockopt(zmq.FD)))
        if self.bootstrap and self.replay_endpoint is not None and self.last_seq is None:
            self._replaying = self._loop.create_task(self._bootstrap(),
                                                     name=f"kv-events bootstrap {self.mirror.engine}")
        else:
            self._again = self._loop.call_soon(self._drain)  # anything queued before the reader was added

    def _watch(self, fd: int) -> None:
        self._fd = fd
        feed = self._feed if self._zmtp is not None else None
        if feed is not None:
            feed.fd = fd
        if self._gatherer is not None:
            self._gatherer.add(fd, self._drain, feed)
        else:
            assert self._loop is not None
            self._loop.add_reader(fd, self._drain)

    def _unwatch(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if self._gatherer is not None:
            self._gatherer.remove(fd)
        elif self._loop is not None:
            self._loop.remove_reader(fd)

    def _connected(self, fd: int) -> None:
        """Our reader's connection is up: watch it, and drain what came with the handshake. While a
        replay runs the socket is not watched (its descriptor is level-triggered): the replay's end
        watches it."""
        if self._replaying is None:
            self._watch(fd)
            assert self._loop is not None
            self._again = self._loop.call_soon(self._drain)

    def _disconnected(self, fd: int) -> None:
        if self._fd == fd:
            self._unwatch()

    async def stop(self) -> None:
        """Stop receiving and forget this engine's blocks (nothing keeps them current any more)."""
        await self.stop_quietly()
        self.mirror.reset()

    async def stop_quietly(self) -> None:
        """Disconnect but keep the mirror and the sequence position (a later ``start`` resumes, and
        replays what it missed)."""
        sock, self._sock = self._sock, None
        conn, self._zmtp = self._zmtp, None
        if self._again is not None:
            self._again.cancel()
            self._again = None
        task, self._replaying = self._replaying, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._held = None
        self._unwatch()
        if sock is not None:
            sock.close(linger=0)
        if conn is not None:
            await conn.close()

    def _drain(self) -> None:
        """Apply what is waiting, for up to ``BATCH_S``; a drain cut short by that cap schedules its own
        continuation (ZMQ's descriptor is edge-triggered, and our reader's buffer is not watched)."""
        self._again = None
        if self._replaying is not None:
            return
        if self._zmtp is not None:
            self._drain_stream(self._zmtp)
        elif self._sock is not None:
            self._drain_socket(self._sock)

    def _drain_stream(self, conn: ZmtpSubscription) -> None:
        """Our reader's feed: messages are taken off its buffer, which is filled from its socket as it
        runs dry (in C while the stream is plain, else in Python: ``take``, ``fill``)."""
        fd = conn.fd
        if fd is None:
            return
        deadline = time.perf_counter() + self.BATCH_S
        while True:
            frames: list[bytes] | None
            feed = self._feed
            if feed is not None and feed.live and feed.last_seq is not None:
                try:
                    frames, state = feed.drain(self.mirror.index.now())
                except Exception:   # out of memory: receive in Python from here on
                    log.exception("KV events from %s: the native drain failed; receiving in Python",
                                  self.mirror.engine)
                    self.native_drain = False
                    continue
                if state == zmtp.CLOSED:
                    conn.lost("end of stream")
                    return
                if frames is None:
                    if state == zmtp.DRAINED:
                        return
                    if state == zmtp.MORE_WAITING:
                        if self._later(deadline):
                            return
                        continue
                    frames = self._take(conn)   # zmtp.PYTHON: a command, or not a plain message
            else:
                frames = self._take(conn)
            if frames is None:
                return
            if self._gap_to_replay(frames):
                self._start_replay(frames)
                return
            self._apply(frames)
            if self._later(deadline):
                return

    @staticmethod
    def _take(conn: ZmtpSubscription) -> list[bytes] | None:
        """The next message off our reader's buffer, read from its socket if need be; None if none is
        whole yet, or the connection was lost (and is being made again)."""
        try:
            frames = conn.take()
            if frames is None:
                if not conn.fill():
                    conn.lost("end of stream")
                    return None
                frames = conn.take()
        except (ZmtpError, OSError) as exc:
            conn.lost(str(exc) or type(exc).__name__)
            return None
        return frames

    def _start_replay(self, frames: list[bytes]) -> None:
        """A gap: fetch what is missing before ``frames`` is applied. Our reader's socket is not
        watched meanwhile (its descriptor is level-triggered); ``_resume`` watches it again."""
        self._held = frames
        if self._zmtp is not None:
            self._unwatch()
        assert self._loop is not None
        self._replaying = self._loop.create_task(self._replay_then_go_on(),
                                                 name=f"kv-events replay {self.mirror.engine}")

    def _resume(self) -> None:
        """After a replay: watch our reader's socket again and drain what waits."""
        if self._zmtp is not None and self._zmtp.fd is not None and self._fd is None:
            self._watch(self._zmtp.fd)
        if self.running and self._loop is not None:
            self._again = self._loop.call_soon(self._drain)

    def _drain_socket(self, sock: zmq.Socket[bytes]) -> None:
        """A libzmq feed."""
        deadline = time.perf_counter() + self.BATCH_S
        while True:
            if self.native_drain and self.last_seq is not None and not self._catching_up:
                try:
                    last, held, more = self.mirror.drain(sock.underlying, self.last_seq, self.DRAIN_MESSAGES)
                except Exception:   # out of memory, a libzmq error: receive in Python from here on
                    log.exception("KV events from %s: the native drain failed; receiving in Python",
                                  self.mirror.engine)
                    self.native_drain = False
                    continue
                self.last_seq = last
                if held is None:   # all applied; the drain read ``EVENTS`` last
                    if not more or self._later(deadline):
                        return
                    continue
                frames = held
            else:
                try:
                    frames = receive(sock)   # woken for a message, almost always: no readiness check first
                except zmq.Again:
                    return
            if self._gap_to_replay(frames):
                self._start_replay(frames)
                return
            self._apply(frames)
            if not more_waiting(sock) or self._later(deadline):
                return

    def _later(self, deadline: float) -> bool:
        """Past ``deadline``: the drain goes on in a callback of its own (the loop serves others first)."""
        if time.perf_counter() < deadline:
            return False
        assert self._loop is not None
        self._again = self._loop.call_soon(self._drain)
        return True

    async def _bootstrap(self) -> None:
        try:
            applied = await self.replay(0)
            log.info("KV events from %s: %d buffered batches replayed at start", self.mirror.engine, applied)
        except Exception:  # the live feed goes on without the history
            log.exception("KV events from %s: start-up replay failed", self.mirror.engine)
        self._catching_up = self.last_seq is not None
        self._sync_live()
        self._replaying = None
        self._resume()

    async def _replay_then_go_on(self) -> None:
        frames = self._held
        assert frames is not None
        await self._replay_before(frames)
        self._held = None
        self._apply(frames)
        self._replaying = None
        self._resume()

    def _gap_to_replay(self, frames: Sequence[bytes]) -> bool:
        last = self.last_seq
        return (self.replay_endpoint is not None and last is not None and len(frames) == 3
                and len(frames[1]) == 8 and int.from_bytes(frames[1], "big") > last + 1)

    async def _replay_before(self, frames: Sequence[bytes]) -> None:
        if self._gap_to_replay(frames):
            assert self.last_seq is not None
            try:
                await self.replay(self.last_seq + 1, int.from_bytes(frames[1], "big"))
            except Exception:  # a failed replay leaves the gap for ``handle`` to count
                log.exception("KV events from %s: replay failed", self.mirror.engine)

    def _apply(self, frames: Sequence[bytes]) -> None:
        try:
            self.handle(frames)
        except Exception:  # one bad batch must not end the subscription
            log.exception("KV events from %s: failed to apply a batch", self.mirror.engine)

    async def replay(self, first: int, stop: int | None = None) -> int:
        """Fetch batches ``first`` … ``stop - 1`` (None: all it buffers) from the engine's replay socket
        and apply them in order; returns how many were applied (a short replay leaves a gap for
        ``handle`` to count). A subscriber that has seen nothing yet takes the first one it gets."""
        assert self.replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        applied = 0
        try:
            await sock.send_multipart([b"", first.to_bytes(8, "big")])
            while True:
                async with asyncio.timeout(self.REPLAY_TIMEOUT_S):
                    frames = await sock.recv_multipart()
                body = frames[1:] if frames and frames[0] == b"" else frames
                if len(body) != 3 or body[1] == self.END_SEQ:
                    break
                seq = int.from_bytes(body[1], "big")
                if (self.last_seq is None or seq == self.last_seq + 1) and (stop is None or seq < stop):
                    self.handle(body)
                    applied += 1
        except TimeoutError:
            log.warning("KV events from %s: replay from %s timed out", self.mirror.engine,
                        self.replay_endpoint)
        finally:
            sock.close(linger=0)
        self.replayed += applied
        return applied

    def handle(self, frames: Sequence[bytes]) -> None:
        """One multipart message ``[topic, seq, payload]``."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.bad_frames += 1
            log.warning("KV events from %s: ignoring a message of %d frames", self.mirror.engine, len(frames))
            return
        seq = int.from_bytes(frames[1], "big")
        last = self.last_seq
        if self._catching_up and last is not None:
            if seq <= last:  # published while the start-up replay ran: applied from the buffer already
                self.duplicates += 1
                return
            self._catching_up = False
            self._sync_live()
        if last is not None and seq != last + 1:
            if seq <= last:
                self.restarts += 1
                log.warning("KV events from %s: sequence went back %d → %d; publisher restarted, "
                            "resetting its blocks", self.mirror.engine, last, seq)
                self.mirror.reset()
            else:
                self.gaps += 1
                self.missed += seq - last - 1
                log.warning("KV events from %s: missed %d batches (%d → %d); the prefix index may be "
                            "stale for this engine", self.mirror.engine, seq - last - 1, last, seq)
        self.last_seq = seq
        self.mirror.apply_payload(frames[2])
