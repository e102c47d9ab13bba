"""Prometheus collectors of the coordinator (exposed on /metrics unless switched off).

One object, built once per app and handed to the stages that count things, so tests can read the
values of their own coordinator (no process-global registry). An embedding application may pass its
own registry instead (``build_app(settings, metrics_registry=...)``); the collectors then live there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from coordinator.observability.record import Record


class IndexSize(Protocol):
    """What the prefix index shows of its size (observability sits below scheduling, so it names the
    index's face rather than importing it)."""

    capacity_blocks: int | None

    def engines(self) -> list[str]: ...
    def blocks(self, engine: str) -> int: ...
    def approx_bytes(self) -> int: ...

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
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
        self.fleet_degraded = Gauge("coordinator_fleet_degraded",
                                    "1 while the fleet budget's Redis is unreachable and this process admits "
                                    "alone against its share of each budget", registry=r)
        self.fleet_claims = Counter("coordinator_fleet_claims", "Fleet budget claims, by result (taken: "
                                    "admitted; refused: another process took the room first)", ["result"],
                                    registry=r)
        # --- tenants (labels: the configured tenant names, a bounded set) ---
        self.tenant_admitted_tokens = Counter("coordinator_tenant_admitted_tokens",
                                              "Tokens (prompt + max_tokens times n) admitted, per tenant",
                                              ["tenant"], registry=r)
        self.tenant_rejected = Counter("coordinator_tenant_rejected", "Engine requests refused by admission, "
                                       "per tenant and reason", ["tenant", "reason"], registry=r)
        self.tenant_rate_limited = Counter("coordinator_tenant_rate_limited", "Requests refused with a 429 "
                                           "by a tenant's requests or tokens per minute", ["tenant", "limit"],
                                           registry=r)
        self.tenant_inflight_tokens = Gauge("coordinator_tenant_inflight_tokens",
                                            "Tokens admitted and not yet released, per tenant", ["tenant"],
                                            registry=r)
        self.tenant_queue_length = Gauge("coordinator_tenant_queue_length",
                                         "Requests waiting for admission, per tenant", ["tenant"], registry=r)
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
        self.prefix_hashes = Counter("coordinator_prefix_hashes", "Prompts hashed for the prefix index, by "
                                     "who hashed them: render (the sidecar, with the ids) or coordinator",
                                     ["source"], registry=r)
        self.indexer_up = Gauge("coordinator_prefix_indexer_up", "1 while this process's line to the pod's "
                                "KV indexer (scheduling.prefix.indexer; either of an HA pair) is up; 0: "
                                "routing on load and its own recent decisions only", registry=r)
        self.indexer_unanswered = Counter("coordinator_prefix_indexer_unanswered", "Routing decisions made "
                                          "without the KV indexer's match (it was down or answered later "
                                          "than scheduling.prefix.indexer.timeout_s)", registry=r)
        self.index_blocks = Gauge("coordinator_prefix_index_blocks", "Blocks the prefix index (index), "
                                  "its pending layer (pending) or an offload tier's index (tier_cpu, "
                                  "tier_storage) holds per engine", ["index", "engine"], registry=r)
        self.index_capacity = Gauge("coordinator_prefix_index_capacity_blocks", "The most blocks the index "
                                    "keeps per engine (LRU; 0: unbounded)", ["index"], registry=r)
        self.index_bytes = Gauge("coordinator_prefix_index_bytes", "Estimated memory of the whole index "
                                 "(containers and hash objects)", ["index"], registry=r)
        self.handoffs = Counter("coordinator_pd_decisions", "Topology used per engine request",
                                ["path"], registry=r)
        self.encode_legs = Counter(
            "coordinator_encode_legs", "Prompts with images under encoder disaggregation, by what ran: "
            "encoded (an encode engine), reused (encoded recently: the store has it), fallback (no encode "
            "engine or it failed: the answering engine encodes)", ["outcome"], registry=r)
        self.trigger_callbacks = Counter("coordinator_trigger_callbacks", "Metaserver callbacks of "
                                         "trigger decode engines, by the HTTP status answered", ["status"],
                                         registry=r)
        self.panic_decisions = Counter(
            "coordinator_panic_decisions", "Engines picked although probes call them unhealthy, because "
            "every engine of their model and role is (panic routing)", ["role"], registry=r)

        # --- requests, from the observation record (observability/record.py), per door ---
        self.requests = Counter("coordinator_requests", "Client requests ended, by door, served model and "
                                "HTTP status (499: the client left or cancelled)",
                                ["door", "model", "status"], registry=r)
        self.ttft = Histogram("coordinator_request_ttft_seconds", "Streaming requests: arrival to the first "
                              "event written to the client", ["door", "model"], buckets=_TTFT_BUCKETS,
                              registry=r)
        self.inter_token = Histogram("coordinator_request_inter_token_seconds", "Streaming requests: time "
                                     "between consecutive events written to the client", ["door", "model"],
                                     buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("coordinator_request_e2e_seconds", "Arrival to the end of the request",
                             ["door", "model"], buckets=_E2E_BUCKETS, registry=r)
        self.client_disconnects = Counter("coordinator_client_disconnects", "Requests whose client left "
                                          "(HTTP disconnect, NNRP socket closed) before the end", ["door"],
                                          registry=r)
        # --- LoRA adapters (pipeline/engines/lora.py) ---
        self.lora_placements = Counter(
            "coordinator_lora_placements", "Adapter requests placed on an engine, by whether the engine "
            "held the adapter already (held), had to load it (loaded) or joined a load in flight (joined)",
            ["residency"], registry=r)
        self.lora_loads = Counter("coordinator_lora_loads", "Adapter loads asked of engines, by result",
                                  ["engine", "result"], registry=r)
        self.lora_load_seconds = Histogram("coordinator_lora_load_seconds", "One adapter load on one engine",
                                           buckets=_WAIT_BUCKETS, registry=r)
        self.lora_evictions = Counter("coordinator_lora_evictions", "Idle adapters unloaded to make room",
                                      ["engine"], registry=r)
        self.lora_resident = Gauge("coordinator_lora_resident", "Adapters each engine holds (at scrape time)",
                                   ["engine"], registry=r)
        self.response_store_seconds = Histogram(
            "coordinator_response_store_seconds", "One call to the Responses store, by operation (get, put, "
            "delete) and result (ok, unavailable)", ["op", "result"],
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0), registry=r)
        self.engine_aborts = Counter("coordinator_engine_aborts", "Abort calls to engines, by the engine's "
                                     "answer (accepted: HTTP 200)", ["result"], registry=r)

    def store_call(self, op: str, result: str, seconds: float) -> None:
        """One call to the Responses store (``responses/store.py``'s ``TimedStore``)."""
        self.response_store_seconds.labels(op, result).observe(seconds)

    def request_finished(self, record: Record) -> None:
        """One finished observation record."""
        door, model = record.door, record.model or ""
        self.requests.labels(door, model, str(record.status or 0)).inc()
        self.e2e.labels(door, model).observe(record.e2e_s)
        first = record.since(record.first_event)
        if record.stream and first is not None:
            self.ttft.labels(door, model).observe(first)
        if record.client_gone:
            self.client_disconnects.labels(door).inc()

    def inter_event(self, record: Record, gap_s: float) -> None:
        self.inter_token.labels(record.door, record.model or "").observe(gap_s)

    def engine_abort(self, accepted: bool) -> None:
        self.engine_aborts.labels("accepted" if accepted else "refused").inc()

    def prefix_indexes(self, indexes: Sequence[tuple[str, IndexSize]]) -> None:
        """The indexes' sizes now (at scrape time; engines that left keep no series)."""
        self.index_blocks.clear()
        for name, index in indexes:
            self.prefix_index(name, index)

    def prefix_index(self, name: str, index: IndexSize) -> None:
        for engine in index.engines():
            self.index_blocks.labels(name, engine).set(index.blocks(engine))
        self.index_capacity.labels(name).set(index.capacity_blocks or 0)
        self.index_bytes.labels(name).set(index.approx_bytes())

    def prefix_lookup(self, prompt_tokens: int, hit_tokens: int) -> None:
        """One routing decision: how much of the prompt the picked engine holds, per the index."""
        self.prefix_query_tokens.inc(prompt_tokens)
        self.prefix_hit_tokens.inc(hit_tokens)
        self._query_tokens += prompt_tokens
        self._hit_tokens += hit_tokens
