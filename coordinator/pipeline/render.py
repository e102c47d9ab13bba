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
"""

from __future__ import annotations

import logging
import time
from typing import Any

from coordinator.observability import tracing
from coordinator.observability.events import event
from coordinator.pipeline.catalog import ModelCatalog, ModelEntry
from coordinator.pipeline.context import PromptPlan, RequestContext
from coordinator.pipeline.derender.stop import StopSpec
from coordinator.pipeline.errors import BadRequest, PipelineError, UpstreamTimeout, UpstreamUnavailable
from coordinator.pipeline.local_tokenizer import LocalTokenizers
from coordinator.pipeline.native_route import NativeRoute
from coordinator.pipeline.sidecar import SidecarClient
from coordinator.pipeline.token_ids import check_rendered

log = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI and vLLM default for /v1/completions
# Client sampling fields the plan keeps when render is unavailable (what _plan reads besides max_tokens).
_LOCAL_SAMPLING_FIELDS = ("n", "stop", "include_stop_str_in_output", "min_tokens")


class RenderStage:
    def __init__(self, sidecar: SidecarClient, catalog: ModelCatalog,
                 default_max_tokens: int | None = None, *, local: LocalTokenizers | None = None,
                 native_route: NativeRoute | None = None) -> None:
        """Without ``local`` and ``native_route`` there is no render fallback (render errors go out)."""
        self._sidecar = sidecar
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
        try:
            rendered = await self._render(ctx)
        except (UpstreamUnavailable, UpstreamTimeout) as exc:  # not UpstreamClientError: the client's
            await self._fallback(ctx, entry, exc, started)
            return
        max_len = await self._catalog.max_model_len(entry)
        vocab = await self._catalog.vocab_size(entry)
        prompt_field = "messages" if ctx.kind == "chat" else "prompt"
        for g in rendered:
            check_rendered(g, vocab, prompt_field=prompt_field)
        requested = ctx.body.get("max_completion_tokens") or ctx.body.get("max_tokens")
        ctx.prompts = [self._plan(i, g, ctx, requested, max_len) for i, g in enumerate(rendered)]

    async def _render(self, ctx: RequestContext) -> list[dict[str, Any]]:
        path = "/v1/chat/completions/render" if ctx.kind == "chat" else "/v1/completions/render"
        out = await self._sidecar.post(path, ctx.body, request_id=ctx.request_id, stage="render")
        rendered = [out] if isinstance(out, dict) else out
        if not isinstance(rendered, list) or not rendered or not all(
                isinstance(g, dict) and isinstance(g.get("token_ids"), list) for g in rendered):
            raise UpstreamUnavailable("render sidecar returned an unexpected body (no token_ids)")
        return rendered

    async def _fallback(self, ctx: RequestContext, entry: ModelEntry,
                        error: UpstreamUnavailable | UpstreamTimeout, started: float) -> None:
        """Render gave no usable answer: local tokenizer + native route, or the render error saying
        why not (same status: 502, or 504 for a timeout)."""
        native = self.native_route
        if self._local is None or native is None:
            raise error
        refusal = native.refusal(ctx.model, f"render is unavailable ({error.message})")
        if refusal is not None:
            raise _with_message(error, refusal.message) if isinstance(refusal, UpstreamUnavailable) \
                else refusal
        try:
            prompts = await self._local.tokenize(ctx.kind, ctx.body, entry.name, entry.root)
        except UpstreamUnavailable as exc:
            raise _with_message(error, f"render is unavailable ({error.message}) and {exc.message}") from exc
        max_len = await native.context_length(entry)
        if max_len is None:
            raise _with_message(error, f"render is unavailable ({error.message}) and the context length "
                                f"of model {entry.name!r} is unknown (set models[].max_model_len)")
        sp = {k: ctx.body[k] for k in _LOCAL_SAMPLING_FIELDS if ctx.body.get(k) is not None}
        requested = ctx.body.get("max_completion_tokens") or ctx.body.get("max_tokens")
        ctx.prompts = [self._plan(i, {"request_id": ctx.request_id, "token_ids": ids, "sampling_params": sp},
                                  ctx, requested, max_len) for i, ids in enumerate(prompts)]
        ctx.tokenizer_source = "local"
        ctx.route = "native"
        event(log, "render_fallback", ctx.request_id, level=logging.WARNING, model=ctx.model,
              reason=error.message, latency_ms=round((time.monotonic() - started) * 1000, 2),
              fallback="local_tokenizer", route="native")

    def _plan(self, index: int, gr: dict[str, Any], ctx: RequestContext, requested: int | None,
              max_len: int) -> PromptPlan:
        ids: list[int] = gr["token_ids"]
        room = max_len - len(ids)
        if room < 1:
            raise BadRequest(
                f"This model's maximum context length is {max_len} tokens. However, your prompt "
                f"contains {len(ids)} tokens, which leaves no room for output.", param="messages"
                if ctx.kind == "chat" else "prompt")
        if requested is not None and requested > room:
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
                sp["max_tokens"] = COMPLETIONS_DEFAULT_MAX_TOKENS if ctx.kind == "completion" else room
            if self._default_max_tokens is not None:  # the operator's cap for clients that set none
                sp["max_tokens"] = min(int(sp["max_tokens"]), self._default_max_tokens)
        sp["max_tokens"] = min(int(sp["max_tokens"]), room)
        stop = sp.pop("stop", None) or []
        spec = StopSpec(tuple([stop] if isinstance(stop, str) else stop),
                        bool(sp.get("include_stop_str_in_output", False)), int(sp.get("min_tokens", 0)))
        generate = dict(gr)
        generate["sampling_params"] = sp
        return PromptPlan(index=index, generate=generate, prompt_token_ids=ids,
                          n=int(sp.get("n", 1)), stop=spec)


def _with_message(error: PipelineError, message: str) -> PipelineError:
    """The same kind of error (status, type) with a message that says why there was no fallback."""
    return type(error)(message)
