"""Render stage: client request → one ``PromptPlan`` per prompt, via the vLLM render sidecar.

The sidecar applies the chat template and tokenizer, so the token ids used for admission, KV
affinity and the engine are exactly the ones the engine would have computed itself. This stage
then fixes what the token-only path needs:

* an explicit ``max_tokens`` (``SamplingParams`` omits defaults, and ``/generate`` treats a missing
  key as "the whole remaining context", see docs/decisions.md), capped by
  ``limits.default_max_tokens`` when the client set none;
* token ids held to the model's vocabulary (``token_ids.py``): render passes client ids through
  unchecked, and a token-only engine would die on a bad one;
* stop strings moved out of ``sampling_params`` (a ``--tokens-only`` engine rejects them; the
  coordinator enforces them, see ``derender/stop.py``).

**Render fallback.** When render gives no usable answer (no connection, timeout, 5xx, a bare
404/405/501, a body without token ids: ``UpstreamUnavailable``/``UpstreamTimeout`` from the sidecar
client) the prompt is tokenized locally (``local_tokenizer.py``, same tokenizer files and chat
template) and the request takes the native route (``native_route.py``): derender lives in the same
sidecar, so the token-only path could not answer it anyway. ``ctx.tokenizer_source`` becomes
``"local"`` and ``ctx.route`` ``"native"``. A 4xx from render (``UpstreamClientError``: a bad role, a
context overflow) is the client's error and is returned as it is, never retried locally. With no
native engine for the model, or with token obfuscation on, the render error is returned, its message
saying why there was no fallback. Each request decides at its start; a stream already being
derendered never changes route.

**Context budget** (``limits.context_budget_mode``; docs/openai-api.md). The context is the
shortest of the model's ``max_model_len`` (render's ``/v1/models``) and the ``max_model_len`` of the
engines configured for it. ``off`` (default, OpenAI's rule): a ``max_tokens`` that does not fit is a
400. ``on``: render is asked with the client's budget field set to 1 (so render cannot refuse it
first), then the client's value is clamped to ``context - longest prompt`` and written to every
prompt's ``sampling_params.max_tokens`` and to the body the native route would send. Never raised,
never set when the client set none; a prompt that leaves no room at all is sent as it is, for the
engine to refuse. One INFO line names requested, effective and prompt length.

**Render circuit.** A sidecar pool that times out or fails would make every request wait
``render.timeout_s`` before falling back. After ``render.circuit_failures`` render calls in a row gave
no usable answer, the circuit opens: for ``render.circuit_cooldown_s`` requests skip render and take
the fallback at once (or get the render error at once where there is none); then one request probes
render (half-open) and its answer closes or re-opens the circuit. A 4xx from render is an answer:
it counts as a success. Only render has a circuit: derender has no fallback to go to.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Literal, cast

from coordinator.contracts.generate import GenerateRequest, SamplingParams
from coordinator.contracts.hashing import prompt_media
from coordinator.contracts.sidecar import PREFIX_HASH_HEADER, prefix_hash_spec
from coordinator.observability import tracing
from coordinator.observability.events import event
from coordinator.pipeline import native_api
from coordinator.pipeline.catalog import ModelCatalog, ModelEntry
from coordinator.pipeline.context import NativeCall, PromptPlan, RequestContext, StopSpec
from coordinator.pipeline.derender.fixups import widen_completion_logprobs, widen_logprob_token_ids
from coordinator.pipeline.engines.breaker import CircuitBreaker
from coordinator.pipeline.errors import BadRequest, UpstreamTimeout, UpstreamUnavailable
from coordinator.pipeline.local_tokenizer import LocalTokenizers
from coordinator.pipeline.media import MediaPolicy
from coordinator.pipeline.native_route import NativeRoute, require
from coordinator.pipeline.sidecar import SidecarClient
from coordinator.pipeline.token_ids import check_rendered

log = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI and vLLM default for /v1/completions
# Client sampling fields the plan keeps when render is unavailable (what _plan reads besides max_tokens).
_LOCAL_SAMPLING_FIELDS = ("n", "stop", "include_stop_str_in_output", "min_tokens")


class RenderStage:
    def __init__(self, sidecar: SidecarClient, catalog: ModelCatalog,
                 default_max_tokens: int | None = None, *, local: LocalTokenizers | None = None,
                 native_route: NativeRoute | None = None,
                 context_budget: Literal["off", "on"] = "off",
                 engine_lengths: Callable[[str], list[int]] = lambda model: [],
                 prefix_block_size: int | None = None, enabled: bool = True,
                 media: MediaPolicy | None = None, media_hashes: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Without ``local`` and ``native_route`` there is no render fallback (render errors go out).
        ``engine_lengths(model)``: the configured ``max_model_len`` of the engines that may run it.
        ``prefix_block_size``: ask render for the prompts' block hashes at this block size (the
        scheduler reads a prefix index); our sidecar adds them, vLLM's own ignores the ask.
        ``enabled`` False (``render.enable``): render is never called; every request is tokenized
        locally and takes the native route. ``media``: the checks a chat request's images pass before
        render fetches or decodes them (``media.py``; none without it); ``media_hashes`` False
        (``scheduling.prefix.media``): a prompt with images is hashed by its token ids only. ``clock``
        drives the render circuit's cooldown (tests)."""
        self._enabled = enabled
        self._media = media
        self._media_hashes = media_hashes
        self._hash_block = prefix_block_size
        self._sidecar = sidecar
        self._clamp = context_budget == "on"
        self._engine_lengths = engine_lengths
        self.circuit = CircuitBreaker(sidecar.settings.circuit_failures, sidecar.settings.circuit_cooldown_s,
                                      clock)
        self._catalog = catalog
        self._default_max_tokens = default_max_tokens
        self._local = local
        self.native_route = native_route  # the pipeline hands ``ctx.route == "native"`` requests to it

    async def __call__(self, ctx: RequestContext, entry: ModelEntry) -> None:
        with tracing.stage("render", ctx.record, kind="client") as span:
            await self._stage(ctx, entry)
            if span is not None:
                tokens = sum(p.prompt_tokens for p in ctx.prompts)
                tracing.annotate(span, {"gen_ai.request.model": ctx.model,
                                        "coordinator.prompts": len(ctx.prompts),
                                        "gen_ai.usage.input_tokens": tokens,
                                        "coordinator.tokenizer_source": ctx.tokenizer_source,
                                        "coordinator.route": ctx.route})

    async def _stage(self, ctx: RequestContext, entry: ModelEntry) -> None:
        started = time.monotonic()
        if self._media is not None and ctx.kind == "chat":
            await self._media.check(ctx.body)
        if not self._enabled:
            await self._native(ctx, entry, "render is off (render.enable: false)", UpstreamUnavailable)
            return
        try:
            rendered = await self._render(ctx)
        except (UpstreamUnavailable, UpstreamTimeout) as exc:  # not UpstreamClientError: the client's
            await self._fallback(ctx, entry, exc, started)
            return
        max_len = self._context(ctx, await self._catalog.max_model_len(entry))
        vocab = await self._catalog.vocab_size(entry)
        prompt_field = "messages" if ctx.kind == "chat" else "prompt"
        for g in rendered:
            check_rendered(g, vocab, prompt_field=prompt_field)
        requested = self._budget(ctx, [len(g["token_ids"]) for g in rendered], max_len)
        ctx.prompts = [self._plan(i, g, ctx, requested, max_len) for i, g in enumerate(rendered)]

    async def measure(self, chat: dict[str, Any]) -> tuple[int, int]:
        """The tokens render makes of a chat body's prompt, and the context it must fit with its output
        (Responses' ``truncation: "auto"`` cuts a conversation to fit by this count)."""
        entry, _ = self._catalog.resolve_named(chat.get("model"))
        body = {k: v for k, v in chat.items()
                if k not in ("max_tokens", "max_completion_tokens", "stream", "stream_options")}
        body["model"] = entry.name  # an alias or an adapter renders as the served model, as in serve()
        out = await self._sidecar.post("/v1/chat/completions/render", body, stage="render")
        first = out[0] if isinstance(out, list) and out else out
        ids = first.get("token_ids") if isinstance(first, dict) else None
        if not isinstance(ids, list):
            raise UpstreamUnavailable("render sidecar returned no token ids")
        model_len = await self._catalog.max_model_len(entry)
        return len(ids), min([model_len, *self._engine_lengths(entry.name)])

    def _context(self, ctx: RequestContext, model_len: int) -> int:
        """The context every prompt must fit: the model's, or a shorter engine's."""
        return min([model_len, *self._engine_lengths(ctx.model)])

    def _budget(self, ctx: RequestContext, prompt_lengths: list[int], max_len: int) -> int | None:
        """The client's output budget, clamped to what fits when ``context_budget_mode`` is on."""
        field = "max_completion_tokens" if ctx.body.get("max_completion_tokens") else "max_tokens"
        raw = ctx.body.get(field)
        if raw is None:
            return None
        requested = max(int(raw), 1)  # 0 only with completions' echo: one step, the prompt answered alone
        if not self._clamp:
            return requested
        longest = max(prompt_lengths, default=0)
        room = max_len - longest
        if room < 1 or requested <= room:
            return requested  # fits, or nothing fits: the engine refuses it
        log.info("request %s: context budget: requested %d output tokens, effective %d "
                 "(prompt %d tokens, context %d)", ctx.request_id, requested, room, longest, max_len)
        ctx.body[field] = room  # what the native route would send
        return room

    async def _render(self, ctx: RequestContext) -> list[dict[str, Any]]:
        """One render call through the render circuit (module doc)."""
        circuit = self.circuit
        if not circuit.available():
            raise UpstreamUnavailable(f"render circuit open after {self._sidecar.settings.circuit_failures} "
                                      f"failed render calls in a row")
        circuit.on_pick()
        try:
            rendered = await self._render_call(ctx)
        except (UpstreamUnavailable, UpstreamTimeout):
            opened_before = circuit.state != "closed"
            circuit.record_failure()
            if circuit.state == "open" and not opened_before:
                log.warning("render circuit open for %.1fs: render calls keep failing",
                            self._sidecar.settings.circuit_cooldown_s)
            raise
        except asyncio.CancelledError:
            circuit.release_trial()
            raise
        except BaseException:
            circuit.record_success()  # render answered (a 4xx for this request)
            raise
        if circuit.state != "closed":
            log.info("render circuit closed: render answers again")
        circuit.record_success()
        return rendered

    async def _render_call(self, ctx: RequestContext) -> list[dict[str, Any]]:
        path = "/v1/chat/completions/render" if ctx.kind == "chat" else "/v1/completions/render"
        body = ctx.body
        if self._clamp:  # render must not refuse a budget the coordinator will clamp (module doc)
            body = {**body, **{f: 1 for f in ("max_completion_tokens", "max_tokens") if body.get(f)}}
        headers = None
        seed = ctx.adapter or ctx.model  # an adapter's blocks are its own (vLLM keys them by LoRA name)
        if self._hash_block is not None and seed.isascii():  # the model name seeds the chain
            headers = {PREFIX_HASH_HEADER: prefix_hash_spec(self._hash_block, seed)}
        out = await self._sidecar.post(path, body, request_id=ctx.request_id, stage="render", headers=headers)
        rendered = [out] if isinstance(out, dict) else out
        if not isinstance(rendered, list) or not rendered or not all(
                isinstance(g, dict) and isinstance(g.get("token_ids"), list) for g in rendered):
            raise UpstreamUnavailable("render sidecar returned an unexpected body (no token_ids)")
        return rendered

    async def _fallback(self, ctx: RequestContext, entry: ModelEntry,
                        error: UpstreamUnavailable | UpstreamTimeout, started: float) -> None:
        """Render gave no usable answer: local tokenizer + native route, or the render error saying
        why not (same status: 502, or 504 for a timeout)."""
        if self._local is None or self.native_route is None:
            raise error
        await self._native(ctx, entry, f"render is unavailable ({error.message})", type(error))
        event(log, "render_fallback", ctx.request_id, level=logging.WARNING, model=ctx.model,
              reason=error.message, latency_ms=round((time.monotonic() - started) * 1000, 2),
              fallback="local_tokenizer", route="native")

    async def _native(self, ctx: RequestContext, entry: ModelEntry, why: str,
                      error: type[UpstreamUnavailable] | type[UpstreamTimeout]) -> None:
        """Plan ``ctx`` for the native route from the local tokenizer's ids; ``why`` render was not
        used starts the message of every refusal (raised as ``error``: 502, or 504 after a timeout)."""
        native = self.native_route
        if self._local is None or native is None:
            raise error(f"{why} and no engine's own OpenAI API is configured")
        require(native, ctx.model, why, error)
        try:
            prompts = await self._local.tokenize(ctx.kind, ctx.body, entry.name, entry.root)
        except UpstreamUnavailable as exc:
            raise error(f"{why} and {exc.message}") from exc
        model_len = await native.context_length(entry)
        if model_len is None:
            raise error(f"{why} and the context length of model {entry.name!r} is unknown "
                        "(set models[].max_model_len)")
        max_len = self._context(ctx, model_len)
        sp = {k: ctx.body[k] for k in _LOCAL_SAMPLING_FIELDS if ctx.body.get(k) is not None}
        requested = self._budget(ctx, [len(ids) for ids in prompts], max_len)
        ctx.prompts = [self._plan(i, {"request_id": ctx.request_id, "token_ids": ids, "sampling_params": sp},
                                  ctx, requested, max_len) for i, ids in enumerate(prompts)]
        ctx.tokenizer_source = "local"
        ctx.route = "native"

    async def native_api(self, ctx: RequestContext, entry: ModelEntry, call: NativeCall) -> None:
        """Plan another API's request for the engines' own route (``native_api.py``): the sidecar
        could not convert it, so nothing is rendered; the local tokenizer estimates its size."""
        with tracing.stage("render", ctx.record, kind="client"):
            await native_api.plan(ctx, entry, call, local=self._local, route=self.native_route,
                                  default_max_tokens=self._default_max_tokens)
        event(log, "native_api", ctx.request_id, level=logging.WARNING, model=ctx.model, api=call.api,
              reason=call.reason.message, prompt_tokens=ctx.prompts[0].prompt_tokens, route="native")

    def _plan(self, index: int, gr: dict[str, Any], ctx: RequestContext, requested: int | None,
              max_len: int) -> PromptPlan:
        gr = dict(gr)  # becomes the plan's GenerateRequest; render's answer stays as it came
        ids: list[int] = gr["token_ids"]
        hashes = gr.pop("block_hashes", None)   # never sent on to the engine
        block = self._hash_block
        if not (block and isinstance(hashes, list) and len(hashes) == len(ids) // block):
            hashes = None
        media = prompt_media(gr.get("features"))
        if media and not self._media_hashes:  # render's hashes cover the images; the baseline's do not
            media, hashes = [], None
        room = max_len - len(ids)
        fills = room < 1  # with context_budget_mode on, sent as it is: the engine refuses it
        if fills and not self._clamp:
            raise BadRequest(
                f"This model's maximum context length is {max_len} tokens. However, your prompt "
                f"contains {len(ids)} tokens, which leaves no room for output.", param="messages"
                if ctx.kind == "chat" else "prompt")
        if requested is not None and requested > room and not fills:
            raise BadRequest(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{len(ids) + requested} tokens ({len(ids)} in the prompt, {requested} for the "
                f"completion). Please reduce the prompt or max_tokens.",
                param="max_completion_tokens" if "max_completion_tokens" in ctx.body else "max_tokens")
        sp: dict[str, Any] = dict(gr.get("sampling_params") or {})
        if requested is not None:
            sp["max_tokens"] = requested
        else:
            if "max_tokens" not in sp:
                # Omitted by SamplingParams serialisation when equal to its default (16).
                sp["max_tokens"] = (COMPLETIONS_DEFAULT_MAX_TOKENS if ctx.kind == "completion"
                                    else max(room, 1))
            if self._default_max_tokens is not None:  # the operator's cap for clients that set none
                sp["max_tokens"] = min(int(sp["max_tokens"]), self._default_max_tokens)
        if not fills:
            sp["max_tokens"] = min(int(sp["max_tokens"]), room)
        stop = sp.pop("stop", None) or []
        spec = StopSpec(tuple([stop] if isinstance(stop, str) else stop),
                        bool(sp.get("include_stop_str_in_output", False)), int(sp.get("min_tokens", 0)))
        if ctx.kind == "completion":
            widen_completion_logprobs(sp)  # cut back to native's count after the engine (fixups.py)
        widen_logprob_token_ids(sp)
        generate = cast(GenerateRequest, gr)  # a copy already (above); the JSON render answered
        generate["sampling_params"] = cast(SamplingParams, sp)
        # The engine's own queue order (``--scheduling-policy priority``), the same value admission
        # ordered by: the body's ``priority`` or the door's priority header.
        generate["priority"] = ctx.priority
        if ctx.adapter is not None:  # rendered as the base model; the engine runs the adapter
            generate["model"] = ctx.adapter
        return PromptPlan(index=index, generate=generate, prompt_token_ids=ids,
                          n=int(sp.get("n", 1)), stop=spec, block_hashes=hashes, media=media)
