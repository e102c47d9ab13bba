"""Where stored Responses live: one small interface, two backends (embedded SQLite, Redis).

A stored response is what ``GET /v1/responses/{id}`` answers, what ``input_items`` lists, and what a
follow-up naming it in ``previous_response_id`` continues from (``history``). Every key is the
tenant's and the id together, so another tenant's id is simply not there (404, never its content).
Entries expire ``ttl_s`` after they are written, and a tenant past ``max_bytes_per_tenant`` loses its
oldest entries first. Writes replace a whole entry at once (one row, one key), so a reader sees the
old entry or the new one, never a mix.

SQLite is the default because it needs nothing running (a file, WAL mode, safe for
``server.workers`` processes on one volume); Redis is the fleet's store (the one admission's shared
budget already uses), so a follow-up may reach any replica. docs/responses-api.md says which to run.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from coordinator.config import ResponseStoreSettings
from coordinator.pipeline.errors import PipelineError


class StoreUnavailable(PipelineError):
    """The store did not answer: a request that needs it is a 503 the client may retry."""

    status = 503
    type = "ServiceUnavailableError"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.retry_after = 1


@dataclass(frozen=True)
class StoredResponse:
    """One stored response. ``input_items``: the request's own input as items (what ``input_items``
    lists); ``history``: the conversation a follow-up continues from, this turn's output included
    (built by ``chain.py``); ``lease_until``: while a background run is going (``background.py``)."""

    id: str
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]
    created_at: float
    lease_until: float | None = None   # a background run's runner renews this while it runs

    def encode(self) -> str:
        return json.dumps({"id": self.id, "response": self.response, "input_items": self.input_items,
                           "history": self.history, "created_at": self.created_at,
                           "lease_until": self.lease_until}, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def decode(cls, text: str | bytes) -> StoredResponse:
        data = json.loads(text)
        return cls(data["id"], data["response"], data["input_items"], data["history"], data["created_at"],
                   data.get("lease_until"))


class ResponseStore(Protocol):
    """What the Responses routes need of a store; every call may raise ``StoreUnavailable``."""

    async def put(self, tenant: str, entry: StoredResponse) -> None: ...

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None: ...

    async def delete(self, tenant: str, response_id: str) -> bool: ...

    async def aclose(self) -> None: ...


class SqliteStore:
    """One table in one file. sqlite3 calls block, so each runs on a worker thread; one connection per
    store, guarded by a lock (sqlite3 connections are not safe to use from two threads at once)."""

    def __init__(self, path: str, ttl_s: float, max_bytes_per_tenant: int) -> None:
        self._path = path
        self._ttl_s = ttl_s
        self._cap = max_bytes_per_tenant
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None:
            if self._path != ":memory:":
                Path(self._path).parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self._path, timeout=5.0, check_same_thread=False, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across a process crash
            conn.execute("CREATE TABLE IF NOT EXISTS responses (tenant TEXT NOT NULL, id TEXT NOT NULL, "
                         "created REAL NOT NULL, expires REAL NOT NULL, size INTEGER NOT NULL, "
                         "body TEXT NOT NULL, PRIMARY KEY (tenant, id))")
            conn.execute("CREATE INDEX IF NOT EXISTS responses_by_age ON responses (tenant, expires)")
            self._conn = conn
        return self._conn

    async def _run(self, work: Any, *args: Any) -> Any:
        def locked() -> Any:
            with self._lock:
                return work(self._connect(), *args)
        try:
            return await asyncio.to_thread(locked)
        except (sqlite3.Error, OSError) as exc:
            raise StoreUnavailable(f"the response store failed: {exc}") from exc

    def _put(self, conn: sqlite3.Connection, tenant: str, entry: StoredResponse) -> None:
        body = entry.encode()
        now = time.time()
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("DELETE FROM responses WHERE tenant = ? AND expires < ?", (tenant, now))
            conn.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                         (tenant, entry.id, entry.created_at, now + self._ttl_s, len(body), body))
            total = conn.execute("SELECT COALESCE(SUM(size), 0) FROM responses WHERE tenant = ?",
                                 (tenant,)).fetchone()[0]
            if total > self._cap:  # the oldest writes go first, the new entry never
                for rid, size in conn.execute("SELECT id, size FROM responses WHERE tenant = ? AND id != ? "
                                              "ORDER BY expires", (tenant, entry.id)).fetchall():
                    conn.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, rid))
                    total -= size
                    if total <= self._cap:
                        break
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    @staticmethod
    def _get(conn: sqlite3.Connection, tenant: str, response_id: str) -> str | None:
        row = conn.execute("SELECT body FROM responses WHERE tenant = ? AND id = ? AND expires >= ?",
                           (tenant, response_id, time.time())).fetchone()
        return None if row is None else str(row[0])

    @staticmethod
    def _delete(conn: sqlite3.Connection, tenant: str, response_id: str) -> bool:
        cur = conn.execute("DELETE FROM responses WHERE tenant = ? AND id = ? AND expires >= ?",
                           (tenant, response_id, time.time()))
        return cur.rowcount > 0

    async def put(self, tenant: str, entry: StoredResponse) -> None:
        await self._run(self._put, tenant, entry)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        body = await self._run(self._get, tenant, response_id)
        return None if body is None else StoredResponse.decode(body)

    async def delete(self, tenant: str, response_id: str) -> bool:
        return bool(await self._run(self._delete, tenant, response_id))

    async def aclose(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


# KEYS: entry key, the tenant's age index, the tenant's size hash, the tenant's total.
# ARGV: id, body, created, ttl ms, cap, key prefix of the tenant's entries, now (s).
# One script, so the entry, the index (by write time) and the tally change together; past the cap the
# oldest writes go first.
_PUT = """
local old = redis.call('HGET', KEYS[3], ARGV[1])
if old then redis.call('DECRBY', KEYS[4], old) end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[7], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], string.len(ARGV[2]))
local total = redis.call('INCRBY', KEYS[4], string.len(ARGV[2]))
local cutoff = tonumber(ARGV[7]) - tonumber(ARGV[4]) / 1000
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', cutoff)
for _, rid in ipairs(gone) do
  local size = redis.call('HGET', KEYS[3], rid)
  if size then total = redis.call('DECRBY', KEYS[4], size) end
  redis.call('HDEL', KEYS[3], rid); redis.call('ZREM', KEYS[2], rid); redis.call('DEL', ARGV[6] .. rid)
end
while total > tonumber(ARGV[5]) do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if (not oldest) or oldest == ARGV[1] then break end
  local size = redis.call('HGET', KEYS[3], oldest)
  if size then total = redis.call('DECRBY', KEYS[4], size) end
  redis.call('HDEL', KEYS[3], oldest); redis.call('ZREM', KEYS[2], oldest)
  redis.call('DEL', ARGV[6] .. oldest)
end
return total
"""
_DELETE = """
local size = redis.call('HGET', KEYS[3], ARGV[1])
if size then redis.call('DECRBY', KEYS[4], size) end
redis.call('HDEL', KEYS[3], ARGV[1]); redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('DEL', KEYS[1])
"""


class RedisStore:
    """Entries as plain keys with a TTL (Redis expires them), plus a per-tenant age index and size tally
    for the cap. Every replica with the same ``redis_url`` and ``namespace`` sees the same responses."""

    def __init__(self, url: str, namespace: str, ttl_s: float, max_bytes_per_tenant: int,
                 timeout_s: float) -> None:
        import redis.asyncio as aioredis

        self._redis = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._ns = namespace
        self._ttl_ms = int(ttl_s * 1000)
        self._cap = max_bytes_per_tenant
        self._put_script = self._redis.register_script(_PUT)
        self._delete_script = self._redis.register_script(_DELETE)

    def _keys(self, tenant: str, response_id: str) -> list[str]:
        base = f"{self._ns}:responses:{tenant}"
        return [f"{base}:entry:{response_id}", f"{base}:age", f"{base}:size", f"{base}:total"]

    async def _call(self, work: Any) -> Any:
        from redis.exceptions import RedisError

        try:
            return await work
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"the response store (Redis) failed: {exc}") from exc

    async def put(self, tenant: str, entry: StoredResponse) -> None:
        keys = self._keys(tenant, entry.id)
        prefix = keys[0][: -len(entry.id)]
        await self._call(self._put_script(keys=keys, args=[
            entry.id, entry.encode(), entry.created_at, self._ttl_ms, self._cap, prefix, time.time()]))

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        body = await self._call(self._redis.get(self._keys(tenant, response_id)[0]))
        return None if body is None else StoredResponse.decode(body)

    async def delete(self, tenant: str, response_id: str) -> bool:
        keys = self._keys(tenant, response_id)
        return bool(await self._call(self._delete_script(keys=keys, args=[response_id])))

    async def aclose(self) -> None:
        await self._redis.aclose()


Observe = Callable[[str, str, float], None]   # operation, result, seconds


class TimedStore:
    """A store whose every call is timed (``coordinator_response_store_seconds``): what storing costs a
    request, measured where it is paid."""

    def __init__(self, inner: ResponseStore, observe: Observe) -> None:
        self.inner = inner
        self._observe = observe

    async def _timed(self, op: str, work: Awaitable[Any]) -> Any:
        start = time.perf_counter()
        result = "ok"
        try:
            return await work
        except StoreUnavailable:
            result = "unavailable"
            raise
        finally:
            self._observe(op, result, time.perf_counter() - start)

    async def put(self, tenant: str, entry: StoredResponse) -> None:
        await self._timed("put", self.inner.put(tenant, entry))

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        found: StoredResponse | None = await self._timed("get", self.inner.get(tenant, response_id))
        return found

    async def delete(self, tenant: str, response_id: str) -> bool:
        return bool(await self._timed("delete", self.inner.delete(tenant, response_id)))

    async def aclose(self) -> None:
        await self.inner.aclose()


def open_store(settings: ResponseStoreSettings, observe: Observe | None = None) -> ResponseStore | None:
    """The configured store (opened on first use), or None when storing is off."""
    if settings.backend == "off":
        return None
    store: ResponseStore
    if settings.backend == "redis":
        store = RedisStore(settings.redis_url, settings.namespace, settings.ttl_s,
                           settings.max_bytes_per_tenant, settings.timeout_s)
    else:
        store = SqliteStore(settings.path, settings.ttl_s, settings.max_bytes_per_tenant)
    return store if observe is None else TimedStore(store, observe)
