"""Chained block hashes over a prompt's final token ids.

A block's hash covers its tokens *and* its parent's hash, so equal hashes mean equal whole prefixes,
exactly like vLLM's prefix cache. The chain is seeded with the model name and ``cache_salt`` so two
models (or two tenants that salt their prompts) never share entries.

Why not vLLM's own hash: it depends on vLLM's build and ``PYTHONHASHSEED``; the coordinator must
compute hashes without vLLM. KV events carry token ids, so the precise index re-hashes them with
this function and both index sources speak one hash space.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

BlockHash = int


def chain_seed(model: str, cache_salt: str | None = None) -> BlockHash:
    """Stable across processes (``hash(str)`` is randomised per process; ints and int tuples are not)."""
    key = f"{model}\0{cache_salt or ''}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big", signed=True)


def next_hash(parent: BlockHash, block: Sequence[int]) -> BlockHash:
    # hash() of an int tuple is deterministic and ~40x faster than a cryptographic digest; a 64-bit
    # collision costs at worst one mis-scored routing decision, never a wrong answer.
    return hash((parent, *block))


def block_hashes(token_ids: Sequence[int], block_size: int, seed: BlockHash) -> list[BlockHash]:
    """Hashes of the full blocks only (engines never cache a partial trailing block)."""
    out: list[BlockHash] = []
    parent = seed
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, *token_ids[start:start + block_size]))
        out.append(parent)
    return out
