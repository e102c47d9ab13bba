"""What the scheduler and admission see of one engine request: no HTTP, no OpenAI body."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from coordinator.contracts.hashing import Media
from coordinator.pipeline.engines.capabilities import NATIVE_API, NO_NEEDS, Capability
from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.scheduling.prefix.memory import PrefixView


@dataclass
class SchedRequest:
    request_id: str
    model: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    n: int = 1
    priority: int = 0                  # lower = sooner (vLLM's convention), within its tenant
    tenant: str = "default"            # whose share and limits it counts against
    cache_salt: str | None = None
    exclude: set[str] = field(default_factory=set)   # engine urls this request already failed on
    engine_deaths: int = 0                            # attempts whose engine died under this request
    block_hashes: list[int] | None = None             # from render, else filled once by the scheduler
    hashes_counted: bool = False                      # its hashes' source is on /metrics already
    needs: frozenset[Capability] = NO_NEEDS          # only engines that can all of these (capabilities.py)
    scores_prompt: bool = False                       # prompt logprobs: one engine computes the whole prompt
    lora: str | None = None                           # its LoRA adapter (engines must hold or load it)
    media: Media = ()                                 # its images, for media-aware block hashes
    prefix_view: PrefixView | None = None             # the pod indexer's match, asked before placing

    @property
    def native_api(self) -> bool:
        """The native route: union engines with their OpenAI API only."""
        return NATIVE_API in self.needs

    @property
    def hash_seed_name(self) -> str:
        """What seeds its block hashes: an adapter run's KV is its own (vLLM keys blocks by LoRA name)."""
        return self.lora or self.model

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def cost_tokens(self) -> int:
        """What admission reserves: the most KV the request can occupy (prompt + every output token)."""
        return self.prompt_tokens + self.max_tokens * self.n


@dataclass
class Placement:
    """Engines chosen for one request and the tokens reserved on each (two for a P/D handoff)."""

    engine: Engine                 # the engine that decodes (and prefills, in union)
    prefill: Engine | None = None  # a P/D handoff's prefill engine (trigger: set once the decode calls back)
    matched_tokens: int = 0        # prompt tokens ``engine`` already holds, per the prefix index
    trigger: bool = False          # a trigger P/D pair: decode first, prefill chosen at its callback

    @property
    def engines(self) -> list[Engine]:
        return [self.engine] if self.prefill is None else [self.prefill, self.engine]

