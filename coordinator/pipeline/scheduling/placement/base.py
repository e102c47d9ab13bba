"""What a placement rule may ask of the scheduler."""

from __future__ import annotations

from typing import Protocol

from coordinator.config import EngineRole, PdProtocol, TopologySettings
from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.scheduling.request import Placement, SchedRequest
from coordinator.pipeline.scheduling.types import ScoringInput


class Placer(Protocol):
    @property
    def topology(self) -> TopologySettings: ...

    def choose(self, data: ScoringInput, role: EngineRole, tokens: int) -> Engine | None:
        """The engine of ``role`` filters, scorers and picker choose; None: none has room now;
        raises ``NoHealthyEngine`` when the role has no engine for the model at all."""

    def commit(self, data: ScoringInput, placement: Placement, path: str) -> Placement:
        """Record the decision (breakers, learning, metrics under ``path``) and return it."""

    def eligible(self, model: str, role: EngineRole) -> list[Engine]: ...

    def routable(self, req: SchedRequest, role: EngineRole) -> bool:
        """A healthy engine of ``role`` that its breaker lets through and this request has not failed on."""

    def pd_protocol(self, model: str) -> PdProtocol: ...
