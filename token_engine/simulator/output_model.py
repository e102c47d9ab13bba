"""Deterministic stand-ins for a model's sampler.

Why deterministic: tests and benchmarks must be able to predict every token. A choice's tokens are a pure
function of (prompt token ids, seed, choice index, temperature, configured mode), never of timing or of
other requests. `banned` carries the ids vLLM's min_tokens logits processor masks (EOS and stop token ids
before `min_tokens` tokens exist): the sampler then yields its next candidate instead, as a real model
falls back to its next most likely token.
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
        return _CycleSource(tokens, 0, None, None, config.echo_fallback_token_id)
    if config.mode == "echo":
        src = echo_source_tokens(prompt, config)
        return _CycleSource(src, shift, eos, config.echo_max_cycles, config.echo_fallback_token_id)
    rng_seed = _mix(config.seed, tuple(prompt), None if greedy else seed, 0 if greedy else index)
    return _RandomSource(rng_seed, config.random_lo, config.random_hi, eos, config.random_eos_prob)


def fake_logprob(token_id: int, rank: int) -> float:
    """A plausible, deterministic log-probability (more negative for worse ranks)."""
    return -round(0.05 * rank + (token_id % 97) / 1000.0, 6)
