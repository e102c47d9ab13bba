"""One configuration tree for the coordinator.

Loaded from a YAML file (``--config PATH`` or ``COORD_CONFIG``) with environment overrides
(``COORD_<SECTION>__<FIELD>``, e.g. ``COORD_RENDER__URL``). Environment wins over YAML so a
Kubernetes manifest can patch one value without templating the whole file.

One file on purpose, though it is long: it is declarations only (each setting with its type, default,
bounds and description, and the cross-field checks), the one place an operator or a reviewer reads
every knob, and the source docs/configuration.md is generated from. Splitting the sections across
modules would scatter the settings without separating any logic.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

EngineRole = Literal["union", "prefill", "decode", "encode"]
PD_ROLES = ("prefill", "decode")
PdProtocol = Literal["handoff", "trigger"]
FeedReader = Literal["zmtp", "libzmq"]


class _Section(BaseModel):
    """Base of every section: an unknown key is an error, so a misspelt key (``wieght``) stops start-up
    instead of silently leaving the default in force."""

    model_config = ConfigDict(extra="forbid")


class ServerSettings(_Section):
    """Where the coordinator listens and how it treats clients."""

    host: str = Field(
        default="127.0.0.1", description="listen address; `0.0.0.0` in a pod (`--host` overrides it)"
    )
    port: int = Field(
        default=8000, description="listen port for HTTP, NNRP and /metrics (`--port` overrides it)"
    )
    api_keys: list[SecretStr] = Field(
        default_factory=list, description="Bearer keys accepted from clients, all of the `default` tenant; "
        "empty, and no tenant has keys = no auth (docs/tenants.md)"
    )
    workers: int = Field(
        default=1, ge=1, le=64, description="coordinator processes serving one port (a supervisor binds it "
        "and starts this many workers sharing it), one event loop each; /metrics and /ready answer for "
        "all of them. With more than one, budgets are "
        "shared through admission.fleet (redis), or split evenly between the workers (local)"
    )
    request_mode: Literal["strict", "compat"] = Field(
        default="strict",
        description="strict: unsupported request fields are a 400; compat: they are ignored and logged",
    )
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024, description="larger request bodies → 413")
    metrics: bool = Field(default=True, description="serve Prometheus metrics on /metrics")
    log_level: str = Field(
        default="info", description="Python logging level of the coordinator and uvicorn (debug, info, "
        "warning, error)"
    )
    log_format: Literal["text", "json"] = Field(
        default="text", description="json: one JSON object per line; request events carry their fields as "
        "keys (docs/observability.md)",
    )
    drain_delay_s: float = Field(
        default=5.0, ge=0, description="after SIGTERM, /ready answers 503 for this long while requests are "
        "still accepted, so load balancers stop sending new ones before the listener closes",
    )
    drain_timeout_s: float = Field(
        default=60.0, ge=0, description="after the listener closes, in-flight requests and streams get this "
        "long to finish; streams still open then end with an error event the client can retry on. "
        "Kubernetes' terminationGracePeriodSeconds must exceed drain_delay_s + drain_timeout_s",
    )


class LimitsSettings(_Section):
    """What one client request may cost or hold before any stage sees it (docs/openai-api.md, "Request
    limits"; the reasons: docs/decisions.md)."""

    max_json_depth: int = Field(
        default=64, ge=2, description="deepest nesting of objects/arrays in a request body; deeper → 400"
    )
    header_timeout_s: float = Field(
        default=10.0, gt=0, description="a request's headers must be complete this long after the "
        "connection (or the request's first byte) → else 408 and the connection is closed"
    )
    body_timeout_s: float = Field(
        default=30.0, gt=0, description="a request body must arrive completely within this time (408)"
    )
    default_max_tokens: int | None = Field(
        default=None, ge=1, description="output cap applied when the client sets no max_tokens; "
        "null = vLLM's behaviour (the rest of the context window; 16 for completions)",
    )
    request_id_max_length: int = Field(
        default=128, ge=8, le=512, description="longest X-Request-Id adopted from a client (charset "
        "A-Za-z0-9._:-); others are replaced by the coordinator's own id"
    )
    context_budget_mode: Literal["off", "on"] = Field(
        default="off", description="off: a max_tokens (or max_completion_tokens) that does not fit the "
        "context is a 400 (OpenAI's rule); on: it is clamped to what fits (docs/openai-api.md, "
        "\"Context budget\")",
    )


MediaScheme = Literal["data", "https", "http"]


class MediaSettings(_Section):
    """Images in chat requests (also Messages and Responses, which arrive as chat): checked before the
    render sidecar fetches or decodes them (docs/multimodal.md)."""

    max_images: int = Field(default=8, ge=0, description="most images one request may carry (0: no images)")
    max_image_bytes: int = Field(
        default=10 * 1024 * 1024, ge=1024,
        description="largest image a `data:` URL may hold (decoded bytes); http(s) images are held to it by "
        "render's download")
    url_schemes: list[MediaScheme] = Field(
        default_factory=lambda: list(get_args(MediaScheme)),
        description="URL schemes an image may use; without http(s) render never downloads anything")
    allow_private_urls: bool = Field(
        default=False,
        description="let http(s) image URLs name loopback, private, link-local or reserved addresses "
        "(off: such a URL is a 400 before render fetches it)")
    fetch_timeout_s: int = Field(
        default=3, ge=1,
        description="render's download limit for one image, whole seconds: `make run` gives its sidecars "
        "VLLM_IMAGE_FETCH_TIMEOUT of this and one try (render_sidecar.launch.media_env; set the same on "
        "sidecars you start, as deploy/k8s does); keep it below render.timeout_s")


class RenderSettings(_Section):
    """The localhost vLLM render sidecars (render + derender): one process each, same model and flags."""

    enable: bool = Field(
        default=True, description="false: no render sidecar; every request is tokenized by the local "
        "tokenizer (for admission and KV affinity) and answered by an engine's own OpenAI API (engines "
        "with `native_api`), Messages and Responses included (docs/engine-capabilities.md)",
    )
    url: str = Field(default="http://127.0.0.1:8100", description="the sidecar when `urls` is empty")
    urls: list[str] = Field(
        default_factory=list, description="a pool of sidecar processes; calls go to the least busy one "
        "(streaming derender runs on one event loop per process, so capacity grows with processes)",
    )
    timeout_s: float = Field(default=5.0, gt=0, description="per render/derender call, not per stream")
    max_connections: int = Field(default=128, ge=1, description="HTTP/1.1 keep-alive connections per sidecar")
    skip_s: float = Field(
        default=2.0, gt=0, description="a sidecar that refused a connection gets no calls for this long"
    )
    circuit_failures: int = Field(
        default=3, ge=1, description="render calls failing in a row (timeout, 5xx, no answer from any "
        "sidecar) that open the render circuit: requests then skip render and take the render fallback",
    )
    circuit_cooldown_s: float = Field(
        default=5.0, gt=0,
        description="how long the render circuit stays open before one request probes render",
    )
    workers: int = Field(default=4, ge=1, description="--renderer-num-workers for the sidecar (deploy only)")
    parsers: bool | None = Field(
        default=None,
        description="whether the sidecars run a tool-call or reasoning parser; null = ask them at start-up "
        "and when one comes back (GET /derender/capabilities, else a probe call; docs/parsers.md)",
    )

    @field_validator("url", "urls")
    @classmethod
    def _http_urls(cls, value: str | list[str]) -> str | list[str]:
        for url in [value] if isinstance(value, str) else value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"render sidecar URL {url!r} must start with http:// or https://")
        if isinstance(value, list) and len(set(value)) != len(value):
            raise ValueError("render.urls lists a sidecar twice")
        return value

    @property
    def endpoints(self) -> list[str]:
        """The sidecars in use: ``urls``, or ``[url]`` when it is empty."""
        return list(self.urls) or [self.url]


class EngineSettings(_Section):
    """One token-only engine (`/inference/v1/generate`)."""

    url: str = Field(description="base URL of the engine's HTTP server, e.g. http://10.0.0.5:8200")
    role: EngineRole = Field(
        default="union", description="union: prefills and decodes; prefill / decode: one leg of a P/D "
        "handoff; encode: a vision encoder of encoder disaggregation (EPD, docs/multimodal.md)"
    )
    model: str | None = Field(default=None, description="served model name; null = any configured model")
    pd_protocol: PdProtocol = Field(
        default="handoff", description="how a prefill/decode engine's KV connector pairs up: handoff "
        "(NixlConnector: prefill first, its kv_transfer_params go to the decode leg) or trigger "
        "(vLLM-Ascend's MooncakeLayerwiseConnector: decode first, it calls the coordinator's metaserver; "
        "docs/scheduling.md). One model's P/D engines must all use one protocol",
    )
    weight: float = Field(
        default=1.0, gt=0, description="multiplies admission.engine_tokens into this engine's budget"
    )
    max_inflight_tokens: int | None = Field(
        default=None, ge=1, description="token budget (prompt + max_tokens of admitted requests); "
        "null = admission.engine_tokens * weight",
    )
    kv_events: str | None = Field(
        default=None, description="ZMQ endpoint where the engine publishes KV cache events "
        "(precise prefix index); e.g. tcp://engine-0:5557",
    )
    kv_events_replay: str | None = Field(
        default=None, description="the engine's KV-events replay endpoint (vLLM `replay_endpoint`): "
        "missed batches are fetched from it",
    )
    drain: bool = Field(default=False, description="take no new requests; in-flight ones finish")
    max_model_len: int | None = Field(
        default=None, ge=1, description="the engine's --max-model-len where it is shorter than the "
        "model's (e.g. prefill and decode engines sized apart): requests are held to the shortest of "
        "the engines that may run them; null = the model's (render's /v1/models)",
    )
    native_api: bool | None = Field(
        default=None, description="the engine also serves the OpenAI API (`vllm serve "
        "--enable-scale-out`): it may take requests through /v1/chat/completions and /v1/completions "
        "when render is unavailable or the token-only route is missing (the native route); null = "
        "learn it from the engine (a tokenizer loaded and the route served; "
        "docs/engine-capabilities.md), false = never send it text",
    )
    api_key: SecretStr | None = Field(
        default=None, description="bearer token for an engine run with `--api-key` (its /inference and /v1 "
        "routes); the coordinator's own credential, never a client's key. Keep it in a Secret "
        "(docs/engine-capabilities.md)",
    )
    tokenizer: bool | None = Field(
        default=None, description="the engine loads a tokenizer, so it runs grammars (structured outputs, "
        "forced tool calls) and bad_words: true for `--enable-scale-out` engines, false for "
        "`--tokens-only` ones; null = "
        "learn it from the engine (`POST /tokenize` at start-up and whenever it comes back; "
        "docs/engine-capabilities.md)",
    )
    max_loras: int | None = Field(
        default=None, ge=1, description="LoRA adapters the coordinator keeps registered on this engine "
        "before it unloads an idle one (the engine's `--max-loras`); null = learned from the engine's "
        "`vllm:lora_requests_info`, else lora.max_loras (docs/lora.md)",
    )


class DiscoverySettings(_Section):
    """One DNS name (a Kubernetes headless Service) whose addresses are engines of one role; merged with
    ``engines``. ``discovery`` is a list of these (a single mapping is accepted as a list of one), so a
    P/D fleet lists its prefill and its decode Service."""

    dns_name: str | None = Field(
        default=None, description="e.g. vllm-engines.default.svc.cluster.local; null = this entry is off"
    )
    port: int = Field(default=8000, ge=1, le=65535, description="the engines' HTTP port on each address")
    scheme: Literal["http", "https"] = Field(default="http", description="scheme of the engine URLs built")
    role: EngineRole = Field(default="union", description="role of every engine found under this name")
    model: str | None = Field(
        default=None, description="served model name of these engines; null = any configured model"
    )
    pd_protocol: PdProtocol = Field(
        default="handoff", description="P/D protocol of these engines (see engines[].pd_protocol)"
    )
    api_key: SecretStr | None = Field(
        default=None, description="bearer token of these engines (see engines[].api_key)"
    )
    tokenizer: bool | None = Field(
        default=None, description="whether these engines load a tokenizer (see engines[].tokenizer); "
        "null = learn it from each engine"
    )
    native_api: bool | None = Field(
        default=None, description="whether these engines also serve their own OpenAI API (see "
        "engines[].native_api); null = learn it from each engine"
    )
    max_loras: int | None = Field(
        default=None, ge=1, description="LoRA adapters kept on each of these engines (engines[].max_loras)"
    )
    kv_events_port: int | None = Field(
        default=None, ge=1, le=65535, description="when set, each address publishes KV events here"
    )
    kv_events_replay_port: int | None = Field(
        default=None, ge=1, le=65535, description="when set, each address serves KV-event replay here"
    )
    interval_s: float = Field(
        default=10.0, gt=0, description="resolve the name this often; a failed resolution keeps the last set"
    )


class TracingSettings(_Section):
    """OpenTelemetry spans for each stage of a request (optional extra ``tracing``; off by default)."""

    enabled: bool = Field(default=False, description="needs `pip install 'llm-coordinator[tracing]'`")
    exporter: Literal["otlp", "console"] = Field(
        default="otlp", description="otlp: OTLP over HTTP to `endpoint`; console: spans printed to stdout"
    )
    endpoint: str = Field(
        default="http://127.0.0.1:4318/v1/traces", description="the OTLP/HTTP traces endpoint of a collector"
    )
    service_name: str = Field(default="llm-coordinator", description="the `service.name` resource attribute")
    sample_ratio: float = Field(
        default=1.0, ge=0, le=1, description="share of new traces recorded; a client's sampled "
        "`traceparent` is always followed (parent-based sampling)",
    )


class FleetSettings(_Section):
    """One token budget across coordinator processes and replicas (docs/operations.md, "Fleet budget")."""

    backend: Literal["local", "redis"] = Field(
        default="local", description="local: this process's own count (one coordinator); redis: every "
        "process with the same redis_url and namespace shares each engine's and the global budget"
    )
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="the Redis server (redis backend)")
    namespace: str = Field(
        default="llmc", min_length=1, description="key prefix: fleets in front of different engines on one "
        "Redis need different namespaces"
    )
    lease_ttl_s: float = Field(
        default=3.0, gt=0, description="a process that stops renewing its lease this long (crash, network) "
        "no longer counts: its tokens come back to the fleet"
    )
    sync_interval_s: float = Field(
        default=0.1, gt=0, description="how often the lease is renewed and the others' holdings are read "
        "for room checks (claims are checked atomically regardless)"
    )
    expected_replicas: int = Field(
        default=1, ge=1, description="processes sharing the engines; while Redis is unreachable each admits "
        "alone against 1/expected_replicas of every budget"
    )
    timeout_s: float = Field(default=0.5, gt=0, description="one Redis call's connect and read timeout")


class TenantLimits(_Section):
    """What one tenant may use, and its share when the engines are busy (docs/tenants.md)."""

    weight: float = Field(
        default=1.0, gt=0, description="share of the engines while tenants wait for budget: waiting "
        "requests are admitted so each busy tenant's admitted tokens grow in proportion to its weight"
    )
    requests_per_minute: int | None = Field(
        default=None, ge=1, description="requests per minute (a token bucket that refills continuously); "
        "over it → 429 with Retry-After and x-ratelimit-* headers; null = no limit"
    )
    tokens_per_minute: int | None = Field(
        default=None, ge=1, description="tokens per minute, counted as OpenAI does: prompt + max_tokens "
        "(times n) when the request is admitted; null = no limit"
    )
    concurrent_tokens: int | None = Field(
        default=None, ge=1, description="in-flight tokens (prompt + max_tokens times n) of the tenant's "
        "admitted requests; more waits in the admission queue; null = no limit"
    )
    adapters: list[str] | None = Field(
        default=None, description="the LoRA adapters the tenant may name (403 for another); null = every "
        "adapter; base models stay open either way"
    )


class TenantSettings(TenantLimits):
    """A named tenant and the API keys that are it."""

    name: str = Field(pattern=r"^[A-Za-z0-9._-]{1,64}$", description="shown in metrics and logs")
    api_keys: list[SecretStr] = Field(default_factory=list, description="Bearer keys of this tenant")


class TenantsSettings(_Section):
    """API keys → tenants, their limits and shares (docs/tenants.md)."""

    default: TenantLimits = Field(
        default_factory=TenantLimits, description="the `default` tenant: requests with a server.api_keys "
        "key, or any request when no key is configured"
    )
    members: list[TenantSettings] = Field(default_factory=list, description="the named tenants")
    file: str | None = Field(
        default=None, description="a YAML file with more tenants (`members:` as here), re-read when it "
        "changes; a file that does not parse keeps the tenants in force and logs why"
    )
    reload_interval_s: float = Field(default=2.0, gt=0, description="how often `file` is checked for changes")
    fleet_shares: bool = Field(
        default=True, description="with the redis fleet: while another tenant waits anywhere in the fleet, "
        "a tenant holding more than its weighted max-min share of the budget (the global one, else the "
        "engines' total) is admitted no further, so shares hold however replicas see the tenants"
    )
    headroom_window_s: float | None = Field(
        default=10.0, gt=0, description="while two or more tenants sent requests this recently, a tenant "
        "over its weighted share leaves each engine room for one request of a tenant under its share, so "
        "that tenant's next request starts at once instead of waiting for a release; null = off"
    )
    max_queue_share: bool = Field(
        default=True, description="true: when the admission queue is full, a tenant waiting less than its "
        "weight's share of it takes the place of the newest waiter of the tenant furthest over its share "
        "(that one gets the 429); false: the newcomer gets the 429"
    )

    @model_validator(mode="after")
    def _unique(self) -> TenantsSettings:
        names = [t.name for t in self.members]
        if "default" in names or len(set(names)) != len(names):
            raise ValueError("tenants.members: names must be unique and not 'default'")
        keys = [k.get_secret_value() for t in self.members for k in t.api_keys]
        if len(set(keys)) != len(keys):
            raise ValueError("tenants.members: an API key belongs to two tenants")
        return self


class AdmissionSettings(_Section):
    """Token-based flow control in front of the engines (see docs/scheduling.md)."""

    enabled: bool = Field(
        default=True, description="false: never queue or refuse for budget (load is still counted for the "
        "load scorer)"
    )
    engine_tokens: int = Field(
        default=131072, ge=1, description="default per-engine budget of in-flight tokens (prompt + "
        "max_tokens times n of admitted requests), times the engine's weight"
    )
    global_tokens: int | None = Field(
        default=None, ge=1,
        description="budget over all engines; null = no global cap (the per-engine budgets still apply)"
    )
    max_queue: int = Field(
        default=1024, ge=0, description="requests allowed to wait for budget; one more → 429 + Retry-After"
    )
    queue_timeout_s: float = Field(
        default=60.0, gt=0, description="longest wait for budget before a 503 + Retry-After"
    )
    retry_after_s: int = Field(default=1, ge=0, description="Retry-After (seconds) sent with 429/503")
    priority_header: str = Field(
        default="x-request-priority", description="header carrying an integer priority (lower = sooner) "
        "when the body has no `priority`; a gateway can set it per tenant"
    )
    max_waiting_per_engine: int | None = Field(
        default=None, ge=0, description="skip engines whose /metrics report more waiting requests",
    )
    engine_kv_usage_limit: float | None = Field(
        default=None, gt=0, le=1, description="an engine whose /metrics report this KV-cache usage (0-1) or "
        "more takes no new request until it reports less: the engines' own load bounds what the token "
        "counts miss (clients that bypass the coordinator, replicas the fleet does not know of); null = off",
    )
    fleet: FleetSettings = Field(default_factory=FleetSettings)


class IndexerSettings(_Section):
    """Where the prefix index lives (docs/scheduling.md, "The pod's KV index")."""

    mode: Literal["auto", "local", "pod", "service"] = Field(
        default="auto", description="local: in each coordinator process (each worker keeps its own index "
        "and, with the precise source, its own KV-event feeds); pod: one indexer process beside the "
        "workers, started and restarted by the coordinator, holds the index and the feeds for all of them; "
        "service: a shared indexer at `address` (`python -m coordinator.indexer`), for coordinator "
        "replicas; auto: pod when server.workers > 1, else local",
    )
    address: str | None = Field(
        default=None, description="service: the indexer's `tcp://host:port`",
    )
    standby: str | None = Field(
        default=None, description="service: a second indexer service, the other half of an HA pair: both "
        "are told every engine feed and every lesson, so each holds the whole index, and a match asks "
        "`address` unless it is down or was slow (docs/scheduling.md, \"An HA pair\")",
    )
    listen: str = Field(
        default="tcp://0.0.0.0:5590", description="`python -m coordinator.indexer`: where the service "
        "listens (`tcp://host:port` or `unix:/path`)",
    )
    timeout_s: float = Field(
        default=0.05, gt=0, description="how long a routing decision waits for the indexer's answer "
        "before it routes on load alone (counted in coordinator_prefix_indexer_unanswered_total)",
    )

    @model_validator(mode="after")
    def _address_for_service(self) -> IndexerSettings:
        if self.mode == "service" and not self.address:
            raise ValueError("scheduling.prefix.indexer.mode service needs scheduling.prefix.indexer.address")
        if self.standby and self.mode != "service":
            raise ValueError("scheduling.prefix.indexer.standby is the second of a pair of indexer services: "
                             "it needs mode: service")
        return self


class PrefixIndexSettings(_Section):
    """Which prompt prefixes each engine holds, for KV-affinity."""

    source: Literal["none", "approximate", "precise"] = Field(
        default="approximate",
        description="approximate: learned from our own routing; precise: engines' KV events over ZMQ",
    )
    block_size: int = Field(
        default=16, ge=1, description="hash block size in tokens: the engines' KV block size or a divisor "
        "of it (equal gives exact counts)"
    )
    capacity_blocks: int = Field(
        default=200_000, ge=1, description="blocks remembered per engine (LRU; the index's memory is about "
        "200 bytes a block): approximate: set it near the engine's real KV capacity in blocks; precise: "
        "only a bound on what lost KV events could leave behind"
    )
    ttl_s: float = Field(default=900.0, gt=0, description="approximate: forget blocks not used for this long")
    pending_ttl_s: float = Field(
        default=10.0, gt=0, description="precise: a routed prompt counts as cached on its engine for this "
        "long, until the engine's KV events confirm it (covers prefills still running)")
    media: bool = Field(
        default=True, description="blocks of a prompt with images are hashed with the images' hashes, as "
        "vLLM keys them (docs/multimodal.md); false: by their token ids only, like a media-blind router "
        "(the baseline of perf.multimodal), which takes every image for every other")
    tiers: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 0.5, "STORAGE": 0.25},
        description="precise: offload tiers (vLLM's KV events' `medium`) indexed beside the engines' own "
        "cache, each with the weight a block held only there scores against a block in the engine's "
        "cache (1): it must be loaded back, not recomputed (docs/scheduling.md, \"Offload tiers\"); "
        "{} ignores them")
    huge_pages: bool = Field(
        default=True, description="precise: the index's tables (once 2 MiB or more) ask the kernel for "
        "transparent huge pages (`madvise`), so a probe's cache miss does not also walk the page tables: "
        "0.80-0.86x the pod's intake CPU at 256 engines; false keeps 4 KiB pages (a table's memory is "
        "then committed page by page rather than 2 MiB at a time) (docs/scheduling.md, \"Huge pages\")")
    gather_ms: float = Field(
        default=20.0, ge=0, le=100, description="precise: the KV-event feeds wake the process at most once "
        "per this long and then drain every feed with news (one wake-up per interval, not per batch); the "
        "index is this much behind the engines at most (a decision's own routing lesson covers that window); "
        "shorter costs more CPU per block (5 ms: ~1.3x at 256 engines); 0: wake for each batch "
        "(docs/scheduling.md, \"Gathered wake-ups\")")
    reader: FeedReader = Field(
        default="zmtp", description="precise: what reads the engines' KV-event feeds: `zmtp`, our own ZMTP "
        "reader on the process's event loop (no libzmq I/O thread; `tcp://` and `ipc://` endpoints, "
        "NULL security, which is what vLLM publishes with), `libzmq`, a pyzmq SUB socket per feed "
        "(docs/scheduling.md, \"Our own ZMTP reader\")")
    indexer: IndexerSettings = Field(default_factory=IndexerSettings)

    @field_validator("tiers")
    @classmethod
    def _tier_names(cls, tiers: dict[str, float]) -> dict[str, float]:
        out = {}
        for name, weight in tiers.items():
            key = name.upper()
            if key in ("", "GPU"):
                raise ValueError(f"{name!r} is the engine's own cache, not an offload tier")
            if not 0.0 <= weight <= 1.0:
                raise ValueError(f"the weight of tier {name!r} must be within [0, 1], got {weight}")
            if weight > 0:
                out[key] = weight
        return out


class BoundedLoadSettings(_Section):
    """The ``bounded_load`` picker (used by the affinity preset): no engine may take more than
    ``max(factor x fair share, fair share + slack)`` of the decisions of the last ``window_s``."""

    factor: float = Field(default=1.25, ge=1.0, description="multiple of the fair share an engine may take")
    slack: float = Field(default=8.0, ge=0, description="extra decisions allowed above the fair share")
    window_s: float = Field(default=30.0, gt=0, description="the decisions of this long count towards shares")


ScorerName = Literal["prefix", "load", "queue", "kv_usage", "lora"]


class ScorerSettings(_Section):
    """One scorer of the ``custom`` policy; the picker sees the weighted sum of the scores (each 0 to 1)."""

    name: ScorerName = Field(
        description="prefix: share of the prompt the engine holds; load: free share of its token budget; "
        "queue: 1/(1+waiting); kv_usage: free KV cache; lora: the engine holds the request's LoRA adapter "
        "(docs/lora.md)"
    )
    weight: float = Field(default=1.0, ge=0, description="weight of this score in the sum")


FilterName = Literal["queue_depth"]


class FilterSettings(_Section):
    """One filter the scheduler runs after its built-in ones (``capable``, ``not_tried``, ``has_room``,
    which correctness needs and config cannot remove)."""

    name: FilterName = Field(
        description="queue_depth: skip engines whose /metrics report more than `max_waiting` waiting "
        "requests")
    max_waiting: int = Field(default=0, ge=0, description="queue_depth: the most waiting requests allowed")


class SchedulingSettings(_Section):
    """Filters → scorers → picker. ``policy`` picks a preset; ``custom`` uses ``scorers``/``picker``."""

    filters: list[FilterSettings] = Field(
        default_factory=list, description="filters added after the built-in ones, in order "
        "(`admission.max_waiting_per_engine` adds a queue_depth filter too)",
    )

    policy: Literal["affinity", "least_load", "round_robin", "random", "custom"] = Field(
        default="affinity", description="affinity: prefix (weight 2) + load + lora (weight 3) with the "
        "bounded_load picker; least_load: load + lora (weight 3) with max_score; custom: `scorers` + "
        "`picker`",
    )
    scorers: list[ScorerSettings] = Field(
        default_factory=lambda: [ScorerSettings(name="prefix", weight=2.0), ScorerSettings(name="load")],
        description="policy custom only: the scorers and their weights",
    )
    picker: Literal["max_score", "bounded_load", "round_robin", "random"] = Field(
        default="bounded_load", description="policy custom only: how the engine is picked from the scores")
    bounded_load: BoundedLoadSettings = Field(default_factory=lambda: BoundedLoadSettings())
    prefix: PrefixIndexSettings = Field(default_factory=PrefixIndexSettings)


class TriggerSettings(_Section):
    """The metaserver that trigger-mode decode engines call back (docs/scheduling.md, Trigger). It runs
    on its own port, started only when a trigger engine is configured; engines must reach it."""

    host: str = Field(default="127.0.0.1", description="address the metaserver binds (0.0.0.0 in a pod)")
    port: int = Field(default=8091, ge=0, le=65535, description="its port (0: any free port)")
    advertise_host: str | None = Field(
        default=None, description="the address engines call, e.g. the pod IP "
        "(COORD_TOPOLOGY__TRIGGER__ADVERTISE_HOST from status.podIP); null = host, which then must not "
        "be a wildcard",
    )
    callback_timeout_s: float = Field(
        default=120.0, gt=0, description="a decode engine that has not called back this long after the "
        "request was sent fails the attempt (it is retried on another engine); it calls once it "
        "allocates the request's blocks, so leave room for the time a request may queue there",
    )

    @model_validator(mode="after")
    def _reachable(self) -> TriggerSettings:
        if self.advertise_host is None and self.host in ("0.0.0.0", "::", ""):
            raise ValueError("topology.trigger.host is a wildcard: set topology.trigger.advertise_host "
                             "to an address the engines can reach (the pod IP)")
        return self


class EncodeSettings(_Section):
    """Encoder disaggregation (EPD): engines of role ``encode`` compute a prompt's image embeddings and
    put them in the encoder-cache store their EC connector shares with the engines that answer."""

    timeout_s: float = Field(
        default=10.0, gt=0, description="longest wait for an encode leg; past it (or on any encoder "
        "error) the answering engine encodes the images itself, and the miss counts against the "
        "encoder's breaker",
    )
    reuse_ttl_s: float = Field(
        default=600.0, ge=0, description="skip the encode leg when every image of the prompt was encoded "
        "this recently (the answering engine loads it from the store, or encodes it itself if the "
        "store dropped it); 0 = always encode",
    )
    reuse_entries: int = Field(default=100_000, ge=0, description="media hashes remembered for reuse_ttl_s")


class TopologySettings(_Section):
    """Union (one engine per request) or P/D (prefill and decode engines: handoff or trigger)."""

    mode: Literal["auto", "union", "handoff"] = Field(
        default="auto", description="auto: P/D when prefill and decode engines are configured; handoff "
        "forces P/D (its protocol, handoff or trigger, is the engines' pd_protocol)"
    )
    pd_min_uncached_tokens: int = Field(
        default=256, ge=0, description="prefill remotely only when this many prompt tokens are not "
        "already cached on the chosen decode engine",
    )
    hybrid_fallback: bool = Field(
        default=True, description="when no P/D pair can take a request (a role has no healthy engine "
        "whose breaker allows it), run it on a union engine, else alone on a prefill engine, else on "
        "a decode engine that prefills locally (docs/scheduling.md)",
    )
    prefill_kv_transfer_params: dict[str, Any] = Field(
        default_factory=lambda: {"do_remote_decode": True, "do_remote_prefill": False,
                                 "remote_engine_id": None, "remote_block_ids": None,
                                 "remote_host": None, "remote_port": None},
        description="sent on the prefill leg (NixlConnector convention)",
    )
    trigger: TriggerSettings = Field(default_factory=TriggerSettings)
    encode: EncodeSettings = Field(default_factory=EncodeSettings)


class ResilienceSettings(_Section):
    """Retries before the first client byte, and one circuit breaker per engine."""

    retries: int = Field(default=2, ge=0, description="extra attempts, each on another engine")
    retries_after_engine_death: int = Field(
        default=1, ge=0, description="extra attempts allowed after an attempt whose engine died under it "
        "(a possibly poisonous request must not take the fleet down engine by engine)",
    )
    max_relays: int = Field(
        default=2, ge=0, description="times one streaming prompt may move to another engine after its "
        "engine failed mid-stream (0: a mid-stream engine failure ends the stream with an error)",
    )
    backoff_initial_s: float = Field(
        default=0.02, ge=0, description="first wait of the jittered exponential backoff between attempts"
    )
    backoff_max_s: float = Field(default=0.5, ge=0, description="longest wait between attempts")
    breaker_failures: int = Field(default=3, ge=1, description="consecutive failures that open a breaker")
    breaker_cooldown_s: float = Field(
        default=10.0, gt=0, description="open time before one half-open trial request"
    )
    telemetry: bool = Field(default=True, description="scrape engines' /metrics with each health probe")


class AdapterSettings(_Section):
    """A LoRA adapter of one base model: a name clients may ask for, and where engines load it from."""

    name: str = Field(description="the name clients put in `model` (and engines know it by)")
    path: str = Field(
        description="where engines load the adapter from (vLLM's `lora_path`: a folder on the engines' "
        "filesystem); must lie under one of lora.allowed_roots when those are set",
    )
    engines: list[str] = Field(
        default_factory=list, description="engine URLs it is pinned on: loaded there at start-up and "
        "never unloaded to make room (docs/lora.md)",
    )


class LoraSettings(_Section):
    """Loading adapters on demand (docs/lora.md)."""

    max_loras: int = Field(
        default=4, ge=1, description="adapters kept per engine when neither engines[].max_loras nor the "
        "engine's metrics say (vLLM's --max-loras)",
    )
    allowed_roots: list[str] = Field(
        default_factory=list, description="adapter paths (config and admin loads) must lie under one of "
        "these folders; empty = any path",
    )
    load_timeout_s: float = Field(
        default=60.0, gt=0, description="one load on one engine, and how long requests wait for it",
    )
    replicate_inflight: int = Field(
        default=8, ge=1, description="when every engine holding an adapter runs at least this many of "
        "its requests, the next one may load it on another engine (hot adapters spread)",
    )


class ModelSettings(_Section):
    """A model clients may ask for: its served name (as render knows it) and aliases."""

    name: str = Field(description="the served model name render and engines use")
    aliases: list[str] = Field(default_factory=list, description="further names clients may ask for")
    max_model_len: int | None = Field(
        default=None, ge=1, description="longest prompt + output in tokens; null = read from the "
        "render sidecar's /v1/models"
    )
    vocab_size: int | None = Field(
        default=None, ge=1, description="token ids must be below this; null = learned from the model "
        "folder (`path`, else the sidecar's `root`): max(config.json vocab_size, tokenizer ids + 1)",
    )
    path: str | None = Field(
        default=None, description="model folder or hub id to learn vocab_size from; null = the render "
        "sidecar's `root`",
    )
    tokenizer_path: str | None = Field(
        default=None, description="tokenizer folder or hub id for the local tokenizer used when render "
        "is unavailable; null = `path`, else the sidecar's `root`",
    )
    adapters: list[AdapterSettings] = Field(
        default_factory=list, description="LoRA adapters of this model: served under their own names, "
        "rendered with this model's tokenizer and template (docs/lora.md)",
    )


class EngineClientSettings(_Section):
    """Timeouts and pool sizes towards the engines."""

    connect_timeout_s: float = Field(default=5.0, gt=0, description="TCP connect to an engine")
    stream_idle_timeout_s: float = Field(
        default=300.0, gt=0, description="max silence on a generate stream (engine queueing included)"
    )
    total_timeout_s: float = Field(default=1800.0, gt=0, description="non-streaming generate as a whole")
    max_connections: int = Field(default=512, ge=1, description="connections towards all engines together")
    health_interval_s: float = Field(
        default=5.0, gt=0, description="GET /health of each engine this often (and /metrics with "
        "resilience.telemetry)"
    )


class StreamSettings(_Section):
    """The per-request streaming path (docs/architecture.md, "Streaming")."""

    queue_chunks: int = Field(
        default=32, ge=1, description="chunks buffered between engine reader and client writer"
    )
    coalesce: bool = Field(
        default=True, description="while a derender call is in flight, merge the engine chunks that "
        "arrive for the same choice into the next call (off: one call per engine chunk)",
    )
    max_tokens_per_call: int = Field(
        default=32, ge=1, description="most tokens one derender call carries (keeps client deltas smooth)"
    )
    buffer_tokens: int = Field(
        default=2048, ge=1, description="engine tokens buffered per stream before the coordinator stops "
        "reading from the engine (back-pressure from a slow client reaches the engine's socket)",
    )
    coalesce_with_parsers: bool | None = Field(
        default=None, description="merge calls also when the sidecar runs tool/reasoning parsers; null = "
        "only for parsers measured to be chunking-invariant (docs/parsers.md: hermes is, olmo3 is not)",
    )


class ObfuscationSettings(_Section):
    """Token obfuscation: engines serve a key-permuted model copy and see only physical token ids
    (docs/decisions.md, "Token obfuscation")."""

    enabled: bool = Field(
        default=False, description="map token ids semantic → physical towards engines and back (needs "
        "`key_file`); also "
        "refuses every route that would send plain ids to an engine's native API",
    )
    key_file: str | None = Field(
        default=None, description="file whose raw bytes are the permutation key (at least 16 bytes); the "
        "engines' model copy must have been written with the same key",
    )

    @model_validator(mode="after")
    def _key_when_enabled(self) -> ObfuscationSettings:
        if self.enabled and not self.key_file:
            raise ValueError("obfuscation.enabled needs obfuscation.key_file")
        return self


class NnrpSettings(_Section):
    """The NNRP front door: WebSocket sessions at ``/nnrp/v1`` on the server's port (docs/nnrp.md)."""

    enabled: bool = Field(default=True, description="serve /nnrp/v1 and /nnrp/v1/capabilities")
    idle_timeout_s: float = Field(
        default=60.0, gt=0, description="close a session (4408) that sent no frame for this long"
    )
    heartbeat_s: float = Field(
        default=15.0, gt=0, description="the server sends a ping frame this often; a pong keeps the session"
    )
    max_frame_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, le=16 * 1024 * 1024,
        description="larger client frames get a frame_too_large error frame (the session goes on)",
    )
    initial_credits: int = Field(
        default=64, ge=0, description="result frames an operation may receive before the client grants "
        "more (credit frames)"
    )
    max_operations: int = Field(
        default=256, ge=1, description="open operations per session; a submit beyond it gets a "
        "too_many_operations error frame"
    )


class ResponseStoreSettings(_Section):
    """Where stored Responses live (``store: true``, ``previous_response_id``, retrieve, delete;
    docs/responses-api.md, "Stored responses")."""

    backend: Literal["sqlite", "redis", "off"] = Field(
        default="sqlite", description="sqlite: a file on this pod (workers share it); redis: every replica "
        "with the same redis_url and namespace sees the same responses; off: nothing is stored (store: true "
        "is answered store: false, as vLLM without its store)"
    )
    path: str = Field(default=".state/responses.sqlite3", description="the SQLite file (sqlite backend)")
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="the Redis server (redis backend)")
    namespace: str = Field(default="llmc", min_length=1, description="key prefix on Redis")
    ttl_s: float = Field(
        default=30 * 24 * 3600.0, gt=0, description="a stored response is gone this long after it was "
        "written (OpenAI keeps them 30 days)"
    )
    max_bytes_per_tenant: int = Field(
        default=256 * 1024 * 1024, ge=1024, description="past this, a tenant's oldest responses are dropped"
    )
    timeout_s: float = Field(default=2.0, gt=0, description="one Redis call's connect and read timeout")


class ResponsesSettings(_Section):
    """The OpenAI Responses API (docs/responses-api.md)."""

    store: ResponseStoreSettings = Field(default_factory=ResponseStoreSettings)
    background_lease_s: float = Field(
        default=15.0, gt=0, description="a background run's runner renews its lease this often / 3; a run "
        "whose lease ran out (its process died) reads as failed, and a cancel from another replica stops "
        "it within lease / 3"
    )


class Settings(BaseSettings):
    """Root of the configuration tree."""

    model_config = SettingsConfigDict(
        env_prefix="COORD_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    server: ServerSettings = Field(default_factory=ServerSettings)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    render: RenderSettings = Field(default_factory=RenderSettings)
    media: MediaSettings = Field(default_factory=MediaSettings)
    engine_client: EngineClientSettings = Field(default_factory=EngineClientSettings)
    stream: StreamSettings = Field(default_factory=StreamSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    tenants: TenantsSettings = Field(default_factory=TenantsSettings)
    scheduling: SchedulingSettings = Field(default_factory=SchedulingSettings)
    topology: TopologySettings = Field(default_factory=TopologySettings)
    resilience: ResilienceSettings = Field(default_factory=ResilienceSettings)
    discovery: list[DiscoverySettings] = Field(
        default_factory=list, description="DNS names whose addresses are engines (one role each)"
    )
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    obfuscation: ObfuscationSettings = Field(default_factory=ObfuscationSettings)
    nnrp: NnrpSettings = Field(default_factory=NnrpSettings)
    lora: LoraSettings = Field(default_factory=LoraSettings)
    responses: ResponsesSettings = Field(default_factory=ResponsesSettings)
    engines: list[EngineSettings] = Field(
        default_factory=lambda: [EngineSettings(url="http://127.0.0.1:8200")],
        description="the configured engines (discovered ones are merged in)",
    )
    models: list[ModelSettings] = Field(
        default_factory=lambda: [ModelSettings(name="smollm2-135m-instruct", aliases=["gpt-4o-mini"])],
        description="the models clients may ask for",
    )

    @field_validator("discovery", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        """A single mapping (the form before several services were allowed) is a list of one."""
        return [value] if isinstance(value, dict | DiscoverySettings) else value

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[ModelSettings]) -> list[ModelSettings]:
        seen: set[str] = set()
        for m in models:
            for name in (m.name, *m.aliases, *(a.name for a in m.adapters)):
                if name in seen:
                    raise ValueError(f"model name or alias {name!r} is configured twice")
                seen.add(name)
        return models

    @model_validator(mode="after")
    def _queue_depth_filter(self) -> Settings:
        """``admission.max_waiting_per_engine`` is the older spelling of a ``queue_depth`` filter: it
        becomes one in ``scheduling.filters`` (unless one is configured there), so the scheduler builds
        its filters from one list."""
        limit = self.admission.max_waiting_per_engine
        if limit is not None and not any(f.name == "queue_depth" for f in self.scheduling.filters):
            self.scheduling.filters = [*self.scheduling.filters,
                                       FilterSettings(name="queue_depth", max_waiting=limit)]
        return self

    @model_validator(mode="after")
    def _adapters_allowed(self) -> Settings:
        """An adapter path outside ``lora.allowed_roots`` is a configuration error, found at start-up."""
        for m in self.models:
            for a in m.adapters:
                why = self.adapter_path_problem(a.path)
                if why is not None:
                    raise ValueError(f"adapter {a.name!r}: {why}")
        return self

    def adapter_path_problem(self, path: str) -> str | None:
        """Why engines may not be told to load ``path``, or None (``lora.allowed_roots``)."""
        roots = self.lora.allowed_roots
        if not roots:
            return None
        clean = os.path.normpath(path)
        if not os.path.isabs(clean) or not any(
                clean == os.path.normpath(r) or clean.startswith(os.path.normpath(r).rstrip("/") + "/")
                for r in roots):
            return f"path {path!r} is outside the allowed adapter roots ({', '.join(roots)})"
        return None

    @model_validator(mode="after")
    def _engines_known(self) -> Settings:
        names = {m.name for m in self.models}
        for e in self.engines:
            if e.model is not None and e.model not in names:
                raise ValueError(f"engine {e.url} serves {e.model!r}, which is not in models")
        return self

    def render_off_problem(self) -> str | None:
        """Why ``render.enable: false`` cannot serve with these engines, or None. Checked when the
        coordinator starts (not while loading, so one variable at a time can still be set)."""
        if self.render.enable:
            return None
        if not any(e.native_api is not False and e.role == "union" for e in self.engines) and not any(
                d.native_api is not False and d.role == "union" and d.dns_name for d in self.discovery):
            return ("render.enable is false, so every request takes an engine's own OpenAI API: "
                    "at least one union engine (or discovery entry) must be allowed to serve it "
                    "(native_api: true, or left unset to learn it)")
        if self.obfuscation.enabled:
            return "render.enable false sends text to the engines, which token obfuscation forbids"
        return None

    @model_validator(mode="after")
    def _one_pd_protocol(self) -> Settings:
        mixed = self.mixed_pd_protocols(self.engines)
        if mixed is not None:
            raise ValueError(mixed)
        return self

    def mixed_pd_protocols(self, engines: list[EngineSettings]) -> str | None:
        """Why ``engines`` (with the discovery entries) cannot serve, or None. A handoff decode engine
        waits for kv_transfer_params that a trigger pair never sends, and a trigger decode engine
        waits for a prefill only its callback starts: one model's P/D engines must speak one protocol."""
        sources: list[tuple[str, str | None, str, str]] = [
            (e.url, e.model, e.role, e.pd_protocol) for e in engines]
        sources += [(f"discovery {d.dns_name}", d.model, d.role, d.pd_protocol)
                    for d in self.discovery if d.dns_name is not None]
        for model in self.models:
            pd = [(name, proto) for name, m, role, proto in sources
                  if role in PD_ROLES and (m is None or m == model.name)]
            if len({proto for _, proto in pd}) > 1:
                listed = ", ".join(f"{name} ({proto})" for name, proto in pd)
                return (f"model {model.name!r} mixes handoff and trigger P/D engines, which cannot pair "
                        f"up: {listed}; give them all one engines[].pd_protocol")
        return None

    def indexer_mode(self) -> Literal["none", "local", "pod", "service"]:
        """Where this coordinator's prefix index lives (``auto`` resolved; none without an index)."""
        prefix = self.scheduling.prefix
        if prefix.source == "none":
            return "none"
        if prefix.indexer.mode == "auto":
            return "pod" if self.server.workers > 1 else "local"
        return prefix.indexer.mode

    def uses_trigger(self) -> bool:
        """Whether any engine is a trigger P/D engine (the metaserver is started for them)."""
        return any(e.role in PD_ROLES and e.pd_protocol == "trigger" for e in self.engines) or any(
            d.role in PD_ROLES and d.pd_protocol == "trigger" for d in self.discovery if d.dns_name)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = os.environ.get("COORD_CONFIG")
        if path:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


def load_settings(path: str | Path | None = None, **overrides: Any) -> Settings:
    """Build the tree from (in rising priority) defaults, the YAML file, the environment, ``overrides``."""
    if path is None:
        return Settings(**overrides)
    previous = os.environ.get("COORD_CONFIG")
    os.environ["COORD_CONFIG"] = str(path)
    try:
        return Settings(**overrides)
    finally:  # the file is this call's source, not the process's from now on
        if previous is None:
            del os.environ["COORD_CONFIG"]
        else:
            os.environ["COORD_CONFIG"] = previous
