"""The pod's KV indexer protocol: coordinator workers ↔ the indexer process (docs/scheduling.md, "The
pod's KV index").

One connection per worker, over a Unix socket in the pod or TCP to a shared indexer service. Each
message is a 4-byte big-endian length and one msgpack map tagged by ``op``. The indexer handles a
connection's messages in the order they arrive, so a lesson (``Learn``) sent before a ``Match`` is in
that match's answer: a worker never misses its own routing.

Why not HTTP: a match is asked for on every routing decision, ~0.1 ms of work; an HTTP exchange would
cost more than the match. Why not pickle: the service mode listens on TCP, and unpickling what a
network peer sent runs its code.
"""

from __future__ import annotations

import struct
from urllib.parse import urlsplit

import msgspec

MAX_FRAME = 64 << 20  # 100k-token prompts are 6,250 hashes (~56 KiB); anything near this is garbage
_HEAD = struct.Struct(">I")


# -- worker → indexer ---------------------------------------------------------------------------------

class Attach(msgspec.Struct, tag_field="op", tag="attach"):
    """Mirror ``engine``'s KV events (idempotent; a changed endpoint or model replaces the feed)."""

    engine: str
    endpoint: str
    model: str                       # seeds the hash chain of the engine's root runs
    replay: str | None = None        # vLLM's replay ROUTER: gaps and a fresh start are filled from it


class Detach(msgspec.Struct, tag_field="op", tag="detach"):
    """Stop mirroring ``engine`` (it stopped publishing, or left the fleet)."""

    engine: str


class Forget(msgspec.Struct, tag_field="op", tag="forget"):
    """``engine`` left or lost its cache: nothing is cached there any more."""

    engine: str


class Learn(msgspec.Struct, tag_field="op", tag="learn"):
    """A routing decision's lesson: ``engine`` holds (or is about to hold) this chain."""

    engine: str
    hashes: list[int]
    cold: bool = False   # nothing of the chain was cached anywhere: the decision founded a new prefix


class Match(msgspec.Struct, tag_field="op", tag="match"):
    """Which engines hold how much of this chain (``id`` pairs the answer with the question)."""

    id: int
    hashes: list[int]


class Status(msgspec.Struct, tag_field="op", tag="status"):
    id: int


Request = Attach | Detach | Forget | Learn | Match | Status


# -- indexer → worker ---------------------------------------------------------------------------------

class EngineMatch(msgspec.Struct, array_like=True):
    engine: str
    blocks: int        # leading blocks of the chain the engine holds
    continues: bool    # the match ends at a leaf or covers the chain: the request extends its own chain
    tiers: dict[str, int] = {}  # offload tier → leading blocks held there (0 ``blocks``: only there)


class Matched(msgspec.Struct, tag_field="op", tag="matched"):
    id: int
    engines: list[EngineMatch]
    # Routing decisions per engine over the bounded-load window, from every connection's lessons: the
    # pod-wide shares the ``bounded_load`` picker bounds (each worker alone sees only its own).
    recent: dict[str, int] = {}
    founded: dict[str, int] = {}    # ... of which were cold (``Learn.cold``)


class Stats(msgspec.Struct, tag_field="op", tag="stats"):
    """What ``/ready`` shows of the indexer."""

    id: int
    source: str                       # approximate | precise
    engines: int                      # engines the index holds blocks of
    blocks: int                       # blocks indexed over all engines
    feeds: int                        # engines whose KV events it mirrors
    batches: int                      # KV-event batches applied
    blocks_stored: int                # engine blocks placed by those batches
    gaps: int                         # sequence gaps (lost batches) seen
    replayed: int                     # batches fetched from replay sockets
    started_at: float                 # the indexer process's start (wall clock): a restart shows here
    pid: int                          # the indexer's process id
    tier_blocks: dict[str, int] = {}  # blocks indexed per offload tier, over all engines


Reply = Matched | Stats


# -- framing --------------------------------------------------------------------------------------------

_requests = msgspec.msgpack.Decoder(Request)
_replies = msgspec.msgpack.Decoder(Reply)
_encoder = msgspec.msgpack.Encoder()


def frame(message: Request | Reply) -> bytes:
    body = _encoder.encode(message)
    return _HEAD.pack(len(body)) + body


def frame_size(head: bytes) -> int:
    """The body's length from a frame's 4-byte head; raises ``ValueError`` past ``MAX_FRAME``."""
    (size,) = _HEAD.unpack(head)
    if size > MAX_FRAME:
        raise ValueError(f"indexer frame of {size} bytes is over the {MAX_FRAME}-byte limit")
    return int(size)


def decode_request(body: bytes) -> Request:
    """Raises ``msgspec.DecodeError``/``ValidationError`` for a malformed or unknown message."""
    return _requests.decode(body)


def decode_reply(body: bytes) -> Reply:
    return _replies.decode(body)


HEAD_SIZE = _HEAD.size


def parse_address(address: str) -> tuple[str, str, int]:
    """``unix:/path`` → ("unix", path, 0); ``tcp://host:port`` → ("tcp", host, port)."""
    if address.startswith("unix:"):
        return "unix", address.removeprefix("unix:").removeprefix("//"), 0
    parts = urlsplit(address)
    if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
        raise ValueError(f"indexer address {address!r} is neither unix:/path nor tcp://host:port")
    return "tcp", parts.hostname, parts.port
