"""Per-tenant requests and tokens per minute, answered as OpenAI does: 429, ``Retry-After`` and the
``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` headers on every answer.

Each limit is a token bucket that holds one minute's allowance and refills continuously (OpenAI's
limits behave so: a burst may spend the whole minute at once, then the allowance comes back at
``limit / 60`` per second). The requests bucket is charged before render (a refused request costs
the sidecar nothing); the tokens bucket after render, with what OpenAI counts: prompt tokens plus
``max_tokens`` times ``n``. Nothing is refunded when a request later fails or finishes early.

Buckets live in this process (``LocalBuckets``) or, with the Redis fleet backend, in Redis
(``RedisBuckets``: one Lua script, Redis's clock), so a tenant's limit holds over every coordinator
process. While Redis is unreachable each process counts alone against ``limit / expected_replicas``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from coordinator.pipeline.admission.tenants import Tenant
from coordinator.pipeline.errors import RateLimited

Kind = Literal["requests", "tokens"]


@dataclass(frozen=True)
class Quota:
    """A bucket after one take: what the headers say."""

    limit: int
    remaining: int
    reset_s: float      # until the bucket is full again
    retry_after_s: float = 0.0  # until the refused amount fits (refusals only)


class Buckets(Protocol):
    async def take(self, key: str, amount: int, per_minute: int) -> tuple[bool, Quota]:
        """Take ``amount`` from the bucket ``key`` (``per_minute`` full) if it holds that much."""
        ...

    async def aclose(self) -> None: ...


def _quota(level: float, amount: int, per_minute: int, ok: bool) -> Quota:
    rate = per_minute / 60.0
    retry = 0.0 if ok else max(0.0, (amount - level) / rate)
    return Quota(per_minute, max(0, int(level)), (per_minute - level) / rate, retry)


class LocalBuckets:
    """This process's buckets (the embedded default; and Redis's stand-in while it is down)."""

    def __init__(self, scale: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._scale = scale
        self._clock = clock
        self._levels: dict[str, tuple[float, float]] = {}  # key → (level, when)

    async def take(self, key: str, amount: int, per_minute: int) -> tuple[bool, Quota]:
        return self.take_now(key, amount, per_minute)

    async def aclose(self) -> None:
        return None

    def take_now(self, key: str, amount: int, per_minute: int) -> tuple[bool, Quota]:
        limit = max(1, int(per_minute * self._scale))
        now = self._clock()
        level, when = self._levels.get(key, (float(limit), now))
        level = min(float(limit), level + (now - when) * limit / 60.0)
        ok = level >= amount
        if ok:
            level -= amount
        self._levels[key] = (level, now)
        return ok, _quota(level, amount, limit, ok)


# KEYS[1]: the bucket (a hash: level, millisecond time). ARGV: amount, limit per minute.
# Returns {taken 1/0, level as a string} (a Lua number would be truncated to an integer).
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local amount, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local level = tonumber(redis.call('HGET', KEYS[1], 'l') or limit)
local since = tonumber(redis.call('HGET', KEYS[1], 't') or now)
level = math.min(limit, level + math.max(0, now - since) * limit / 60000.0)
local ok = 0
if level >= amount then level = level - amount ok = 1 end
redis.call('HSET', KEYS[1], 'l', tostring(level), 't', now)
redis.call('PEXPIRE', KEYS[1], 120000)
return {ok, tostring(level)}
"""


class RedisBuckets:
    """Buckets shared by every process on one Redis namespace; local ones while it does not answer."""

    def __init__(self, url: str, *, namespace: str, timeout_s: float, expected_replicas: int,
                 retry_s: float = 1.0) -> None:
        import redis.asyncio as aioredis

        self._redis: Any = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                             retry_on_timeout=False)
        self._script: Any = self._redis.register_script(_TAKE)
        self._ns = namespace
        self._fallback = LocalBuckets(1.0 / max(1, expected_replicas))
        self._retry_s = retry_s
        self._down_until = 0.0

    async def take(self, key: str, amount: int, per_minute: int) -> tuple[bool, Quota]:
        if time.monotonic() >= self._down_until:
            try:
                ok, level = await self._script(keys=[f"{self._ns}:rl:{key}"], args=[amount, per_minute])
            except Exception:  # down, timeout: count alone for a while, then try Redis again
                self._down_until = time.monotonic() + self._retry_s
            else:
                return bool(ok), _quota(float(level), amount, per_minute, bool(ok))
        return self._fallback.take_now(key, amount, per_minute)

    async def aclose(self) -> None:
        await self._redis.aclose()


def reset_text(seconds: float) -> str:
    """A duration as OpenAI writes ``x-ratelimit-reset-*``: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1.0:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60.0)
    text = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{text}s" if minutes else f"{text}s"


def headers(kind: Kind, quota: Quota) -> dict[str, str]:
    return {f"x-ratelimit-limit-{kind}": str(quota.limit),
            f"x-ratelimit-remaining-{kind}": str(quota.remaining),
            f"x-ratelimit-reset-{kind}": reset_text(quota.reset_s)}


class TenantLimiter:
    """The two per-minute limits of every tenant, over one set of buckets."""

    def __init__(self, buckets: Buckets, on_limited: Callable[[str, Kind], None] | None = None) -> None:
        self._buckets = buckets
        self._on_limited = on_limited

    async def requests(self, tenant: Tenant) -> dict[str, str]:
        """Charge one request; the headers to send, or ``RateLimited``."""
        return await self._take(tenant, "requests", 1, tenant.requests_per_minute)

    async def tokens(self, tenant: Tenant, tokens: int) -> dict[str, str]:
        """Charge ``tokens`` (prompt + max_tokens times n); the headers to send, or ``RateLimited``."""
        return await self._take(tenant, "tokens", tokens, tenant.tokens_per_minute)

    async def _take(self, tenant: Tenant, kind: Kind, amount: int, per_minute: int | None) -> dict[str, str]:
        if per_minute is None:
            return {}
        if amount > per_minute:
            self._limited(tenant, kind)
            raise RateLimited(f"Request too large for tenant {tenant.name!r}: it needs {amount} {kind}, the "
                              f"limit is {per_minute} {kind} per minute. Send less (fewer input tokens or "
                              f"a smaller max_tokens)", retry_after_s=None, headers={},
                              code="tokens" if kind == "tokens" else "requests")
        ok, quota = await self._buckets.take(f"{tenant.name}:{kind}", amount, per_minute)
        sent = headers(kind, quota)
        if not ok:
            self._limited(tenant, kind)
            raise RateLimited(f"Rate limit reached for tenant {tenant.name!r} on {kind} per minute: limit "
                              f"{quota.limit}, remaining {quota.remaining}, requested {amount}. Retry in "
                              f"{reset_text(quota.retry_after_s)}", retry_after_s=quota.retry_after_s,
                              headers=sent, code=kind)
        return sent

    async def aclose(self) -> None:
        await self._buckets.aclose()

    def _limited(self, tenant: Tenant, kind: Kind) -> None:
        if self._on_limited is not None:
            self._on_limited(tenant.name, kind)
