"""One token budget across coordinator processes and replicas: what the others hold, and claims.

Each coordinator process counts what it admitted itself (``TokenLedger``). With several processes in
front of the same engines (replicas, workers), each would otherwise give an engine its whole budget:
N processes, N times the budget. A ``Fleet`` adds the others' share:

* ``LocalFleet``: no others to ask. Alone (the embedded default) it holds the whole budget; as one
  of N worker processes of a pod (``server.workers``) each worker takes ``scale = 1/N`` of every
  budget, so the pod together never exceeds it without any shared state.
* ``RedisFleet``: every process keeps, per engine and for the global budget, one field in a Redis
  hash: ``<version>:<tokens it holds>``. Admission first reserves locally (synchronously, so the
  scheduler's room checks stay cheap), then *claims* in Redis: one Lua script checks, atomically
  over all processes, that the engines and the global budget still have room with this request,
  and writes the process's new totals. A refused claim gives the local reservation back and the
  request waits, as for any full budget. Releases write the new totals without a check.

Why absolute totals with a version and not increments: a write carries what this process holds
*now*, so a lost, repeated or reordered write can only be replaced by a later one (the script keeps
the highest version), and after Redis returns from an outage the process publishes its totals once
and the fleet is whole again. Why a heartbeat lease and not per-request keys: a process that dies
stops renewing ``<ns>:procs``; once its lease is older than ``lease_ttl_s`` every script ignores (and
deletes) its fields, so a crashed worker's or replica's tokens come back on their own, however many
requests it held. Room checks between claims read the others' totals from a mirror refreshed every
``sync_interval_s``; the claim, not the mirror, is what guarantees the budget.

Degraded mode: when Redis does not answer, the process stops claiming and admits alone against
``budget / expected_replicas`` (``scale``), says so (``degraded``, ``/ready``, a gauge), keeps
trying, and publishes its totals when Redis answers again. No request fails because of Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

GLOBAL = ""  # the global budget's slot, beside the engines' urls


@dataclass(frozen=True)
class Slot:
    """One budget a claim touches: an engine's (``key`` = its url) or the global one (``GLOBAL``)."""

    key: str
    own: int            # what this process holds there after the claim
    delta: int          # what the claim adds (0 for a slot that only needs its total rewritten)
    limit: int | None   # the budget; None = unlimited


class Fleet(Protocol):
    """What admission needs from the other processes sharing the engines."""

    @property
    def shared(self) -> bool: ...

    @property
    def degraded(self) -> bool: ...

    @property
    def scale(self) -> float: ...

    def others(self, key: str) -> int: ...

    async def claim(self, slots: list[Slot]) -> bool: ...

    def publish(self, totals: Mapping[str, int]) -> None: ...

    async def start(self, totals: Callable[[], Mapping[str, int]], on_change: Callable[[], None]) -> None: ...

    async def aclose(self) -> None: ...


class LocalFleet:
    """Nobody else is asked: every claim is decided locally, against ``scale`` of each budget."""

    shared = False  # admission skips claims and publishing altogether
    degraded = False

    def __init__(self, scale: float = 1.0) -> None:
        if not 0.0 < scale <= 1.0:
            raise ValueError(f"scale must be in (0, 1], not {scale}")
        self.scale = scale

    def others(self, key: str) -> int:
        return 0

    async def claim(self, slots: list[Slot]) -> bool:
        return True

    def publish(self, totals: Mapping[str, int]) -> None:
        return None

    async def start(self, totals: Callable[[], Mapping[str, int]], on_change: Callable[[], None]) -> None:
        return None

    async def aclose(self) -> None:
        return None


# KEYS[1] = procs zset; KEYS[2..] = one hash per slot. ARGV: now_ms, proc, ttl_ms, version, then per
# slot (own, delta, limit or -1). Returns {1 or 0, others_1, others_2, ...}: whether the claim was
# taken (0: nothing written), and what the other live processes hold in each slot.
_CLAIM = """
local procs = KEYS[1]
local now, proc, ttl, ver = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('ZADD', procs, now + ttl, proc)
redis.call('ZREMRANGEBYSCORE', procs, '-inf', now - 3600000)
local others, mine = {}, {}
for i = 2, #KEYS do
  local fields = redis.call('HGETALL', KEYS[i])
  local sum, own_ver = 0, -1
  for j = 1, #fields, 2 do
    local p, v = fields[j], fields[j + 1]
    local sep = string.find(v, ':', 1, true)
    local pv, tokens = tonumber(string.sub(v, 1, sep - 1)), tonumber(string.sub(v, sep + 1))
    if p == proc then
      own_ver = pv
    else
      local exp = redis.call('ZSCORE', procs, p)
      if exp and tonumber(exp) > now then sum = sum + tokens else redis.call('HDEL', KEYS[i], p) end
    end
  end
  others[i - 1], mine[i - 1] = sum, own_ver
end
local ok = 1
for i = 2, #KEYS do
  local base = 4 + (i - 2) * 3
  local own, delta, limit = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  local total = others[i - 1] + own
  if delta > 0 and limit >= 0 and total - delta > 0 and total > limit then ok = 0 end
end
if ok == 1 then
  for i = 2, #KEYS do
    local own = tonumber(ARGV[4 + (i - 2) * 3 + 1])
    if mine[i - 1] < ver then
      if own > 0 then redis.call('HSET', KEYS[i], proc, ver .. ':' .. own)
      else redis.call('HDEL', KEYS[i], proc) end
    end
  end
end
local out = {ok}
for i = 1, #others do out[#out + 1] = others[i] end
return out
"""


class RedisFleet:
    """The fleet's budgets in Redis (``redis://``), shared by every process with the same namespace."""

    def __init__(self, url: str, *, namespace: str = "llmc", lease_ttl_s: float = 3.0,
                 sync_interval_s: float = 0.1, expected_replicas: int = 1, timeout_s: float = 0.5,
                 on_state: Callable[[bool], None] | None = None,
                 on_claim: Callable[[str], None] | None = None) -> None:
        import redis.asyncio as aioredis

        self._redis: Any = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                             retry_on_timeout=False)
        # Every call is bounded here too: redis-py's socket timeouts did not always end a call (seen
        # once in a while in the test suite: a claim waiting forever after the other process died),
        # and admission must never wait on Redis longer than its outage rule allows.
        self._call_timeout = 2 * timeout_s
        self._ns = namespace
        self._ttl_ms = int(lease_ttl_s * 1000)
        self._interval = sync_interval_s
        self._expected = max(1, expected_replicas)
        self.proc = f"{uuid.uuid4().hex[:12]}"
        self._version = 0
        self._others: dict[str, int] = {}
        self._degraded = False
        self.outages = 0  # times Redis became unreachable: each is a stretch of admitting alone
        self._script: Any = self._redis.register_script(_CLAIM)
        self._totals: Callable[[], Mapping[str, int]] = dict
        self._on_change: Callable[[], None] = lambda: None
        self._on_state = on_state
        self._on_claim = on_claim
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._pending: set[asyncio.Task[Any]] = set()

    # -- what admission reads ------------------------------------------------------------------------
    shared = True

    @property
    def degraded(self) -> bool:
        return self._degraded

    @property
    def scale(self) -> float:
        """The share of each budget this process may use alone: all of it while Redis answers (the
        claim keeps the fleet within it), ``1 / expected_replicas`` while it does not."""
        return 1.0 / self._expected if self._degraded else 1.0

    def others(self, key: str) -> int:
        """What the other live processes held in ``key`` at the last sync or claim (0 while degraded:
        the scaled budget stands in for them)."""
        return 0 if self._degraded else self._others.get(key, 0)

    # -- claims and totals ---------------------------------------------------------------------------
    def _keys(self, slots: Iterable[str]) -> list[str]:
        return [f"{self._ns}:procs", *(f"{self._ns}:b:{s}" for s in slots)]

    async def _run(self, slots: list[Slot]) -> bool:
        self._version += 1
        args: list[Any] = [int(time.time() * 1000), self.proc, self._ttl_ms, self._version]
        for s in slots:
            args += [s.own, s.delta, -1 if s.limit is None else s.limit]
        try:
            async with asyncio.timeout(self._call_timeout):
                result = await self._script(keys=self._keys(s.key for s in slots), args=args)
        except Exception:
            # A call cut short may leave its connection mid-reply: start over with fresh connections,
            # so no later call reads an answer that was not its own.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._call_timeout):
                    await self._redis.connection_pool.disconnect()
            raise
        for s, other in zip(slots, result[1:], strict=True):
            self._others[s.key] = int(other)
        return bool(result[0])

    async def claim(self, slots: list[Slot]) -> bool:
        """Take ``slots`` atomically over the fleet; False: another process took the room first.
        While degraded (or when Redis fails now) the local decision stands: True."""
        if self._degraded:
            return True
        try:
            ok = await self._run(slots)
        except Exception as exc:  # connection refused, timeout, a restarted server without the script
            self._set_degraded(True, exc)
            return True
        if self._on_claim is not None:
            self._on_claim("taken" if ok else "refused")
        return ok

    def publish(self, totals: Mapping[str, int]) -> None:
        """Write this process's totals (after a release) without a check; failures only degrade."""
        if self._degraded:
            return
        slots = [Slot(key, own, 0, None) for key, own in totals.items()]
        task = asyncio.get_running_loop().create_task(self._publish(slots))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _publish(self, slots: list[Slot]) -> None:
        try:
            await self._run(slots)
        except Exception as exc:
            self._set_degraded(True, exc)

    # -- the lease and the mirror -------------------------------------------------------------------
    async def start(self, totals: Callable[[], Mapping[str, int]], on_change: Callable[[], None]) -> None:
        """``totals``: this process's holdings now (slot → tokens, every known slot, zeros included);
        ``on_change``: called when the others' holdings dropped (waiters may fit now)."""
        self._totals, self._on_change = totals, on_change
        await self._sync()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="fleet-sync")

    async def _loop(self) -> None:
        # ``_closing`` as well as cancel(): a cancellation that lands inside redis-py's own read
        # timeout can come out as its TimeoutError, which ``_sync`` takes for an outage and goes on
        # (seen in the suite: ``aclose`` then waited on this loop forever).
        while not self._closing:
            await asyncio.sleep(self._interval)
            if not self._closing:
                await self._sync()

    async def _sync(self) -> None:
        """Renew the lease and refresh the mirror by rewriting this process's totals (a write carries
        the newest totals, so this also repairs anything a failed write left behind)."""
        slots = [Slot(key, own, 0, None) for key, own in self._totals().items()]
        before = dict(self._others)
        try:
            await self._run(slots or [Slot(GLOBAL, 0, 0, None)])
        except Exception as exc:
            self._set_degraded(True, exc)
            return
        if self._degraded:
            self._set_degraded(False, None)
        if any(self._others.get(k, 0) < v for k, v in before.items()) or self._degraded:
            self._on_change()

    def _set_degraded(self, degraded: bool, exc: BaseException | None) -> None:
        if degraded == self._degraded:
            return
        self._degraded = degraded
        if degraded:
            self.outages += 1
            log.warning("fleet ledger: Redis unavailable (%s); admitting alone with 1/%d of each budget",
                        exc, self._expected)
        else:
            log.warning("fleet ledger: Redis is back; budgets are shared again")
        if self._on_state is not None:
            self._on_state(degraded)
        self._on_change()

    async def aclose(self) -> None:
        """Stop renewing, take this process's holdings out of the fleet, close the connection."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            done, _ = await asyncio.wait({self._task}, timeout=self._call_timeout + self._interval)
            if not done:
                log.warning("fleet ledger: the sync loop did not stop when cancelled; leaving it")
        for task in list(self._pending):
            with contextlib.suppress(Exception):
                await task
        if not self._degraded:
            with contextlib.suppress(Exception):
                await self._run([Slot(key, 0, 0, None) for key in self._totals()]
                                or [Slot(GLOBAL, 0, 0, None)])
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._call_timeout):
                await self._redis.aclose()
