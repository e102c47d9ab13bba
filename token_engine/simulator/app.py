"""The simulated `vllm serve --tokens-only` HTTP surface.

Routes, status codes, error bodies and JSON/SSE bytes follow vLLM 0.32's
`entrypoints/scale_out/token_in_token_out/{api_router,serving}.py`; see docs/simulator.md for what is and is
not modelled. `/sim/*` routes exist only here: test introspection and fault hooks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from . import layerwise
from .config import SimConfig
from .engine import SimEngine, SimRequest
from .errors import (
    ENGINE_DEAD_MESSAGE,
    NO_TOKENIZER_MESSAGE,
    STRUCTURED_OUTPUTS_NEED_TOKENIZER,
    GenerationError,
    SimHTTPError,
    error_body,
    install_exception_handlers,
    streaming_error_data,
    validate_json_request,
)
from .faults import SimFaults
from .kv_events import ZmqEventPublisher
from .metrics import CONTENT_TYPE, build_registry, render
from .prefix_cache import media_items
from .protocol import (
    GenerateLogProbs,
    GenerateRequest,
    GenerateTokensChoice,
    GenerateTokensResponse,
    GenerateTokensStreamChoice,
    GenerateTokensStreamResponse,
    ModelCard,
    ModelList,
    ModelPermission,
    PromptTokenUsageInfo,
    UsageInfo,
    WeightVersionSpan,
)

T = TypeVar("T")
_GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")


class DropConnection(Exception):
    """Raised inside a streaming body to make the server cut the connection mid-response."""


class _DropConnectionLogFilter(logging.Filter):
    """Keep uvicorn from logging a traceback for connections we cut on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        while exc is not None:
            if isinstance(exc, DropConnection):
                return False
            exc = exc.__cause__ or exc.__context__
        return True


def _install_log_filter() -> None:
    log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _DropConnectionLogFilter) for f in log.filters):
        log.addFilter(_DropConnectionLogFilter())


class _ApiKeyMiddleware:
    """vLLM's AuthenticationMiddleware: bearer token on /v1, /v2, /inference, /cohere; 401 otherwise."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if path.startswith(_GUARDED_PREFIX) and not (
                scheme.lower() == "bearer" and token == self.api_key
            ):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _listen_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _with_cancellation(request: Request, work: Awaitable[T]) -> T | None:
    """vLLM's @with_cancellation: race the handler against the client's disconnect, cancelling the loser."""
    handler = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_listen_for_disconnect(request))
    done, pending = await asyncio.wait({handler, listener}, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    if handler in done:
        return handler.result()
    return None


_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def _received(request: GenerateRequest, raw: Request) -> dict[str, Any]:
    sp = request.sampling_params
    return {"request_id": raw.headers.get("X-Request-Id", request.request_id), "stream": bool(request.stream),
            "model": request.model,
            "prompt_tokens": len(request.token_ids),
            "sampling_params": {"max_tokens": sp.max_tokens, "n": sp.n, "min_tokens": sp.min_tokens},
            "kv_transfer_params": request.kv_transfer_params
            or (sp.extra_args or {}).get("kv_transfer_params"),
            "ec_transfer_params": request.ec_transfer_params,
            "media": [h for h, _, _ in media_items(request.features)],
            "traceparent": raw.headers.get("traceparent")}


def _fault_response(faults: SimFaults) -> Response:
    """The injected failure: the configured body, or an ErrorResponse shaped like vLLM's for that status."""
    status = faults.fail_status
    body = faults.fail_body
    if body is None:
        phrase = HTTPStatus(status).phrase
        err_type = _ERROR_TYPES.get(status, phrase.replace(" ", "").replace("-", "") + "Error")
        return JSONResponse(error_body(f"Simulated failure ({phrase})", err_type, status), status)
    if isinstance(body, str):
        return Response(body, status_code=faults.fail_status, media_type="text/plain")
    return JSONResponse(body, status_code=faults.fail_status)


class SimServer:
    """Request handling shared by the routes; owns the engine and the fault set."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.kv_events: ZmqEventPublisher | None = None
        if config.kv_events_endpoint is not None:
            self.kv_events = ZmqEventPublisher(
                config.kv_events_endpoint,
                config.kv_events_topic,
                replay_endpoint=config.kv_events_replay_endpoint,
            )
        self.engine = SimEngine(config, self.kv_events.publish if self.kv_events else None)
        self.faults = SimFaults()
        self.registry = build_registry(self.engine)
        self.generate_calls = 0
        self.history: deque[dict[str, Any]] = deque(maxlen=256)
        """The last generate calls as received (id, stream, max_tokens, kv_transfer_params, traceparent):
        lets a test see what a coordinator sent to each leg of a P/D handoff."""
        self.last_ids: dict[str, Any] | None = None
        """The token ids of the last generate call as received (prompt, stop_token_ids): lets a test see
        which ids reached the engine (token obfuscation sends physical ones)."""

    # ------------------------------------------------------------------ generate

    async def serve_generate(self, request: GenerateRequest, raw: Request) -> Response:
        self.generate_calls += 1
        self.history.append(_received(request, raw))
        self.last_ids = {"token_ids": list(request.token_ids),
                         "stop_token_ids": list(request.sampling_params.stop_token_ids or [])}
        if self.faults.take_failure():
            return _fault_response(self.faults)
        call_faults = self.faults.take_call()
        if call_faults is not None and call_faults.delay_headers_s > 0:
            await asyncio.sleep(call_faults.delay_headers_s)
        if call_faults is not None and call_faults.hang:
            await asyncio.Event().wait()

        cfg = self.config
        loras = self.engine.loras
        if request.model and request.model != cfg.model and request.model not in loras.registered:
            raise SimHTTPError(
                f"The model `{request.model}` does not exist. Valid aliases: {cfg.model}.",
                "NotFoundError",
                404,
                "model",
            )
        if self.faults.health_dead:
            raise SimHTTPError(ENGINE_DEAD_MESSAGE, "InternalServerError", 500)
        if max(request.token_ids) >= cfg.vocab_size:
            # A --tokens-only engine has no tokenizer, so vLLM skips its vocabulary check and the
            # embedding lookup fails in the worker: EngineDeadError (500), and the process exits.
            self.faults.health_dead = True
            raise SimHTTPError(ENGINE_DEAD_MESSAGE, "InternalServerError", 500)
        header_id = raw.headers.get("X-Request-Id")  # the header wins over the body, even when empty
        request_id = f"generate-tokens-{request.request_id if header_id is None else header_id}"
        sp = request.sampling_params
        if sp.n > cfg.max_num_seqs:
            raise SimHTTPError(
                f"sampling_params.n must be at most the server's max_num_seqs ({cfg.max_num_seqs}), "
                f"got {sp.n}."
            )
        if request.stream and sp.prompt_logprob_token_ids is not None:
            raise SimHTTPError("prompt_logprob_token_ids are not available when stream=true.")
        if sp.stop:
            raise SimHTTPError(
                "stop strings are not supported on a --tokens-only server because detokenization is "
                "disabled. Check stop strings on the coordinator, or use stop_token_ids."
            )
        if request.output_mode != "tokens":
            raise SimHTTPError(
                f"output_mode={request.output_mode!r} requires a tokenizer, but this server does not load "
                "one (--tokens-only or --skip-tokenizer-init). Send the request to a server that loads a "
                "tokenizer, or use output_mode='tokens'."
            )
        # Top-level kv_transfer_params overwrite the ones render put into extra_args.
        kv_params = request.kv_transfer_params
        if kv_params is None:
            candidate = (sp.extra_args or {}).get("kv_transfer_params")
            kv_params = candidate if isinstance(candidate, dict) else None
        max_tokens = sp.max_tokens
        if not request.max_tokens_provided():
            prompt_len = len(request.token_ids)
            if cfg.max_model_len < prompt_len:
                raise ValueError(
                    f"Input length ({prompt_len}) exceeds model's maximum context length "
                    f"({cfg.max_model_len})."
                )
            max_tokens = min(
                v for v in (cfg.max_model_len - prompt_len, cfg.default_max_tokens) if v is not None
            )
        sim_req = SimRequest(
            external_id=request_id,
            prompt=list(request.token_ids),
            params=sp,
            max_tokens=max_tokens,
            cache_salt=request.cache_salt,
            priority=request.priority,
            kv_transfer_params=kv_params,
            error_after_tokens=call_faults.error_after_tokens if call_faults else None,
            peer_url=str(raw.base_url).rstrip("/"),
            lora=request.model if request.model in loras.registered else None,
            media=media_items(request.features),
        )
        if request.stream:
            return StreamingResponse(
                self._stream(request, sim_req, call_faults), media_type="text/event-stream"
            )
        return await self._full(request, sim_req)

    @staticmethod
    def _admit_params(req: SimRequest) -> None:
        """What vLLM's engine client checks when it takes the request (``SamplingParams.verify``), i.e.
        after a stream's 200: a token-only engine has no tokenizer to build a grammar with."""
        if req.params.structured_outputs is not None:
            raise SimHTTPError(STRUCTURED_OUTPUTS_NEED_TOKENIZER)

    async def _full(self, request: GenerateRequest, req: SimRequest) -> Response:
        created = int(time.time())
        self._admit_params(req)
        async with contextlib.aclosing(self.engine.generate(req)) as outputs:
            async for _ in outputs:
                pass
        choices: list[GenerateTokensChoice] = []
        for c in req.choices:
            if c.finish_reason == "error":
                raise GenerationError("Internal server error")
            choices.append(
                GenerateTokensChoice(
                    index=c.index,
                    logprobs=GenerateLogProbs(content=list(c.logprobs)) if c.want_logprobs else None,
                    finish_reason=c.finish_reason or "stop",
                    stop_reason=c.stop_reason,
                    token_ids=list(c.tokens),
                    weight_versions=[WeightVersionSpan(**w) for w in self.engine._weight_versions(c)],
                )
            )
        completion = sum(len(c.tokens) for c in req.choices)
        usage = UsageInfo(
            prompt_tokens=len(req.prompt),
            completion_tokens=completion,
            total_tokens=len(req.prompt) + completion,
        )
        if self.config.enable_prompt_tokens_details:
            usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=req.num_cached_tokens)
        response = GenerateTokensResponse(
            request_id=req.external_id,
            created=created,
            model=req.lora or self.config.model,
            usage=usage,
            prompt_token_ids=list(req.prompt) if request.return_token_ids else None,
            kv_transfer_params=req.response_kv_transfer_params,
            ec_transfer_params=req.response_ec_transfer_params,
            choices=choices,
        )
        return JSONResponse(content=response.model_dump())

    async def _stream(
        self, request: GenerateRequest, req: SimRequest, faults: SimFaults | None
    ) -> AsyncIterator[str]:
        """vLLM's serve_tokens_stream_generator, chunk for chunk."""
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts and opts.continuous_usage_stats)
        num_prompt = len(req.prompt)
        prompt_ids: list[int] | None = list(req.prompt) if request.return_token_ids else None
        generated = [0] * req.params.n
        tokens_sent = 0
        try:
            self._admit_params(req)
            if faults is not None:  # "after 0 tokens": the 200 went out, no chunk did
                await self._mid_stream_faults(req, faults, tokens_sent)
            async with contextlib.aclosing(self.engine.generate(req)) as outputs:
                async for delta in outputs:
                    generated[delta.index] += len(delta.token_ids)
                    if delta.finish_reason == "error":
                        raise GenerationError("Internal server error")
                    if not (delta.token_ids or delta.finish_reason is not None):
                        continue
                    chunk = GenerateTokensStreamResponse(
                        request_id=req.external_id,
                        choices=[
                            GenerateTokensStreamChoice(
                                index=delta.index,
                                logprobs=None
                                if delta.logprobs is None
                                else GenerateLogProbs(content=delta.logprobs),
                                finish_reason=delta.finish_reason,
                                stop_reason=delta.stop_reason,
                                token_ids=delta.token_ids,
                                weight_versions=(
                                    None
                                    if delta.weight_versions is None
                                    else [WeightVersionSpan(**w) for w in delta.weight_versions]
                                ),
                            )
                        ],
                    )
                    if prompt_ids is not None:
                        chunk.prompt_token_ids = prompt_ids
                        prompt_ids = None
                    if continuous:
                        chunk.usage = UsageInfo(
                            prompt_tokens=num_prompt,
                            completion_tokens=generated[delta.index],
                            total_tokens=num_prompt + generated[delta.index],
                        )
                    exclude = {
                        n
                        for n in ("prompt_token_ids", "mm_placeholders", "metrics")
                        if getattr(chunk, n) is None
                    }
                    yield f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"
                    tokens_sent += len(delta.token_ids)
                    if faults is not None:
                        await self._mid_stream_faults(req, faults, tokens_sent)
            total = sum(generated)
            final_usage = UsageInfo(
                prompt_tokens=num_prompt, completion_tokens=total, total_tokens=num_prompt + total
            )
            if self.config.enable_prompt_tokens_details:
                final_usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=req.num_cached_tokens)
            if include_usage:
                final = GenerateTokensStreamResponse(
                    request_id=req.external_id, choices=[], usage=final_usage
                )
                yield f"data: {final.model_dump_json(exclude_none=True)}\n\n"
        except DropConnection:
            raise
        except Exception as exc:  # vLLM turns any engine error after the 200 into an error event
            yield f"data: {streaming_error_data(exc)}\n\n"
        yield "data: [DONE]\n\n"

    async def _mid_stream_faults(self, req: SimRequest, faults: SimFaults, tokens_sent: int) -> None:
        if faults.drop_after_tokens is not None and tokens_sent >= faults.drop_after_tokens:
            self.engine.abort_internal(req)
            raise DropConnection(f"simulated connection drop after {tokens_sent} tokens")
        if faults.stall_after_tokens is not None and tokens_sent >= faults.stall_after_tokens:
            await asyncio.Event().wait()

    # ------------------------------------------------------------------ other routes

    async def abort_requests(self, raw: Request) -> Response:
        """vLLM's abort handler: 200 with an empty body; matching is by external id."""
        try:
            body = await raw.json()
        except json.JSONDecodeError as e:
            raise HTTPException(status_code=400, detail=f"JSON decode error: {e}") from e
        request_ids = body.get("request_ids")
        if request_ids is None:
            raise HTTPException(status_code=400, detail="Missing 'request_ids' in request body")
        self.engine.abort(request_ids)
        return Response(status_code=200)

    async def consume_transfer(self, raw: Request) -> JSONResponse:
        """`POST /sim/kv_transfer/consume {"remote_request_id": ...}`: a decode engine pulled the blocks."""
        _, rid = await _id_body(raw, "remote_request_id")
        pinned = self.engine.transfers.consume(rid)
        return JSONResponse({"released": pinned is not None, "blocks": pinned.blocks if pinned else 0})

    async def layerwise_done(self, raw: Request) -> JSONResponse:
        """`POST /sim/kv_transfer/layerwise_done {"request_id", "status": "done"|"failed"}`: a trigger
        prefill engine's done/failed-sending message (the stand-in for its ZMQ side channel)."""
        body, rid = await _id_body(raw, "request_id")
        waited = self.engine.layerwise.arrived(rid, body.get("status") == "done")
        return JSONResponse({"waiting": waited})

    def close(self) -> None:
        """Stop the KV event publisher (frees its port); the HTTP side needs no cleanup."""
        if self.kv_events is not None:
            self.kv_events.close()

    def models(self) -> ModelList:
        cfg = self.config
        adapters = [
            ModelCard(id=name, root=path, parent=cfg.model, permission=[ModelPermission()])
            for name, path in self.engine.loras.registered.items()
        ]
        return ModelList(
            data=[
                ModelCard(
                    id=cfg.model,
                    max_model_len=cfg.max_model_len,
                    root=cfg.served_root,
                    permission=[ModelPermission()],
                ),
                *adapters,
            ]
        )

    async def load_lora(self, raw: Request) -> Response:
        body = await raw.json()
        text = await self.engine.loras.load(
            str(body.get("lora_name") or ""), str(body.get("lora_path") or ""), bool(body.get("load_inplace"))
        )
        return Response(status_code=200, content=text)

    async def unload_lora(self, raw: Request) -> Response:
        body = await raw.json()
        return Response(status_code=200, content=self.engine.loras.unload(str(body.get("lora_name") or "")))

    def state(self) -> dict[str, Any]:
        eng = self.engine
        return {
            "running": [r.external_id for r in eng.running],
            "waiting": [r.external_id for r in eng.waiting],
            "aborted": list(eng.stats.aborted_ids),
            "completed": eng.stats.completed,
            "errored": eng.stats.errored,
            "requests_total": eng.stats.requests_total,
            "generate_calls": self.generate_calls,
            "history": list(self.history),
            "last_ids": self.last_ids,
            "loras": {
                "registered": dict(eng.loras.registered),
                "cached": list(eng.loras.cache),
                "weight_loads": eng.loras.weight_loads,
                "load_calls": eng.loras.load_calls,
                "running": sorted({r.lora for r in eng.running if r.lora}),
                "deferred": [r.external_id for r in eng.deferred()],
            },
            "prefix_cache": {
                "blocks": len(eng.prefix_cache),
                "capacity_blocks": eng.prefix_cache.capacity_blocks,
                "queries": eng.prefix_cache.stats.queries,
                "hits": eng.prefix_cache.stats.hits,
                "evictions": eng.prefix_cache.stats.evictions,
                "offload_blocks": eng.prefix_cache.offloaded_len,
                "offload_capacity_blocks": eng.prefix_cache.offload_blocks,
                "offload_hits": eng.prefix_cache.stats.offload_hits,
            },
            "pinned_transfers": eng.transfers.snapshot(),
            "kv_transfer_pinned_blocks": eng.transfers.pinned_blocks,
            "kv_transfer_released": dict(eng.transfers.released),
            "layerwise": {
                "waiting_for_kv": eng.layerwise.waiting,
                "callbacks_sent": eng.layerwise.callbacks_sent,
                "callbacks_failed": eng.layerwise.callbacks_failed,
                "callback_statuses": list(eng.layerwise.callback_statuses),
                "pushed": dict(eng.layerwise.pushed),
            },
            "kv_events": None
            if self.kv_events is None
            else {
                "endpoint": self.kv_events.endpoint,
                "replay_endpoint": self.kv_events.replay_endpoint,
                "topic": self.kv_events.topic,
                "published": self.kv_events.published,
                "dropped": self.kv_events.dropped,
            },
        }


async def _id_body(raw: Request, key: str) -> tuple[dict[str, Any], str]:
    """A test-hook body carrying a request id under ``key`` (400 otherwise)."""
    try:
        body = await raw.json()
    except json.JSONDecodeError as e:
        raise HTTPException(status_code=400, detail=f"JSON decode error: {e}") from e
    rid = body.get(key) if isinstance(body, dict) else None
    if not isinstance(rid, str):
        raise HTTPException(status_code=400, detail=f"Missing '{key}' in request body")
    return body, rid


def build_app(config: SimConfig | None = None) -> FastAPI:
    """A FastAPI app that behaves like `vllm serve --tokens-only` for the scale-out routes."""
    cfg = config or SimConfig()
    server = SimServer(cfg)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        server.close()

    app = FastAPI(title="simulated vLLM token-only engine", lifespan=lifespan)
    app.state.sim = server
    install_exception_handlers(app)
    _install_log_filter()
    if cfg.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=cfg.api_key)

    @app.post("/inference/v1/generate", dependencies=[Depends(validate_json_request)], response_model=None)
    async def generate(request: GenerateRequest, raw_request: Request) -> Response | None:
        return await _with_cancellation(raw_request, server.serve_generate(request, raw_request))

    abort_handler: Callable[[Request], Awaitable[Response]] = server.abort_requests
    if cfg.abort_route:
        app.add_api_route("/inference/v1/abort_requests", abort_handler, methods=["POST"])
    if cfg.legacy_abort_route:
        app.add_api_route("/abort_requests", abort_handler, methods=["POST"])

    if cfg.enable_lora and cfg.runtime_lora_updating:
        load_handler: Callable[[Request], Awaitable[Response]] = server.load_lora
        unload_handler: Callable[[Request], Awaitable[Response]] = server.unload_lora
        app.add_api_route("/v1/load_lora_adapter", load_handler, methods=["POST"])
        app.add_api_route("/v1/unload_lora_adapter", unload_handler, methods=["POST"])

    @app.post("/tokenize")
    async def tokenize() -> JSONResponse:
        # `--tokens-only` forces skip_tokenizer_init: vLLM's /tokenize answers this 400 (the
        # coordinator reads it as "no tokenizer, no structured outputs").
        return JSONResponse(error_body(NO_TOKENIZER_MESSAGE, "BadRequestError", 400), status_code=400)

    if server.config.vllm_version is not None:
        @app.get("/version")
        async def version() -> JSONResponse:
            return JSONResponse({"version": server.config.vllm_version})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if server.faults.health_dead else 200)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(content=server.models().model_dump())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(server.registry), media_type=CONTENT_TYPE)

    @app.get("/sim/state")
    async def sim_state() -> JSONResponse:
        return JSONResponse(server.state())

    @app.get("/sim/faults")
    async def get_faults() -> JSONResponse:
        return JSONResponse(server.faults.model_dump())

    @app.post("/sim/faults")
    async def set_faults(faults: SimFaults) -> JSONResponse:
        server.faults = faults
        return JSONResponse(faults.model_dump())

    @app.delete("/sim/faults")
    async def clear_faults() -> JSONResponse:
        server.faults = SimFaults()
        return JSONResponse(server.faults.model_dump())

    consume_handler: Callable[[Request], Awaitable[JSONResponse]] = server.consume_transfer
    app.add_api_route("/sim/kv_transfer/consume", consume_handler, methods=["POST"])
    done_handler: Callable[[Request], Awaitable[JSONResponse]] = server.layerwise_done
    app.add_api_route(layerwise.DONE_PATH, done_handler, methods=["POST"])

    @app.post("/sim/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        server.engine.prefix_cache.clear()
        return Response(status_code=200)

    return app
