"""What every request meets before its engine work is queued, in the order that costs least.

Before render: the tenant's requests per minute and admission's early "queue full" refusal (a
refused request costs the render sidecar nothing). After render, once the prompt is known: the
tenant's tokens per minute, counted as OpenAI counts them. Admission proper (the token budget and
the queue) comes later, when the topology asks for an engine.
"""

from __future__ import annotations

from collections.abc import Callable

from coordinator.pipeline.admission.rate_limits import TenantLimiter
from coordinator.pipeline.admission.tenants import Tenant
from coordinator.pipeline.context import RequestContext
from coordinator.pipeline.errors import PipelineError

EarlyRefusal = Callable[[int, str], None]  # (priority, tenant) → raises when the queue is full


class FrontGate:
    def __init__(self, limiter: TenantLimiter | None = None,
                 early_refusal: EarlyRefusal | None = None) -> None:
        self._limiter = limiter
        self._early_refusal = early_refusal

    async def before_render(self, ctx: RequestContext, tenant: Tenant) -> None:
        if not tenant.may_use(ctx.adapter):
            raise PipelineError(f"The LoRA adapter `{ctx.adapter}` is not available to this API key",
                                status=403, type="PermissionDeniedError", param="model")
        if self._limiter is not None:
            ctx.rate_headers = await self._limiter.requests(tenant)
        if self._early_refusal is not None:
            self._early_refusal(ctx.priority, tenant.name)

    async def after_render(self, ctx: RequestContext, tenant: Tenant) -> None:
        """What OpenAI counts against tokens per minute: the prompt plus every token it may write."""
        if self._limiter is not None:
            cost = sum(p.prompt_tokens + p.max_tokens * p.n for p in ctx.prompts)
            ctx.rate_headers.update(await self._limiter.tokens(tenant, cost))
