"""What a scheduling plugin sees of an engine, and the plugin faces.

Filters, scorers and pickers are typed against ``EngineView``, a read-only protocol, not the
registry's ``Engine``: a plugin can read what it needs to decide (identity, load, the engine's own
telemetry, what it can run) and can change nothing (breaker, drain, membership stay the registry's).
The registry's ``Engine`` satisfies it, and so can a test's or a benchmark's plain object. The
plugins are generic in the engine type, so a picker hands back the very object it was given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from coordinator.pipeline.engines.capabilities import Capability
from coordinator.pipeline.scheduling.prefix.memory import PodShares
from coordinator.pipeline.scheduling.request import SchedRequest


class TelemetryView(Protocol):
    """The engine's own report of its load (its ``/metrics``); None: not known yet."""

    @property
    def waiting(self) -> int | None: ...
    @property
    def kv_usage(self) -> float | None: ...


class AdapterView(Protocol):
    """Which LoRA adapters the engine holds (``engines/adapters.py``'s ``Residency``)."""

    def holds(self, name: str) -> bool: ...
    def is_loading(self, name: str) -> bool: ...
    def running(self, name: str) -> int: ...
    @property
    def free_slots(self) -> int: ...
    def evictable(self) -> str | None: ...


class EngineView(Protocol):
    @property
    def url(self) -> str: ...
    @property
    def model(self) -> str | None: ...
    @property
    def inflight_tokens(self) -> int: ...
    @property
    def token_budget(self) -> int: ...
    @property
    def telemetry(self) -> TelemetryView: ...
    @property
    def adapters(self) -> AdapterView: ...

    def can_all(self, needs: frozenset[Capability]) -> bool: ...


E = TypeVar("E", bound=EngineView)


@dataclass
class ScoringInput:
    """Facts computed once per decision and shared by every scorer."""

    req: SchedRequest
    matched_blocks: dict[str, int]  # engine url → leading prompt blocks it holds (prefix index)
    block_size: int
    continuing: frozenset[str] = frozenset()  # engines where the request extends its own chain
    offloaded: dict[str, float] = field(default_factory=dict)  # engine url → weighted blocks past those,
    #                                                              held only in its offload tiers
    pod_shares: PodShares | None = None  # the whole pod's recent decisions per engine (its indexer);
    #                                      None: this process's own are all it knows

    @property
    def cold(self) -> bool:
        """No engine holds any of the prompt, in its cache or an offload tier."""
        return not self.matched_blocks and not self.offloaded

    def matched_tokens(self, engine: EngineView) -> int:
        n = self.matched_blocks.get(engine.url)
        return 0 if n is None else min(n * self.block_size, self.req.prompt_tokens)

    def offloaded_tokens(self, engine: EngineView) -> float:
        """Tokens past ``matched_tokens`` held in the engine's offload tiers, by their tiers' weights."""
        extra = self.offloaded.get(engine.url)
        if not extra:
            return 0.0
        return min(extra * self.block_size, self.req.prompt_tokens - self.matched_tokens(engine))


class Filter(Protocol):
    """Drops the engines that must not take this request now."""

    name: str

    def __call__(self, req: SchedRequest, engines: Sequence[E], tokens: int) -> list[E]: ...


class Scorer(Protocol):
    """Rates each engine in [0, 1]; the scheduler sums the scores with their configured weights."""

    name: str

    def __call__(self, data: ScoringInput, engines: Sequence[EngineView]) -> list[float]: ...


class Picker(Protocol):
    """Chooses one engine from the scored ones."""

    name: str

    def __call__(self, engines: Sequence[E], scores: Sequence[float], data: ScoringInput) -> E: ...
