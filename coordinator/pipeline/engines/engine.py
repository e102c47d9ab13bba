"""One engine as the coordinator knows it: identity, role and capabilities from config, what it has
in flight, its breaker and the engine's own telemetry, and the state they add up to. The registry
(``registry.py``) owns the set of them and is the only one that changes state inputs; scheduling
plugins read an engine through ``scheduling/types.py``'s ``EngineView``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from coordinator.config import EngineRole, PdProtocol
from coordinator.pipeline.engines.adapters import Residency
from coordinator.pipeline.engines.breaker import CircuitBreaker
from coordinator.pipeline.engines.capabilities import NATIVE_API, TOKENIZER, Capability
from coordinator.pipeline.engines.telemetry import Telemetry

EngineState = Literal["healthy", "unhealthy", "draining"]


@dataclass(eq=False)
class Engine:
    url: str
    role: EngineRole
    model: str | None
    weight: float
    token_budget: int
    breaker: CircuitBreaker
    kv_events: str | None = None
    kv_events_replay: str | None = None
    native_api: bool | None = None   # configured: serves the OpenAI API (native route); None = as learned
    learned_native_api: bool | None = None  # asked of the engine (capabilities.py); None = not known yet
    max_model_len: int | None = None  # configured when shorter than the model's
    pd_protocol: PdProtocol = "handoff"  # how a prefill/decode engine pairs up (config.py)
    tokenizer: bool | None = None    # configured: loads a tokenizer (grammars, bad_words); None = as learned
    learned_tokenizer: bool | None = None  # asked of the engine (capabilities.py); None = not known yet
    abort_route: bool | None = None  # serves /inference/v1/abort_requests; learned from its first answer
    api_key: str | None = None       # the coordinator's bearer token for an engine run with --api-key
    vllm_version: str | None = None  # its GET /version (versions.py); None = not said
    version_learned: bool = False    # asked and answered (with a version or without)
    refused: str | None = None       # why its vLLM line cannot be used (versions.py); None = usable
    inflight_requests: int = 0
    inflight_tokens: int = 0
    telemetry: Telemetry = field(default_factory=Telemetry)
    adapters: Residency = field(default_factory=Residency)  # LoRA adapters it holds (adapters.py)
    # Inputs of ``state`` (set them through the registry, which publishes and announces changes):
    drain_requested: bool = False    # config ``drain: true`` or ``drain(url)``
    removed: bool = False            # gone from config/discovery: dropped once idle
    probe_ok: bool | None = None     # last health verdict; None = not probed yet (counts as healthy)
    probe_timeouts: int = 0          # consecutive probes that got no answer in time

    def serves(self, model: str) -> bool:
        return self.model is None or self.model == model

    def can(self, capability: Capability) -> bool:
        """Whether the engine can run what ``capability`` names (capabilities.py). Not known yet
        counts as no: a constrained request must never reach an engine that would drop or refuse it."""
        if capability == NATIVE_API:
            return self.native_api if self.native_api is not None else self.learned_native_api is True
        if capability == TOKENIZER:
            return self.tokenizer if self.tokenizer is not None else self.learned_tokenizer is True
        return False

    @property
    def learning(self) -> bool:
        """Some capability is neither configured nor learned yet (the registry asks the engine)."""
        return ((self.tokenizer is None and self.learned_tokenizer is None)
                or (self.native_api is None and self.learned_native_api is None)
                or not self.version_learned)

    def forget_learned(self) -> None:
        """The engine went away: it may come back started with other flags, so ask again then."""
        self.learned_tokenizer = self.learned_native_api = self.abort_route = None
        self.vllm_version = self.refused = None
        self.version_learned = False
        self.adapters.forget()

    def credentials(self) -> dict[str, str]:
        """The coordinator's ``Authorization`` header for an engine run with ``--api-key`` (never a
        client's key); empty for one without."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def can_all(self, needs: frozenset[Capability]) -> bool:
        return all(self.can(c) for c in needs)

    @property
    def state(self) -> EngineState:
        """Draining wins over health, so a good probe never puts a draining engine back in rotation;
        not probed yet counts as healthy (optimistic until the first probe says otherwise)."""
        if self.removed or self.drain_requested:
            return "draining"
        return "unhealthy" if self.probe_ok is False or self.refused is not None else "healthy"

    @property
    def healthy(self) -> bool:
        # ``state == "healthy"`` spelled out: read for every engine on every scheduling decision.
        return (self.probe_ok is not False and not self.removed and not self.drain_requested
                and self.refused is None)

    @property
    def draining(self) -> bool:
        return self.state == "draining"

    @property
    def available(self) -> bool:
        """Can take a new request now: healthy, not draining, breaker lets it through."""
        return self.healthy and self.breaker.available()
