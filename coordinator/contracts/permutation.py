"""The keyed vocabulary permutation an obfuscated deployment shares: the coordinator maps ids with it,
``token_engine.model_prep`` permutes a model copy's rows with it, so both must build the same one.

``KeyedPermutation`` is the reference obfuscator: a keyed pseudo-random permutation of the
vocabulary (Fisher-Yates driven by a keyed BLAKE2b stream). It is *not* encryption: it hides which
token is which from whoever holds only the engine side (ids, weights, KV cache), but token
frequencies survive it. Anyone with the key file can undo it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

MIN_KEY_BYTES = 16
_PERSON = b"llmc-tokperm-v1"  # domain separation: this key stream is used for nothing else


class ObfuscationError(ValueError):
    """An id outside the permuted vocabulary, or a bad key: nothing may pass unmapped."""


@runtime_checkable
class Obfuscator(Protocol):
    """Semantic ↔ physical token ids over ``[0, vocab_size)``; a bijection."""

    @property
    def vocab_size(self) -> int: ...

    def to_physical(self, ids: Sequence[int]) -> list[int]: ...

    def to_semantic(self, ids: Sequence[int]) -> list[int]: ...


class KeyedPermutation:
    """A keyed permutation of ``[0, vocab_size)``; the same key and size always give the same one.

    The key is stretched with BLAKE2b into a 64-byte MAC key; block ``i`` of the random stream is
    ``BLAKE2b(key=k, msg=vocab_size || i)``, read as 64-bit words; Fisher-Yates draws each swap index
    by rejection sampling (no modulo bias). Building takes ~50 ms for a 50k vocabulary; mapping is a
    list lookup per id.
    """

    def __init__(self, vocab_size: int, key: bytes) -> None:
        if vocab_size < 2:
            raise ObfuscationError(f"vocab_size must be at least 2, got {vocab_size}")
        if len(key) < MIN_KEY_BYTES:
            raise ObfuscationError(f"an obfuscation key needs at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        self._size = vocab_size
        mac_key = hashlib.blake2b(key, digest_size=64, person=_PERSON).digest()
        self.fingerprint = hashlib.blake2b(vocab_size.to_bytes(8, "big"), key=mac_key, digest_size=8,
                                           person=b"llmc-tokperm-fp").hexdigest()
        """Names the (key, vocab_size) pair without revealing either: logged by the coordinator and
        written next to an obfuscated model copy, so an operator can see that both sides match."""
        words = _word_stream(mac_key, vocab_size)
        perm = list(range(vocab_size))
        for j in range(vocab_size - 1, 0, -1):
            span = j + 1
            limit = (1 << 64) - (1 << 64) % span
            while True:
                word = next(words)
                if word < limit:
                    break
            r = word % span
            perm[j], perm[r] = perm[r], perm[j]
        inverse = [0] * vocab_size
        for semantic, physical in enumerate(perm):
            inverse[physical] = semantic
        self._physical = perm
        self._semantic = inverse

    @classmethod
    def from_key_file(cls, vocab_size: int, path: str | Path) -> KeyedPermutation:
        """The key is the raw bytes of the file (e.g. ``head -c 32 /dev/urandom > token.key``)."""
        return cls(vocab_size, read_key(path))

    @property
    def vocab_size(self) -> int:
        return self._size

    def to_physical(self, ids: Sequence[int]) -> list[int]:
        return lookup(self._physical, ids)

    def to_semantic(self, ids: Sequence[int]) -> list[int]:
        return lookup(self._semantic, ids)

    def physical_table(self) -> list[int]:
        """``table[semantic] == physical``: what a model copy needs to permute its rows (a copy)."""
        return list(self._physical)

    def __repr__(self) -> str:  # never the key or the table
        return f"KeyedPermutation(vocab_size={self._size}, fingerprint={self.fingerprint})"


def read_key(path: str | Path) -> bytes:
    try:
        key = Path(path).read_bytes()
    except OSError as exc:
        raise ObfuscationError(f"cannot read the obfuscation key file {path}: {exc.strerror}") from exc
    if len(key) < MIN_KEY_BYTES:
        raise ObfuscationError(f"the obfuscation key file {path} holds {len(key)} bytes; "
                               f"at least {MIN_KEY_BYTES} are needed")
    return key


def config_vocab_size(folder: str | Path) -> int | None:
    """``vocab_size`` from a model folder's ``config.json`` (or its text sub-config): the number of
    embedding rows, which is what the permutation must cover on both sides."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for holder in (config, config.get("text_config"), config.get("llm_config")):
        size = holder.get("vocab_size") if isinstance(holder, dict) else None
        if type(size) is int and size > 0:
            return size
    return None


def _word_stream(mac_key: bytes, vocab_size: int) -> Any:
    counter = 0
    prefix = vocab_size.to_bytes(8, "big")
    while True:
        block = hashlib.blake2b(prefix + counter.to_bytes(8, "big"), key=mac_key, digest_size=64).digest()
        counter += 1
        for i in range(0, 64, 8):
            yield int.from_bytes(block[i:i + 8], "big")


def lookup(table: list[int], ids: Sequence[int]) -> list[int]:
    if not ids:
        return []
    low, high = min(ids), max(ids)
    if low < 0 or high >= len(table):
        bad = low if low < 0 else high
        raise ObfuscationError(f"token id {bad} is outside the obfuscated vocabulary [0, {len(table)})")
    return [table[i] for i in ids]
