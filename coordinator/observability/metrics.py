"""Prometheus collectors of the coordinator (exposed on /metrics unless switched off).

One object, built once per app and handed to the stages that count things, so tests can read the
values of their own coordinator (no process-global registry).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.stream_buffered_tokens = Gauge(
            "coordinator_stream_buffered_tokens",
            "Engine tokens read by open streams but not yet derendered (bounded by stream.buffer_tokens)",
            registry=r)
        self.inflight = Gauge("coordinator_inflight_requests", "Client requests currently in flight",
                              registry=r)  # app.py points it at the pipeline's count
        # --- what requests hold (accounting.py points these at live counts; 0 when idle) ---
        self.open_stream_sessions = Gauge("coordinator_open_stream_sessions",
                                          "Streaming sessions not closed yet", registry=r)
        self.producer_tasks = Gauge("coordinator_producer_tasks",
                                    "Tasks reading an engine stream for an open session", registry=r)
        self.open_engine_streams = Gauge("coordinator_open_engine_streams",
                                         "Engine generate responses held open", registry=r)
        self.open_native_streams = Gauge("coordinator_open_native_streams",
                                         "Engine OpenAI-API responses held open (native route)", registry=r)
        self.pending_engine_aborts = Gauge("coordinator_pending_engine_aborts",
                                           "Abort calls to engines not finished yet", registry=r)
        self.sidecar_calls = Gauge("coordinator_sidecar_calls_inflight",
                                   "Render/derender calls in flight over all sidecars", registry=r)
        # --- admission ---
        self.queue_length = Gauge("coordinator_queue_length", "Requests waiting for admission", registry=r)
        self.queue_wait = Histogram("coordinator_queue_wait_seconds", "Time from arrival to admission",
                                    buckets=_WAIT_BUCKETS, registry=r)
        self.admitted = Counter("coordinator_admitted", "Engine requests admitted", registry=r)
        self.rejected = Counter("coordinator_rejected", "Engine requests refused by admission",
                                ["reason"], registry=r)
        self.global_inflight_tokens = Gauge("coordinator_inflight_tokens",
                                            "Tokens (prompt + max_tokens) admitted and not yet released",
                                            registry=r)
        # --- engines ---
        self.engine_inflight = Gauge("coordinator_engine_inflight_requests", "Requests in flight per engine",
                                     ["engine"], registry=r)
        self.engine_inflight_tokens = Gauge("coordinator_engine_inflight_tokens",
                                            "Tokens in flight per engine", ["engine"], registry=r)
        self.engine_state = Gauge("coordinator_engine_state",
                                  "1 for the engine's current state (healthy, unhealthy, draining)",
                                  ["engine", "state"], registry=r)
        self.breaker_state = Gauge("coordinator_breaker_state",
                                   "Circuit breaker: 0 closed, 1 half-open, 2 open", ["engine"], registry=r)
        self.engine_failures = Counter("coordinator_engine_failures", "Failed engine calls", ["engine"],
                                       registry=r)
        self.retries = Counter("coordinator_retries", "Engine requests retried on another engine",
                               registry=r)
        self.relays = Counter("coordinator_relays", "Streams moved to another engine after a mid-stream "
                              "engine failure", registry=r)
        self.engine_deaths = Counter("coordinator_engine_deaths",
                                     "Engines found dead right after failing a request", registry=r)
        # --- scheduling ---
        self.decisions = Counter("coordinator_scheduling_decisions", "Engines picked, by policy",
                                 ["policy", "engine"], registry=r)
        self.prefix_query_tokens = Counter("coordinator_prefix_query_tokens",
                                           "Prompt tokens looked up in the prefix index", registry=r)
        self.prefix_hit_tokens = Counter("coordinator_prefix_hit_tokens",
                                         "Prompt tokens the picked engine already holds (per the index)",
                                         registry=r)
        self.prefix_hit_ratio = Gauge("coordinator_prefix_hit_ratio",
                                      "prefix_hit_tokens / prefix_query_tokens since start", registry=r)
        self._query_tokens = self._hit_tokens = 0  # the counters' totals, for the ratio
        self.prefix_hit_ratio.set_function(
            lambda: self._hit_tokens / self._query_tokens if self._query_tokens else 0.0)
        self.handoffs = Counter("coordinator_pd_decisions", "Topology used per engine request",
                                ["path"], registry=r)
        self.panic_decisions = Counter(
            "coordinator_panic_decisions", "Engines picked although probes call them unhealthy, because "
            "every engine of their model and role is (panic routing)", ["role"], registry=r)

    def prefix_lookup(self, prompt_tokens: int, hit_tokens: int) -> None:
        """One routing decision: how much of the prompt the picked engine holds, per the index."""
        self.prefix_query_tokens.inc(prompt_tokens)
        self.prefix_hit_tokens.inc(hit_tokens)
        self._query_tokens += prompt_tokens
        self._hit_tokens += hit_tokens
