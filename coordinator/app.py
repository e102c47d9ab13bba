"""Application assembly: one place that wires config → clients → stages → front doors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from coordinator.api.admin import build_admin_router
from coordinator.api.anthropic.routes import build_router as build_messages_router
from coordinator.api.auth import ApiKeyCheck
from coordinator.api.metaserver import Metaserver
from coordinator.api.nnrp.routes import build_nnrp_router
from coordinator.api.openai.conversations import build_router as build_conversations_router
from coordinator.api.openai.errors import install_handlers
from coordinator.api.openai.responses import build_router as build_responses_router
from coordinator.api.openai.routes import build_router
from coordinator.api.shutdown import install_drain
from coordinator.config import FleetSettings, Settings, TenantsSettings
from coordinator.observability import tracing
from coordinator.observability.accounting import Accounting
from coordinator.observability.metrics import Metrics
from coordinator.pipeline.admission.budget import TokenLedger
from coordinator.pipeline.admission.controller import AdmissionController
from coordinator.pipeline.admission.fleet import Fleet, LocalFleet, RedisFleet
from coordinator.pipeline.admission.front import FrontGate
from coordinator.pipeline.admission.rate_limits import Buckets, LocalBuckets, RedisBuckets, TenantLimiter
from coordinator.pipeline.admission.tenants import TenantDirectory
from coordinator.pipeline.catalog import ModelCatalog
from coordinator.pipeline.derender import Coalescing, Derender, Derenderer
from coordinator.pipeline.engines import versions
from coordinator.pipeline.engines.client import EngineClient
from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.engines.lora import AdapterLoader
from coordinator.pipeline.engines.native import NativeClient
from coordinator.pipeline.engines.obfuscating import build_engine_client
from coordinator.pipeline.engines.registry import EngineRegistry
from coordinator.pipeline.local_tokenizer import LocalTokenizers
from coordinator.pipeline.media import MediaPolicy
from coordinator.pipeline.messages.translate import MessagesTranslator
from coordinator.pipeline.native_route import NativeRoute
from coordinator.pipeline.render import RenderStage
from coordinator.pipeline.responses.background import BackgroundRuns
from coordinator.pipeline.responses.chain import ResponseChain, ResponsesIntake
from coordinator.pipeline.responses.store import open_store
from coordinator.pipeline.responses.translate import ResponsesTranslator
from coordinator.pipeline.responses.truncation import Measure
from coordinator.pipeline.scheduling.prefix.index import configured_index
from coordinator.pipeline.scheduling.prefix.remote import RemoteIndex
from coordinator.pipeline.scheduling.prefix.source import PreciseIndexSource
from coordinator.pipeline.scheduling.scheduler import Scheduler, build_profile, soon
from coordinator.pipeline.service import Pipeline
from coordinator.pipeline.sidecar import HEALTH_TIMEOUT_S, SidecarClient
from coordinator.pipeline.topology.attempts import Attempts
from coordinator.pipeline.topology.dispatcher import Dispatcher
from coordinator.pipeline.topology.encode import EncodeLeg
from coordinator.pipeline.topology.trigger import TriggerBoard

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

log = logging.getLogger(__name__)


@dataclass
class Components:
    """The live objects of one coordinator; tests reach in here to observe state."""

    settings: Settings
    sidecar: SidecarClient
    engines: EngineClient
    registry: EngineRegistry
    ledger: TokenLedger
    admission: AdmissionController
    scheduler: Scheduler
    precise: PreciseIndexSource | None
    pipeline: Pipeline
    metrics: Metrics
    indexer: RemoteIndex | None = None   # the pod's KV indexer, when it holds the prefix index
    native: NativeRoute | None = None  # engines' OpenAI API: render fallback, missing token route
    derenderer: Derenderer | None = None
    trigger: TriggerBoard | None = None  # trigger P/D engines: the callbacks their metaserver serves
    metaserver: Metaserver | None = None
    tenants: TenantDirectory = field(default_factory=lambda: TenantDirectory(TenantsSettings()))
    limiter: TenantLimiter | None = None  # tenants' requests and tokens per minute
    lora: AdapterLoader | None = None     # loads LoRA adapters onto engines on demand
    responses: ResponseChain = field(default_factory=lambda: ResponseChain(None))  # stored Responses
    background: BackgroundRuns | None = None   # background Responses runs of this process
    measure: Measure | None = None   # render's token count of a chat form (Responses truncation: auto)
    _pins: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _sync: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _watch: asyncio.Task[None] | None = field(default=None, init=False, repr=False)

    def derender_parsers(self) -> bool:
        """The sidecars run parsers (as learned from them, or as the config says)."""
        current = self.derenderer.features.current if self.derenderer is not None else None
        return current.parsers if current is not None else bool(self.settings.render.parsers)

    async def start(self) -> None:
        """Start the background work (KV-event feeds, health probes, learning the model's limits).

        Plain methods rather than a FastAPI lifespan, so any front door or an embedding application
        can run the pipeline."""
        if self.metaserver is not None:
            await self.metaserver.start()
        if self.precise is not None:
            for e in self.registry.engines:
                if e.kv_events:
                    await self.precise.attach(e.url, e.kv_events, replay=e.kv_events_replay)
        if self.indexer is not None:
            for e in self.registry.engines:
                _feed(self.indexer, self.settings, self.registry, e)
            self.indexer.start()
        await self.registry.start()
        if self.derenderer is not None:
            # Sidecars that answer now must agree on their parsers (SidecarsDisagree stops the start);
            # the others are asked when they first serve a stream (docs/parsers.md).
            await self.derenderer.features.learn(strict=True)
        await _check_vllm_lines(self)
        self._sync = asyncio.create_task(_sync_catalog(self))
        if self.lora is not None and self.pipeline.catalog.adapters():
            self._pins = asyncio.create_task(_keep_pins(self), name="lora-pins")
        if self.settings.tenants.file is not None:
            self._watch = asyncio.create_task(self.tenants.watch(), name="tenants-file")
        registry, ledger = self.registry, self.ledger
        await ledger.fleet.start(lambda: self.admission.fleet_totals(registry.engines), self.admission.wake)

    async def aclose(self) -> None:
        """Stop background work and close every client (waiting for pending engine aborts)."""
        if self.background is not None:  # first: their engine requests are aborted through the clients
            await self.background.aclose()
        if self._sync is not None:
            self._sync.cancel()
        if self._watch is not None:
            self._watch.cancel()
        if self._pins is not None:
            self._pins.cancel()
        if self.lora is not None:
            await self.lora.aclose()
        if self.limiter is not None:
            await self.limiter.aclose()
        if self.precise is not None:
            await self.precise.stop_all()
        if self.indexer is not None:
            await self.indexer.aclose()
        await self.admission.close()
        await self.ledger.fleet.aclose()
        await self.registry.stop()
        if self.metaserver is not None:
            await self.metaserver.stop()
        await self.engines.aclose()
        if self.native is not None:
            await self.native.client.aclose()
        await self.sidecar.aclose()
        if self.responses.store is not None:
            await self.responses.store.aclose()
        if isinstance(self.pipeline.observer, tracing.TracingObserver):  # flush the spans still batched
            await asyncio.to_thread(self.pipeline.observer.shutdown)


async def _check_vllm_lines(c: Components) -> None:
    """The render sidecars' and engines' vLLM lines, as far as they answer now (versions.py): a
    sidecar of a line the coordinator cannot use stops the start, so does a fleet whose every engine
    is refused; an untested pair is one warning."""
    sidecars: dict[str, str | None] = {}
    if c.settings.render.enable:
        for sidecar in c.sidecar.sidecars:
            _, version = await versions.read_version(sidecar.http, sidecar.url, HEALTH_TIMEOUT_S)
            sidecars[sidecar.url] = version
            reason = versions.refusal("render sidecar", sidecar.url, sidecars[sidecar.url])
            if reason:
                raise versions.IncompatibleVllm(reason)
    engines = [e for e in c.registry.engines if e.version_learned]
    if engines and all(e.refused for e in engines):
        raise versions.IncompatibleVllm("; ".join(e.refused or "" for e in engines))
    pairs = {(s, e.vllm_version) for s in sidecars.values() for e in engines if not e.refused}
    for sidecar_version, engine_version in sorted(pairs, key=str):
        if versions.untested(sidecar_version, engine_version):
            log.warning("render sidecar on vLLM %s with engines on vLLM %s: no suite has proved this pair "
                        "(docs/versions.md, \"Mixing lines\")", sidecar_version, engine_version)


def build_components(settings: Settings, metrics_registry: CollectorRegistry | None = None,
                     tracer_provider: TracerProvider | None = None) -> Components:
    """``metrics_registry``: the embedding application's Prometheus registry (default: one of our own).
    ``tracer_provider``: an OpenTelemetry TracerProvider of the embedding application (or a test's, with
    an in-memory exporter); it turns tracing on, and the caller keeps owning it (docs/tracing.md)."""
    problem = settings.render_off_problem()
    if problem is not None:
        raise ValueError(problem)
    metrics = Metrics(metrics_registry)
    observer = tracing.build_observer(settings.tracing, metrics, tracer_provider)
    sidecar = SidecarClient(settings.render)
    engines = build_engine_client(settings)  # maps token ids to physical ones when obfuscation is on
    engines.on_abort = metrics.engine_abort
    registry = EngineRegistry(settings, engines.http, metrics)
    adm = settings.admission
    tenants = TenantDirectory(settings.tenants, settings.server.api_keys)
    ledger = TokenLedger(adm.global_tokens if adm.enabled else None,
                         fleet=build_fleet(adm.fleet, metrics, settings.server.workers),
                         tenant_limit=lambda name: tenants.get(name).concurrent_tokens,
                         kv_usage_limit=adm.engine_kv_usage_limit)
    admission = AdmissionController(
        adm, ledger, metrics, weight=lambda name: tenants.get(name).weight,
        queue_share=settings.tenants.max_queue_share, fleet_shares=settings.tenants.fleet_shares,
        capacity=lambda: adm.global_tokens or sum(e.token_budget for e in registry.engines if e.healthy),
        tenant_names=lambda: tenants.tenants, headroom_window_s=settings.tenants.headroom_window_s,
        engines=lambda: registry.engines)
    limiter = build_limiter(settings, metrics)
    prefix = settings.scheduling.prefix
    profile = build_profile(settings.scheduling, ledger.engine_room, settings.lora.replicate_inflight)
    precise: PreciseIndexSource | None = None
    remote: RemoteIndex | None = None
    where = settings.indexer_mode()
    if where == "pod":   # no supervisor started one for this process (embedded, tests): it is alone
        log.info("scheduling.prefix.indexer: pod, but this process runs alone: its index is its own")
        where = "local"
    if where == "service":
        # The pod's indexer (or a shared one) holds the index, the pending layer and the KV-event feeds.
        remote = RemoteIndex(prefix.indexer.address or "", timeout_s=prefix.indexer.timeout_s,
                             standby=prefix.indexer.standby, on_change=metrics.indexer_up.set)
        scheduler = Scheduler(registry, profile, block_size=prefix.block_size, topology=settings.topology,
                              metrics=metrics, learn=False, index=None, defer=soon, remote=remote,
                              tier_weights=prefix.tiers if prefix.source == "precise" else None)
    elif prefix.source == "approximate":
        scheduler = Scheduler(registry, profile, block_size=prefix.block_size, topology=settings.topology,
                              metrics=metrics, learn=True, defer=soon,
                              index=configured_index(prefix, ttl_s=prefix.ttl_s))
    elif prefix.source == "precise":
        # Fed by the engines' KV events (the capacity only bounds what lost events could leave behind);
        # routing feeds only the pending layer.
        index = configured_index(prefix)
        tiers = {tier: configured_index(prefix) for tier in prefix.tiers}
        scheduler = Scheduler(registry, profile, block_size=prefix.block_size, topology=settings.topology,
                              metrics=metrics, learn=False, index=index, defer=soon,
                              pending=configured_index(prefix, ttl_s=prefix.pending_ttl_s),
                              tiers=tiers, tier_weights=prefix.tiers)
        precise = PreciseIndexSource(index, lambda url: _engine_model(settings, registry, url),
                                     prefix.block_size, tiers=tiers, gather_s=prefix.gather_ms / 1000,
                                     reader=prefix.reader)
    else:
        scheduler = Scheduler(registry, profile, block_size=prefix.block_size, topology=settings.topology,
                              metrics=metrics, learn=False, index=None)

    tasks: set[asyncio.Task[object]] = set()

    def background(work: Coroutine[object, object, object]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def on_engine(event: str, engine: Engine) -> None:
        """Engines come, change and go (config, discovery): keep the index and its event feeds in
        step (``attach`` is a no-op for an unchanged endpoint), and let waiters retry."""
        if event == "removed":
            scheduler.forget(engine.url)
            if precise is not None:
                background(precise.detach(engine.url))
            if remote is not None:
                remote.detach(engine.url)
        elif remote is not None:
            _feed(remote, settings, registry, engine)
        elif precise is not None:
            if engine.kv_events:
                background(precise.attach(engine.url, engine.kv_events, replay=engine.kv_events_replay))
            elif engine.url in precise.subscribers:
                background(precise.detach(engine.url))
        admission.wake()

    registry.add_listener(on_engine)
    catalog = ModelCatalog(settings.models, sidecar if settings.render.enable else None)
    loader = AdapterLoader(engines.http, settings.lora, metrics)
    attempts = Attempts(registry, scheduler, admission, settings.resilience, metrics,
                        adapters=catalog.adapter, loader=loader)
    native = NativeRoute(NativeClient(settings.engine_client), registry, attempts,
                         obfuscated=lambda: settings.obfuscation.enabled)
    board = TriggerBoard(lambda status: metrics.trigger_callbacks.labels(str(status)).inc()) \
        if settings.uses_trigger() else None
    local = LocalTokenizers({m.name: m.tokenizer_path or m.path for m in settings.models})
    derenderer = Derenderer(sidecar, parsers=settings.render.parsers,
                            coalesce_with_parsers=settings.stream.coalesce_with_parsers)
    render = RenderStage(sidecar, catalog, settings.limits.default_max_tokens, local=local,
                         enabled=settings.render.enable,
                         context_budget=settings.limits.context_budget_mode,
                         engine_lengths=registry.max_model_lens,
                         prefix_block_size=None if prefix.source == "none" else prefix.block_size,
                         media=MediaPolicy(settings.media), media_hashes=prefix.media, native_route=native)
    pipeline = Pipeline(
        catalog=catalog,
        render=render,
        dispatcher=Dispatcher(engines, attempts, settings.topology, board,
                              EncodeLeg(engines, registry, attempts, settings.topology.encode, metrics)),
        derender=Derender(derenderer, settings.stream.queue_chunks,
                          Coalescing(settings.stream.coalesce, settings.stream.max_tokens_per_call,
                                     settings.stream.buffer_tokens)),
        strict=settings.server.request_mode == "strict",
        front=FrontGate(limiter, admission.check_early),
        observer=observer,
        native=native,
    )
    metrics.inflight.set_function(lambda: pipeline.inflight)
    metrics.stream_buffered_tokens.set_function(lambda: pipeline.derender.buffered_tokens)
    return Components(settings, sidecar, engines, registry, ledger, admission, scheduler, precise,
                      pipeline, metrics, indexer=remote, native=native, derenderer=derenderer, trigger=board,
                      metaserver=Metaserver(settings.topology.trigger, board) if board is not None else None,
                      tenants=tenants, limiter=limiter, lora=loader,
                      responses=ResponseChain(open_store(settings.responses.store, metrics.store_call)),
                      measure=render.measure if settings.render.enable else None)


def _feed(indexer: RemoteIndex, settings: Settings, registry: EngineRegistry, engine: Engine) -> None:
    """Tell the pod's indexer to mirror ``engine``'s KV events (precise source), or to stop."""
    if settings.scheduling.prefix.source != "precise":
        return
    if engine.kv_events:
        indexer.attach(engine.url, engine.kv_events, _engine_model(settings, registry, engine.url),
                       engine.kv_events_replay)
    else:
        indexer.detach(engine.url)


def _engine_model(settings: Settings, registry: EngineRegistry, url: str) -> str:
    """The model whose hash space an engine's KV events belong to (its own, else the first served)."""
    engine = registry.get(url)
    if engine is not None and engine.model:
        return engine.model
    return settings.models[0].name


def build_app(settings: Settings, metrics_registry: CollectorRegistry | None = None,
              tracer_provider: TracerProvider | None = None) -> FastAPI:
    """``metrics_registry``: collectors go there instead of a registry of the app's own (``/metrics``
    serves whichever it is, when ``server.metrics`` is on). ``tracer_provider``: see build_components."""
    c = build_components(settings, metrics_registry, tracer_provider)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await c.start()
        try:
            yield
        finally:
            await c.aclose()

    app = FastAPI(title="LLM coordinator", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.components = c
    if isinstance(c.pipeline.observer, tracing.TracingObserver):  # the client's traceparent; span ends
        app.add_middleware(tracing.TraceContextMiddleware)
    drain = install_drain(app, settings.server)  # SIGTERM: /ready 503, then drain (docs/shutdown.md)
    install_handlers(app)
    auth = ApiKeyCheck(directory=c.tenants)
    app.include_router(build_router(c.pipeline, auth, settings))
    app.include_router(build_messages_router(c.pipeline, MessagesTranslator(c.sidecar), auth, settings))
    intake = ResponsesIntake(ResponsesTranslator(c.sidecar), c.responses, c.measure)
    c.background = BackgroundRuns(intake, settings.responses.background_lease_s)
    app.include_router(build_responses_router(c.pipeline, intake, c.background, auth, settings))
    app.include_router(build_conversations_router(c.responses, auth, settings))
    if settings.nnrp.enabled:
        app.include_router(build_nnrp_router(c.pipeline, auth, settings, c.pipeline.observer, drain=drain,
                                             parsers=c.derender_parsers, models=c.pipeline.catalog.model_list,
                                             responses=intake))
    accounting = Accounting(c.pipeline, c.pipeline.derender, c.ledger, c.admission, c.engines,
                            lambda: c.sidecar.sidecars, lambda: c.registry.engines,
                            c.native.client if c.native is not None else None, trigger=c.trigger)
    accounting.export(c.metrics)
    app.state.accounting = accounting
    app.include_router(build_admin_router(c.registry, c.admission, auth, accounting=accounting.snapshot,
                                          catalog=c.pipeline.catalog, loader=c.lora))

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    async def ready_here() -> tuple[bool, dict[str, Any]]:
        """This process's own readiness: all of /ready with one process, one worker's part with several."""
        sidecars = await c.sidecar.health() if c.settings.render.enable else {}
        sidecar_ok = any(sidecars.values())
        engines = {e.url: e.state for e in c.registry.engines}
        # Without render, requests still answer through the render fallback (native route).
        fallback = c.native is not None and c.native.available()
        ok = (sidecar_ok or fallback) and c.registry.any_healthy() and not drain.draining
        fleet = c.settings.admission.fleet.backend
        return ok, {"ready": ok, "draining": drain.draining,
                    "render": sidecar_ok if c.settings.render.enable else "off",
                    "render_sidecars": sidecars, "render_fallback": fallback, "engines": engines,
                    # engines whose vLLM line the coordinator cannot use, and why (versions.py)
                    "refused": {e.url: e.refused for e in c.registry.engines if e.refused},
                    "inflight": c.pipeline.inflight, "queued": c.admission.queue_length,
                    # shared / degraded (Redis unreachable: admitting with a share) / local
                    "fleet": ("degraded" if c.ledger.fleet.degraded else "shared")
                    if fleet == "redis" else "local",
                    "prefix_index": await _index_state(c)}

    def metrics_here() -> bytes:
        """This process's collectors in the exposition format."""
        c.registry.export_metrics()
        c.scheduler.export_metrics()
        c.admission.export_metrics()
        if c.lora is not None:
            c.lora.export_metrics(c.registry.engines)
        return generate_latest(c.metrics.registry)

    # With server.workers > 1 each worker's app gets ``state.pod`` (runtime/pod.py): whichever worker a
    # client reaches answers /ready and /metrics for the whole pod from its siblings' answers.
    app.state.ready_here = ready_here
    app.state.metrics_here = metrics_here

    @app.get("/ready")
    async def ready() -> Response:
        ok, body = await ready_here()
        pod = getattr(app.state, "pod", None)
        if pod is not None:
            ok, body = await pod.ready(ok, body)
        return JSONResponse(body, status_code=200 if ok else 503)

    if settings.server.metrics:
        @app.get("/metrics")
        async def metrics() -> Response:
            text = metrics_here()
            pod = getattr(app.state, "pod", None)
            if pod is not None:
                text = await pod.metrics(text)
            return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app


async def _index_state(c: Components) -> str | dict[str, Any]:
    """``/ready``'s word on the prefix index: where it lives, and for the pod's indexer whether this
    process reaches it (down: routing on load and its own recent decisions) and what it holds."""
    if c.indexer is None:
        return "none" if c.scheduler.index is None else "local"
    stats = await c.indexer.status() if c.indexer.up else None
    state: dict[str, Any] = {"indexer": "up" if stats is not None else "down", "address": c.indexer.address}
    if len(c.indexer.lines) > 1:   # an HA pair: each line, and which one answered
        state["lines"] = {address: "up" if up else "down" for address, up in c.indexer.lines.items()}
        state["answered_by"] = c.indexer.answered_by
    if stats is not None:
        state.update(msgspec.structs.asdict(stats))
        state.pop("id", None)
    else:
        state["error"] = c.indexer.last_error or "no answer in time"
    return state


def build_fleet(settings: FleetSettings, metrics: Metrics, workers: int = 1) -> Fleet:
    """The other coordinator processes' share of the budgets (admission/fleet.py). Local with
    ``workers`` processes in the pod (``server.workers``): each admits against 1/workers of every budget."""
    if settings.backend == "local":
        return LocalFleet(scale=1.0 / workers)
    return RedisFleet(settings.redis_url, namespace=settings.namespace, lease_ttl_s=settings.lease_ttl_s,
                      sync_interval_s=settings.sync_interval_s, expected_replicas=settings.expected_replicas,
                      timeout_s=settings.timeout_s,
                      on_state=lambda degraded: metrics.fleet_degraded.set(1 if degraded else 0),
                      on_claim=lambda result: metrics.fleet_claims.labels(result).inc())


def build_limiter(settings: Settings, metrics: Metrics) -> TenantLimiter:
    """Tenants' per-minute buckets: in Redis with the Redis fleet (limits hold over every process),
    else in this process (split between ``server.workers``)."""
    fleet = settings.admission.fleet
    buckets: Buckets
    if fleet.backend == "redis":
        buckets = RedisBuckets(fleet.redis_url, namespace=fleet.namespace, timeout_s=fleet.timeout_s,
                               expected_replicas=fleet.expected_replicas)
    else:
        buckets = LocalBuckets(1.0 / settings.server.workers)
    return TenantLimiter(buckets,
                         lambda tenant, limit: metrics.tenant_rate_limited.labels(tenant, limit).inc())


async def _keep_pins(c: Components) -> None:
    """Pinned adapters loaded where they are pinned, at start-up and after every health round (an
    engine that restarted holds nothing)."""
    assert c.lora is not None
    while True:
        c.lora.keep_pins(c.registry.engines, c.pipeline.catalog.adapters())
        await asyncio.sleep(c.settings.engine_client.health_interval_s)


async def _sync_catalog(c: Components) -> None:
    """Learn max_model_len from the sidecar as soon as it answers (it may start after us)."""
    for _ in range(3600):
        if await c.pipeline.catalog.sync():
            return
        await asyncio.sleep(1.0)
