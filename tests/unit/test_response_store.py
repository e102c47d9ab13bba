"""The response store's two backends (a SQLite file, a real Redis server) behave alike: an entry comes
back whole to its tenant only, a delete removes it, entries expire, and a tenant over its byte cap
loses its oldest entries first, never the one just written."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.pipeline.responses.store import (
    RedisStore,
    ResponseStore,
    SqliteStore,
    StoredResponse,
    StoreUnavailable,
)
from perf._procs import RedisServer


def entry(rid: str, text: str = "hello", created: float | None = None) -> StoredResponse:
    return StoredResponse(rid, {"id": rid, "object": "response", "output": [{"type": "message", "text": text}]},
                          [{"type": "message", "role": "user", "content": "hi", "id": f"msg_{rid}_0"}],
                          [{"type": "message", "role": "user", "content": "hi"}],
                          time.time() if created is None else created)


@pytest.fixture(params=["sqlite", "redis"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """``make(ttl_s, cap_bytes)`` → a fresh store of the parameter's backend."""
    redis: RedisServer | None = RedisServer().start() if request.param == "redis" else None

    def make(ttl_s: float = 3600.0, cap: int = 1 << 20) -> ResponseStore:
        store: ResponseStore
        if redis is not None:
            store = RedisStore(redis.url, uuid.uuid4().hex, ttl_s, cap, timeout_s=2.0)
        else:
            store = SqliteStore(str(tmp_path / f"{uuid.uuid4().hex}.sqlite3"), ttl_s, cap)
        return store  # each test closes its own, on its own event loop

    try:
        yield make
    finally:
        if redis is not None:
            redis.stop()


def test_an_entry_comes_back_whole_to_its_tenant_only(make_store: Any) -> None:
    async def run() -> None:
        store = make_store()
        await store.put("acme", entry("resp_1", "Paris 🎉 日本"))
        got = await store.get("acme", "resp_1")
        assert got == entry("resp_1", "Paris 🎉 日本", created=got.created_at)
        assert await store.get("globex", "resp_1") is None
        assert await store.delete("globex", "resp_1") is False
        assert await store.get("acme", "resp_1") is not None
        assert await store.delete("acme", "resp_1") is True
        assert await store.get("acme", "resp_1") is None
        assert await store.delete("acme", "resp_1") is False
        await store.aclose()
    asyncio.run(run())


def test_a_rewrite_replaces_the_entry(make_store: Any) -> None:
    async def run() -> None:
        store = make_store()
        await store.put("acme", entry("resp_1", "first"))
        await store.put("acme", entry("resp_1", "second"))
        got = await store.get("acme", "resp_1")
        assert got is not None and got.response["output"][0]["text"] == "second"
        await store.aclose()
    asyncio.run(run())


def test_entries_expire(make_store: Any) -> None:
    async def run() -> None:
        store = make_store(ttl_s=0.3)
        await store.put("acme", entry("resp_1"))
        assert await store.get("acme", "resp_1") is not None
        await asyncio.sleep(0.6)
        assert await store.get("acme", "resp_1") is None
        await store.aclose()
    asyncio.run(run())


def test_a_tenant_over_its_cap_loses_its_oldest_first(make_store: Any) -> None:
    size = len(entry("resp_0000").encode())
    async def run() -> None:
        store = make_store(cap=size * 3 + size // 2)  # room for three
        for i in range(5):
            await store.put("acme", entry(f"resp_{i:04d}", created=1000.0 + i))
        await store.put("globex", entry("resp_0000", created=1.0))  # another tenant's own budget
        kept = [i for i in range(5) if await store.get("acme", f"resp_{i:04d}") is not None]
        assert kept == [2, 3, 4]
        assert await store.get("globex", "resp_0000") is not None
        await store.aclose()
    asyncio.run(run())


def test_a_store_that_is_not_there_is_a_503_the_client_may_retry(tmp_path: Path) -> None:
    async def run() -> None:
        dead = RedisStore("redis://127.0.0.1:1/0", "x", 60.0, 1 << 20, timeout_s=0.5)
        with pytest.raises(StoreUnavailable) as info:
            await dead.get("acme", "resp_1")
        assert info.value.status == 503 and info.value.retry_after == 1
        await dead.aclose()
        blocked = tmp_path / "file"
        blocked.write_text("")
        unusable = SqliteStore(str(blocked / "responses.sqlite3"), 60.0, 1 << 20)  # a file where a folder must be
        with pytest.raises(StoreUnavailable):
            await unusable.put("acme", entry("resp_1"))
    asyncio.run(run())
