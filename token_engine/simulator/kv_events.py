"""KV cache events in vLLM 0.32's wire format, published on a ZMQ PUB socket like `ZmqEventPublisher`.

Why: KV-aware routers learn what each engine has cached from `--kv-events-config` events rather than by
guessing; the simulator publishes the same messages so such a router can be built and tested without
vLLM. The structs are the wire contract the coordinator reads too (`coordinator.contracts.kv_events`,
copied from `vllm/distributed/kv_events.py` field for field), so vLLM's own
`msgspec.msgpack.Decoder(type=KVEventBatch)` decodes them. This module never imports vLLM.

Wire: every batch is a multipart message `[topic, seq, payload]`: `topic` is the UTF-8 topic, `seq` an
8-byte big-endian counter starting at 0, `payload` the msgpack `KVEventBatch` `[ts, [events...], 0]`
(data parallel rank 0). Endpoints follow vLLM's rule: an endpoint containing `*` or `::` (or an
ipc/inproc one) is bound, any other (`tcp://host:port`) is connected to. An optional ROUTER replay
socket answers `[identity, b"", start_seq]` with every buffered batch from `start_seq` on, each as
`[identity, b"", topic, seq, payload]`, then `[identity, b"", b"", END_SEQ, b""]`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from itertools import count

import msgspec
import zmq

from coordinator.contracts.kv_events import END_SEQ, EventBatch, KVEvent, KVEventBatch, is_bind_endpoint

logger = logging.getLogger(__name__)


class ZmqEventPublisher:
    """Publishes `KVEventBatch`es from a daemon thread that owns the sockets (they are not thread-safe).

    `publish()` never blocks the caller (the server's event loop): batches go through a bounded queue and
    are dropped, and counted in `dropped`, when it is full.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        *,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        data_parallel_rank: int = 0,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self.published = 0
        self.dropped = 0
        self._topic_bytes = topic.encode("utf-8")
        self._hwm = hwm
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = count()
        self._running = True
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sim-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(10.0)
        if self._startup_error is not None:
            self._running = False
            raise self._startup_error

    # ------------------------------------------------------------------ caller side

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one batch (one simulated scheduler step's events)."""
        if not events or not self._running:
            return
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then close the sockets; idempotent."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ publisher thread

    def _bind(self, sock: zmq.Socket[bytes], endpoint: str) -> str:
        sock.bind(endpoint)
        bound: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return bound.replace("0.0.0.0", "127.0.0.1")  # a connectable address for /sim/state

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        pub: zmq.Socket[bytes] | None = None
        replay: zmq.Socket[bytes] | None = None
        try:
            pub = ctx.socket(zmq.PUB)
            pub.set_hwm(self._hwm)
            if is_bind_endpoint(self.endpoint):
                self.endpoint = self._bind(pub, self.endpoint)
            else:
                pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                self.replay_endpoint = self._bind(replay, self.replay_endpoint)
        except BaseException as e:  # surfaced to the constructor
            self._startup_error = e
            for s in (pub, replay):
                if s is not None:
                    s.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        encoder = msgspec.msgpack.Encoder()
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if batch is None:
                    break
                seq = next(self._seq)
                payload = encoder.encode(batch)
                try:
                    pub.send_multipart((self._topic_bytes, seq.to_bytes(8, "big"), payload))
                except zmq.ZMQError:
                    logger.exception("KV event publish failed")
                    continue
                self._buffer.append((seq, payload))
                self.published += 1
        finally:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _serve_replay(self, replay: zmq.Socket[bytes]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("invalid KV event replay request: %s", frames)
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                replay.send_multipart((client, b"", self._topic_bytes, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))
