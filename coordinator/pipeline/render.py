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
"""

from __future__ import annotations

from typing import Any

from coordinator.pipeline.catalog import ModelCatalog, ModelEntry
from coordinator.pipeline.context import PromptPlan, RequestContext
from coordinator.pipeline.derender.stop import StopSpec
from coordinator.pipeline.errors import BadRequest, UpstreamUnavailable
from coordinator.pipeline.sidecar import SidecarClient
from coordinator.pipeline.token_ids import check_rendered

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI and vLLM default for /v1/completions


class RenderStage:
    def __init__(self, sidecar: SidecarClient, catalog: ModelCatalog,
                 default_max_tokens: int | None = None) -> None:
        self._sidecar = sidecar
        self._catalog = catalog
        self._default_max_tokens = default_max_tokens

    async def __call__(self, ctx: RequestContext, entry: ModelEntry) -> None:
        path = "/v1/chat/completions/render" if ctx.kind == "chat" else "/v1/completions/render"
        out = await self._sidecar.post(path, ctx.body, request_id=ctx.request_id, stage="render")
        rendered = [out] if isinstance(out, dict) else out
        if not isinstance(rendered, list) or not rendered or not all(
                isinstance(g, dict) and isinstance(g.get("token_ids"), list) for g in rendered):
            raise UpstreamUnavailable("render sidecar returned an unexpected body (no token_ids)")
        max_len = await self._catalog.max_model_len(entry)
        vocab = await self._catalog.vocab_size(entry)
        prompt_field = "messages" if ctx.kind == "chat" else "prompt"
        for g in rendered:
            check_rendered(g, vocab, prompt_field=prompt_field)
        requested = ctx.body.get("max_completion_tokens") or ctx.body.get("max_tokens")
        ctx.prompts = [self._plan(i, g, ctx, requested, max_len) for i, g in enumerate(rendered)]

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
