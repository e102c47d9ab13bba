"""Prometheus collectors of the coordinator (exposed on /metrics unless switched off)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge


class Metrics:
    def __init__(self, inflight: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        self.inflight = Gauge("coordinator_inflight_requests", "Client requests currently in flight",
                              registry=self.registry)
        self.inflight.set_function(inflight)
        self.engine_inflight = Gauge("coordinator_engine_inflight_requests",
                                     "Requests in flight per engine", ["engine"], registry=self.registry)
