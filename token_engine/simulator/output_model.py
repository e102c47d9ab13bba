"""Deterministic stand-ins for a model's sampler.

Why deterministic: tests and benchmarks must be able to predict every token. A choice's tokens are a pure
function of (prompt token ids, seed, choice index, temperature, configured mode), never of timing or of
other requests. Mode "context" goes further, like a greedy real model: each token depends only on the
whole context before it, so a request whose prompt is `prompt + first k outputs` continues exactly where
the original would have (what a mid-stream relay relies on). `banned` carries the ids vLLM's min_tokens
logits processor masks (EOS and stop token ids before `min_tokens` tokens exist): the sampler then yields
its next candidate instead, as a real model falls back to its next most likely token.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Protocol

from .config import SimConfig


class TokenSource(Protocol):
    """Per-choice sampler: one call per generated position."""

    def next_token(self, banned: frozenset[int]) -> int: ...


def _mix(*parts: object) -> int:
    """A stable 64-bit seed from arbitrary parts (Python's hash() is salted per process)."""
    digest = hashlib.sha256(repr(parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


class _CycleSource:
    """Cycles a token list from an offset, skipping banned ids; optional EOS after a number of cycles."""

    def __init__(
        self,
        tokens: Sequence[int],
        offset: int,
        eos_token_id: int | None,
        eos_after_cycles: int | None,
        fallback: int,
    ) -> None:
        self._tokens = list(tokens) or [fallback]
        self._pos = offset % len(self._tokens)
        self._emitted_in_cycle = 0
        self._cycles_done = 0
        self._eos = eos_token_id
        self._eos_after = eos_after_cycles
        self._fallback = fallback

    def next_token(self, banned: frozenset[int]) -> int:
        if (
            self._eos is not None
            and self._eos_after is not None
            and self._cycles_done >= self._eos_after
            and self._eos not in banned
        ):
            return self._eos
        for _ in range(len(self._tokens)):
            tok = self._tokens[self._pos]
            self._advance()
            if tok not in banned:
                return tok
        return self._fallback

    def _advance(self) -> None:
        self._pos = (self._pos + 1) % len(self._tokens)
        self._emitted_in_cycle += 1
        if self._emitted_in_cycle >= len(self._tokens):
            self._emitted_in_cycle = 0
            self._cycles_done += 1


class _RandomSource:
    """Seeded uniform ids in [lo, hi), with an optional per-step EOS probability."""

    def __init__(self, seed: int, lo: int, hi: int, eos_token_id: int | None, eos_prob: float) -> None:
        self._rng = random.Random(seed)
        self._lo = lo
        self._hi = hi
        self._eos = eos_token_id
        self._eos_prob = eos_prob

    def next_token(self, banned: frozenset[int]) -> int:
        roll = self._rng.random()
        if self._eos is not None and roll < self._eos_prob and self._eos not in banned:
            return self._eos
        for _ in range(64):
            tok = self._rng.randrange(self._lo, self._hi)
            if tok not in banned:
                return tok
        return next(t for t in range(self._lo, self._hi) if t not in banned)


_MASK64 = (1 << 64) - 1
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


def _fold(state: int, token: int) -> int:
    """One FNV-1a step over a whole token id: the rolling hash of a context extended by `token`."""
    return ((state ^ (token & _MASK64)) * _FNV_PRIME) & _MASK64


def _scramble(x: int) -> int:
    """splitmix64's finaliser: spreads neighbouring hash states over the whole 64-bit range."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class _ContextSource:
    """Each token is a function of the context before it (prompt + tokens emitted so far) and the salt.

    The state is a rolling hash of the context plus the length of its tail after the last special id, both
    updated per emitted token exactly as they are folded over a prompt, so starting from `prompt + out[:k]`
    reaches the same state as emitting `out[:k]` after `prompt`.
    """

    def __init__(
        self,
        prompt: Sequence[int],
        *,
        tokens: Sequence[int],
        special: frozenset[int],
        salt: int,
        eos_token_id: int | None,
        eos_after: int | None,
    ) -> None:
        self._tokens = list(tokens)
        self._special = special
        self._salt = salt
        self._eos = eos_token_id
        self._eos_after = eos_after
        self._hash = _FNV_OFFSET
        self._tail = 0
        for tok in prompt:
            self._push(tok)

    def _push(self, tok: int) -> None:
        self._hash = _fold(self._hash, tok)
        self._tail = 0 if tok in self._special else self._tail + 1

    def next_token(self, banned: frozenset[int]) -> int:
        tok = self._pick(banned)
        self._push(tok)
        return tok

    def _pick(self, banned: frozenset[int]) -> int:
        if (
            self._eos is not None
            and self._eos_after is not None
            and self._tail >= self._eos_after
            and self._eos not in banned
        ):
            return self._eos
        start = _scramble(self._hash ^ self._salt) % len(self._tokens)
        for j in range(len(self._tokens)):  # a banned pick falls back to the next candidate
            tok = self._tokens[(start + j) % len(self._tokens)]
            if tok not in banned:
                return tok
        return self._tokens[start]


def echo_source_tokens(prompt: Sequence[int], config: SimConfig) -> list[int]:
    """What echo mode repeats: the prompt minus its trailing generation prompt and minus special tokens.

    The generation prompt is recognised as a special token among the last `echo_skip_last` tokens (SmolLM2's
    `<|im_start|>assistant\n`); a plain prompt without one is echoed whole.
    """
    skip = set(config.echo_skip_ids)
    cut = len(prompt)
    for i in range(len(prompt) - 1, max(-1, len(prompt) - 1 - config.echo_skip_last), -1):
        if prompt[i] in skip:
            cut = i
            break
    src = [t for t in prompt[:cut] if t not in skip]
    if not src:
        src = [t for t in prompt if t not in skip]
    return src or [config.echo_fallback_token_id]


def script_resume_at(prompt: Sequence[int], script: Sequence[int]) -> int:
    """Where a scripted answer goes on: after the longest start of the script that ends the prompt.

    A relayed stream's prompt is the original prompt plus the tokens already sent, so a scripted
    engine continues the answer like a greedy model would instead of starting it again."""
    for k in range(min(len(prompt), len(script) - 1), 0, -1):
        if list(prompt[-k:]) == list(script[:k]):
            return k
    return 0


def make_source(
    config: SimConfig,
    prompt: Sequence[int],
    *,
    seed: int | None,
    index: int,
    temperature: float,
    script: Sequence[int] | None = None,
) -> TokenSource:
    """The sampler for one choice; `script` (from `extra_args.sim_script`) overrides the configured mode."""
    greedy = temperature < 1e-5
    # Greedy decoding ignores the seed, like a real model; sampled choices differ by index and seed.
    shift = 0 if greedy else index + (seed or 0)
    eos = config.eos_token_id
    if script is not None or config.mode == "script":
        tokens = list(script) if script is not None else list(config.script_tokens)
        if eos is not None:
            tokens.append(eos)
        start = script_resume_at(prompt, tokens)
        return _CycleSource(tokens, start, None, None, config.echo_fallback_token_id)
    if config.mode == "echo":
        src = echo_source_tokens(prompt, config)
        return _CycleSource(src, shift, eos, config.echo_max_cycles, config.echo_fallback_token_id)
    if config.mode == "context":
        salt = _mix(config.seed, None if greedy else seed, 0 if greedy else index)
        return _ContextSource(
            prompt,
            tokens=config.context_tokens,
            special=frozenset(config.echo_skip_ids),
            salt=salt,
            eos_token_id=eos,
            eos_after=config.context_eos_after,
        )
    rng_seed = _mix(config.seed, tuple(prompt), None if greedy else seed, 0 if greedy else index)
    return _RandomSource(rng_seed, config.random_lo, config.random_hi, eos, config.random_eos_prob)


def fake_logprob(token_id: int, rank: int) -> float:
    """A plausible, deterministic log-probability (more negative for worse ranks)."""
    return -round(0.05 * rank + (token_id % 97) / 1000.0, 6)
