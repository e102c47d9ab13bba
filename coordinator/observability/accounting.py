"""What the coordinator holds right now, for leak checks: ``GET /admin/accounting`` and gauges.

Every count here must return to zero once no request is in flight; a count that stays up is a leak
(an admission budget never given back, a producer task or an engine stream never closed, a sidecar
call never finished). The fault suite (tests/integration/test_faults.py) reads it after every case.
The sources are duck-typed so this module stays free of the pipeline's imports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from coordinator.observability.metrics import Metrics


class _Pipeline(Protocol):
    @property
    def inflight(self) -> int: ...


class _Streams(Protocol):
    @property
    def open_sessions(self) -> int: ...
    @property
    def producer_tasks(self) -> int: ...


class _Ledger(Protocol):
    @property
    def global_inflight(self) -> int: ...


class _Admission(Protocol):
    @property
    def queue_length(self) -> int: ...


class _EngineClient(Protocol):
    @property
    def open_streams(self) -> int: ...
    @property
    def pending_aborts(self) -> int: ...


class _NativeClient(Protocol):
    @property
    def open_streams(self) -> int: ...


class _Sidecar(Protocol):
    @property
    def outstanding(self) -> int: ...


class _Trigger(Protocol):
    @property
    def open_calls(self) -> int: ...


class _Engine(Protocol):
    @property
    def url(self) -> str: ...
    @property
    def inflight_requests(self) -> int: ...
    @property
    def inflight_tokens(self) -> int: ...


@dataclass
class Accounting:
    """Reads the live counters of one coordinator (see ``snapshot``)."""

    pipeline: _Pipeline
    streams: _Streams  # the derender stage's open stream sessions
    ledger: _Ledger
    admission: _Admission
    engine_client: _EngineClient
    sidecars: Callable[[], Iterable[_Sidecar]]
    engines: Callable[[], Iterable[_Engine]]
    native_client: _NativeClient | None = None
    trigger: _Trigger | None = None

    def counts(self) -> dict[str, int]:
        """Scalar counts; each is 0 when the coordinator holds nothing."""
        return {
            "inflight_requests": self.pipeline.inflight,
            "admission_tokens": self.ledger.global_inflight,
            "queued": self.admission.queue_length,
            "open_stream_sessions": self.streams.open_sessions,
            "producer_tasks": self.streams.producer_tasks,
            "open_engine_streams": self.engine_client.open_streams,
            "open_native_streams": self.native_client.open_streams if self.native_client else 0,
            "pending_engine_aborts": self.engine_client.pending_aborts,
            "sidecar_calls": sum(s.outstanding for s in self.sidecars()),
            "trigger_callbacks": self.trigger.open_calls if self.trigger is not None else 0,
        }

    def snapshot(self) -> dict[str, Any]:
        """The counts, each engine's in-flight requests and tokens, and ``held``: the sum of it all."""
        counts = self.counts()
        live = list(self.engines())
        engines = [{"url": e.url, "inflight_requests": e.inflight_requests,
                    "inflight_tokens": e.inflight_tokens} for e in live]
        held = sum(counts.values()) + sum(e.inflight_requests + e.inflight_tokens for e in live)
        return {**counts, "engines": engines, "held": held}

    def export(self, metrics: Metrics) -> None:
        """Point the gauges that have no other owner at these counts (read at scrape time)."""
        for gauge, key in ((metrics.open_stream_sessions, "open_stream_sessions"),
                           (metrics.producer_tasks, "producer_tasks"),
                           (metrics.open_engine_streams, "open_engine_streams"),
                           (metrics.open_native_streams, "open_native_streams"),
                           (metrics.pending_engine_aborts, "pending_engine_aborts"),
                           (metrics.sidecar_calls, "sidecar_calls")):
            gauge.set_function(self._reader(key))

    def _reader(self, key: str) -> Callable[[], float]:
        return lambda: float(self.counts()[key])
