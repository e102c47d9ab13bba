"""What one engine call's outcome does to the pool: breaker feeding, retry steering, release.

The token-only dispatcher and the native route both call engines; they share these rules so an
engine is judged the same whichever API a request used.
"""

from __future__ import annotations

import asyncio

from coordinator.observability.metrics import Metrics
from coordinator.pipeline.admission.controller import Grant
from coordinator.pipeline.engines.client import EngineUnreachable
from coordinator.pipeline.engines.registry import Engine, EngineRegistry
from coordinator.pipeline.errors import (
    TokenRouteMissing,
    UpstreamClientError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from coordinator.pipeline.scheduling.request import SchedRequest


def record_failure(registry: EngineRegistry, metrics: Metrics | None, engine: Engine,
                   exc: BaseException, req: SchedRequest) -> None:
    """Feed ``engine``'s breaker with a failed call and steer a retry of ``req`` away from it.

    A client error is a success for the engine (it answered; the request was at fault); a missing
    token route is too, but the request must try elsewhere; a cancelled call judges nothing."""
    if isinstance(exc, asyncio.CancelledError):
        registry.release_trial(engine)
    elif isinstance(exc, UpstreamClientError):
        registry.record_success(engine)
    elif isinstance(exc, TokenRouteMissing):
        req.exclude.add(engine.url)  # healthy, but serves only the OpenAI API (the native route may)
        registry.record_success(engine)
    elif isinstance(exc, UpstreamUnavailable | UpstreamTimeout):
        req.exclude.add(engine.url)
        if metrics is not None:
            metrics.engine_failures.labels(engine.url).inc()
        if isinstance(exc, EngineUnreachable):
            registry.mark_failed(engine)
        else:
            registry.record_failure(engine)


def release(registry: EngineRegistry, grant: Grant) -> None:
    """Give the grant's budget back; a removed engine leaves the pool once its last request ends."""
    grant.release()
    for engine in grant.placement.engines:
        registry.on_idle(engine)
