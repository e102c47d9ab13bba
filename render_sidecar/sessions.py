"""The sidecar's memory of live parser streams: one entry per prompt/choice stream, bounded.

Why: vLLM's stateless streaming derender cannot put a tool or reasoning parser into ``stream_state``,
so every call builds a fresh parser and replays the whole answer through it (O(n) per call, O(n²)
per answer). Native ``vllm serve`` keeps one parser per stream in memory. This cache does the same
for the streams this sidecar serves, without making the sidecar stateful in any way a client can
observe: an entry is used only when the call's ``stream_state`` is *exactly* the state the entry's
last call returned (and the call carries the same request options), so any other call (another
sidecar served the stream, a restart, an eviction, a rolled-back attempt) replays as vLLM does.

An entry is taken out of the cache while its call runs (two calls for one state never share a
parser) and put back with the new state when the call succeeded; a failed call drops it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# What a held session costs, roughly (CPython 3.11, measured with tracemalloc on SmolLM2 streams): a
# list slot plus an int object per token id held (prompt ids, the state's and the parser's copies of
# the output ids), a couple of bytes per character of text the parser keeps, the encoded state, and
# a fixed part for the parser and detokenizer objects.
BYTES_PER_PROMPT_ID = 40
BYTES_PER_OUTPUT_ID = 3 * 40
BYTES_PER_TEXT_CHAR = 4
BYTES_FIXED = 8 * 1024


def estimate_bytes(prompt_ids: int, output_ids: int, text_chars: int, state_bytes: int) -> int:
    return (BYTES_FIXED + BYTES_PER_PROMPT_ID * prompt_ids + BYTES_PER_OUTPUT_ID * output_ids
            + BYTES_PER_TEXT_CHAR * text_chars + state_bytes)


StreamKey = tuple[str, int]  # (the generate chunk's request_id, the choice index)


@dataclass(eq=False)
class Session:
    """One stream's live parser and detokenizer, and the state its last call returned."""

    key: StreamKey
    parser: Any                      # a vllm.parser.Parser, advanced to ``state``
    detok: Any                       # DerenderStreamState of the incremental detokenizer (window only)
    state: Any                       # DerenderStreamState the last call returned
    state_json: bytes                # ``state`` as sent to the client, for an exact comparison
    options_json: bytes              # the call's ``chat_request`` as received (the parser was built for it)
    chat_request: Any                # that request, parsed once
    model: str | None                # the call's ``model`` (checked against the served names once)
    prompt_token_ids: list[int]
    text_chars: int = 0
    nbytes: int = 0
    last_used: float = field(default=0.0)


class SessionCache:
    """LRU over streams, bounded by entries and by estimated bytes, with an idle TTL.

    ``take`` removes and returns an entry; ``put`` stores one (evicting what the bounds require).
    The counters are plain ints so the cache knows nothing of Prometheus (``metrics.py`` reads them).
    """

    def __init__(self, max_entries: int, max_bytes: int, idle_ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.idle_ttl_s = idle_ttl_s
        self._clock = clock
        self._entries: OrderedDict[StreamKey, Session] = OrderedDict()
        self.resident_bytes = 0
        self.hits = 0
        self.misses: dict[str, int] = {"absent": 0, "state_mismatch": 0}
        self.evictions: dict[str, int] = {"entries": 0, "bytes": 0, "idle": 0}
        self.finished = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: StreamKey) -> bool:
        return key in self._entries

    def take(self, key: StreamKey) -> Session | None:
        session = self._entries.pop(key, None)
        if session is not None:
            self.resident_bytes -= session.nbytes
        return session

    def put(self, session: Session) -> None:
        """Store ``session`` as the most recently used entry; a session larger than the whole byte
        bound is not kept (its stream replays on the next call, as without a cache)."""
        now = self._clock()
        self._expire(now)
        self.take(session.key)  # a stale entry of the same stream: the newer call's state wins
        if session.nbytes > self.max_bytes:
            self.evictions["bytes"] += 1
            return
        session.last_used = now
        self._entries[session.key] = session
        self.resident_bytes += session.nbytes
        while len(self._entries) > self.max_entries:
            self._evict("entries")
        while self.resident_bytes > self.max_bytes:
            self._evict("bytes")

    def expire(self) -> None:
        self._expire(self._clock())

    def _expire(self, now: float) -> None:
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if now - oldest.last_used < self.idle_ttl_s:
                return
            self._evict("idle")

    def _evict(self, reason: str) -> None:
        _, session = self._entries.popitem(last=False)
        self.resident_bytes -= session.nbytes
        self.evictions[reason] += 1
