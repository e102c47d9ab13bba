"""vLLM 0.32's KV cache events on the wire: what an engine started with ``--kv-events-config`` publishes
and what the coordinator's precise prefix index reads.

The structs copy ``vllm/distributed/kv_events.py`` field for field (names, order, defaults,
``tag=True`` / ``array_like=True`` / ``omit_defaults=True``), so vLLM's own
``msgspec.msgpack.Decoder(type=KVEventBatch)`` decodes what the simulator publishes and the
coordinator decodes what vLLM publishes, without either importing vLLM (the coordinator ships without
it). ``tests/unit/test_simulator_kv_events.py`` holds them to vLLM's.

Wire: every batch is a multipart message ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian
counter, ``payload`` the msgpack ``KVEventBatch`` ``[ts, [events...], data_parallel_rank]``. A replay
socket answers ``[identity, b"", start_seq]`` with the buffered batches, then ``END_SEQ``.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import msgspec

ExternalBlockHash: TypeAlias = bytes | int
"""vLLM publishes sha256 bytes, or (the default, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`) their low 64
bits as an int."""

MEDIUM_GPU = "GPU"
"""The label of an engine's own KV pool, on every platform (vLLM's ``BlockPool``)."""
MEDIUM_CPU = "CPU"
"""An offloading connector's CPU-memory tier (vLLM's ``OffloadingConnector``)."""
MEDIUM_STORAGE = "STORAGE"
"""An offloading connector's disk or object-store tier."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events: each encodes as a map whose `"type"` is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]


def external_hash(block_hash: bytes, as_int: bool) -> ExternalBlockHash:
    """vLLM's `maybe_convert_block_hash`: the raw hash, or its low 64 bits as an int."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1) if as_int else block_hash


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
