"""Chained block hashes over a prompt's final token ids.

A block's hash identifies its tokens *and* every block before it, so equal hashes mean equal whole
prefixes, exactly like vLLM's prefix cache. The chain is seeded with the model name and
``cache_salt`` so two models (or two tenants that salt their prompts) never share entries.

The chain is a running sum modulo 2**64: block ``k``'s hash is the parent's plus ``hash((k, *block))``,
as a signed 64-bit integer. A sum (not ``hash((parent, *block))``) lets the whole prompt be hashed in
C-level passes — ``zip`` cuts the ids into blocks, ``map(hash)`` hashes them, NumPy's ``cumsum``
chains them — with no Python bytecode per block: ~2x faster at 2k tokens and at 100k, where a
per-block loop was half of a decision. The block's position inside the tuple keeps the sum
order-sensitive (swapping two blocks changes it). Wrapping at 64 bits costs nothing (int64 addition
wraps) and keeps every hash one machine word: msgpack carries it to the pod's indexer process as is
(an unbounded sum reached 70 bits at 100k tokens, which msgpack cannot encode). ``next_hash`` is the
same chain one block at a time, the reference the bulk form is tested against. A text prompt's chain
(no media) is one C loop when the package was built with its extension (``_chain.c``: the same
arithmetic, CPython's tuple hash included; 3-7x faster, which the KV-event intake and 100k-token
decisions feel); ``NATIVE_CHAIN`` says whether it was, and the Python form is the fallback.

Why not vLLM's own hash: it depends on vLLM's build and ``PYTHONHASHSEED``; the coordinator must
compute hashes without vLLM. KV events carry token ids, so the precise index re-hashes them with
this function and both index sources speak one hash space. ``hash()`` of an int tuple is
deterministic and far cheaper than a digest; a 64-bit collision costs at worst one mis-scored
routing decision, never a wrong answer.

**Images** (docs/multimodal.md): every image of a prompt has the same placeholder tokens, so token ids
alone would match a conversation about one photo with one about another. vLLM keys each block by the
media items in it; here a block's term also covers ``(digest of the item's hash, its offset in the
block)`` for every item whose placeholder *starts* in that block. The chain carries it into every
later block, so two prompts share a prefix exactly when vLLM's would (same tokens, same media at the
same places); and the start is all a KV event tells (vLLM publishes ``[mm_hash, offset]`` per block,
the offset negative in the blocks an item continues into), so the precise index hashes engine blocks
the same way at any index block size dividing the engine's.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from itertools import count
from typing import Any

import numpy as np

PURE_PYTHON = os.environ.get("LLMC_PURE_PYTHON") == "1"
"""The optional C extensions are off (this chain's, the prefix index's and its KV-event mirror's):
``perf.scheduler_latency`` runs its pure-Python baseline so; a spawned process reads it on import."""

_native_chain: Callable[[Sequence[int], int, int, int], list[int]] | None
try:
    if PURE_PYTHON:
        raise ImportError("LLMC_PURE_PYTHON=1")
    from coordinator.contracts._chain import chain as _native_chain
except ImportError:  # built without a C compiler: the same hashes, computed in Python
    _native_chain = None

NATIVE_CHAIN = _native_chain is not None
"""Whether text chains are hashed by the C extension (``_chain.c``)."""

BlockHash = int
Media = Sequence[tuple[int, int]]
"""A prompt's media items as ``(placeholder offset in the token ids, media_digest(its hash))``, by offset."""


def chain_seed(model: str, cache_salt: str | None = None) -> BlockHash:
    """Stable across processes (``hash(str)`` is randomised per process; ints and int tuples are not)."""
    key = f"{model}\0{cache_salt or ''}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big", signed=True)


def media_digest(identifier: str) -> int:
    """A media item's hash (render's ``mm_hashes``, the engine's identifier) as a stable 64-bit int."""
    return int.from_bytes(hashlib.blake2b(identifier.encode(), digest_size=8).digest(), "big", signed=True)


def next_hash(parent: BlockHash, depth: int, block: Sequence[int], media: Sequence[int] = ()) -> BlockHash:
    """The hash of the block at ``depth`` (0 = the prompt's first) whose parent hashes to ``parent``
    (the seed for the first block); ``media``: ``digest, offset in the block`` of each item starting
    in it, flat."""
    return _wrap(parent + hash((depth, *block, *media)))


def _wrap(h: int) -> int:
    """``h`` as a signed 64-bit integer (the chain's arithmetic)."""
    return (h + 2**63) % 2**64 - 2**63


def block_hashes(token_ids: Sequence[int], block_size: int, seed: BlockHash,
                 start: int = 0, media: Media = ()) -> list[BlockHash]:
    """Hashes of the full blocks only (engines never cache a partial trailing block). ``start``: the
    depth of the first block, when ``token_ids`` continue a chain whose last hash is ``seed``."""
    if not media and _native_chain is not None:
        out: list[BlockHash] = _native_chain(token_ids, block_size, seed, start)
        return out
    return _block_hashes(token_ids, block_size, seed, start, media)


def _block_hashes(token_ids: Sequence[int], block_size: int, seed: BlockHash,
                  start: int = 0, media: Media = ()) -> list[BlockHash]:
    """``block_hashes`` in Python: media, and the fallback (and reference) of the C loop."""
    n = len(token_ids) // block_size
    if n <= 0:
        return []
    blocks = zip(count(start), *[iter(token_ids)] * block_size)  # a trailing partial block is dropped
    terms = np.fromiter(map(hash, blocks), dtype=np.int64, count=n)
    if media:
        keys: dict[int, list[int]] = {}
        for offset, digest in media:
            b = offset // block_size
            if 0 <= b < n:
                keys.setdefault(b, []).extend((digest, offset - b * block_size))
        for b, flat in keys.items():
            terms[b] = hash((start + b, *token_ids[b * block_size:(b + 1) * block_size], *flat))
    np.cumsum(terms, out=terms)         # int64: wraps, as ``next_hash`` does
    terms += np.int64(seed)
    hashes: list[BlockHash] = terms.tolist()
    return hashes


def prompt_media(features: Mapping[str, Any] | None) -> list[tuple[int, int]]:
    """``Media`` of a rendered prompt, from its GenerateRequest's ``features`` (empty for text)."""
    if not features:
        return []
    hashes = features.get("mm_hashes") or {}
    out = [(int(p["offset"]), media_digest(h))
           for modality, ranges in (features.get("mm_placeholders") or {}).items()
           for p, h in zip(ranges, hashes.get(modality) or (), strict=False)]
    out.sort()
    return out
