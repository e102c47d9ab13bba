"""Async NNRP v1 client over the ``websockets`` package (tests, conformance, benchmarks, users).

``async with await NnrpClient.connect(url, api_key=...) as c: op = await c.submit(envelope)`` then
``async for event in op`` yields the operation's profile events in ``seq`` order, ending with its
terminal event. Credits are granted back as events are consumed (a window of ``credits``), so a
consumer that stops reading stops the server's stream too; pass ``auto_credit=False`` to grant by
hand with ``op.grant(n)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from coordinator.nnrp import frames as F
from coordinator.nnrp.profile import (
    CHAT_COMPLETIONS_CREATE,
    MODELS_LIST,
    RESPONSES_CREATE,
    SCHEMA_VERSION,
    TERMINAL_EVENT_TYPES,
)

_END = object()


class NnrpError(Exception):
    """An error frame the server sent for this client's frame or operation."""

    def __init__(self, frame: dict[str, Any]) -> None:
        super().__init__(f"{frame.get('code')}: {frame.get('message')}")
        self.frame = frame
        self.code = frame.get("code")


class Operation:
    """One submitted operation: iterate it for its events; ``results`` keeps every frame received."""

    def __init__(self, client: NnrpClient, op_id: str, credits: int, auto_credit: bool) -> None:
        self.id = op_id
        self._client = client
        self._queue: asyncio.Queue[dict[str, Any] | NnrpError | object] = asyncio.Queue()
        self._window = credits
        self._auto = auto_credit
        self._consumed = 0
        self.results: list[dict[str, Any]] = []  # result frames, in arrival order
        self.diagnostics: list[dict[str, Any]] = []  # diagnostics frames for this operation
        self.done = False

    def _deliver(self, item: dict[str, Any] | NnrpError | object) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        while not self.done:
            item = await self._queue.get()
            if item is _END:
                raise ConnectionError("the session ended before the operation did")
            if isinstance(item, NnrpError):
                self.done = True
                raise item
            assert isinstance(item, dict)
            event: dict[str, Any] = item["event"]
            if event.get("type") in TERMINAL_EVENT_TYPES:
                self.done = True
            elif self._auto:
                self._consumed += 1
                if self._consumed * 2 >= self._window:  # give back half a window at a time
                    grant, self._consumed = self._consumed, 0
                    with contextlib.suppress(Exception):
                        await self.grant(grant)
            yield event

    async def collect(self) -> list[dict[str, Any]]:
        return [event async for event in self]

    async def cancel(self, reason: str = "cancelled by client") -> None:
        await self._client.send({"type": "cancel", "op": self.id, "reason": reason})

    async def grant(self, credits: int) -> None:
        if credits > 0 and not self.done:
            await self._client.send({"type": "credit", "op": self.id, "credits": credits})


class NnrpClient:
    def __init__(self, ws: ClientConnection, encoding: str, credits: int, auto_credit: bool) -> None:
        self.ws = ws
        self.encoding = encoding
        self.credits = credits
        self.auto_credit = auto_credit
        self.welcome: dict[str, Any] = {}
        self.manifest: dict[str, Any] = {}
        self.session_id: str | None = None
        self.errors: list[dict[str, Any]] = []  # error frames not tied to an operation
        self.close_code: int | None = None
        self._ops: dict[str, Operation] = {}
        self._recent: dict[str, Operation] = {}
        self._waiters: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._reader: asyncio.Task[None] | None = None

    @classmethod
    async def connect(cls, url: str, *, api_key: str | None = None, encodings: tuple[str, ...] = ("json",),
                      credits: int = 64, auto_credit: bool = True, open_session: bool = True,
                      max_size: int | None = 2**24) -> NnrpClient:
        """Connect, say hello (the server picks among ``encodings``) and open the session."""
        ws = await connect(url, max_size=max_size, ping_interval=None)
        client = cls(ws, "json", credits, auto_credit)
        await ws.send(F.encode_client({"type": "hello", "versions": [F.VERSION], "encodings": list(encodings),
                                       "client": "coordinator.nnrp.client"}, "json"))
        client.welcome = F.decode_server(await ws.recv())
        if client.welcome.get("type") != "welcome":
            await ws.close()
            raise NnrpError(client.welcome)
        client.encoding = client.welcome["encoding"]
        client.session_id = client.welcome.get("session_id")
        client._reader = asyncio.create_task(client._read())
        if open_session:
            await client.open(api_key)
        return client

    async def open(self, api_key: str | None = None) -> dict[str, Any]:
        frame: dict[str, Any] = {"type": "open", "schema_version": SCHEMA_VERSION}
        if api_key is not None:
            frame["authorization"] = f"Bearer {api_key}"
        opened = await self._request(frame, "opened")
        self.manifest = opened["manifest"]
        return opened

    async def submit(self, envelope: dict[str, Any], *, op_id: str | None = None,
                     credits: int | None = None) -> Operation:
        """Submit an envelope; the handle's events are those the server pushes for it."""
        op_id = op_id or f"op-{next(self._ids)}"
        window = self.credits if credits is None else credits
        op = Operation(self, op_id, window, self.auto_credit)
        self._ops[op_id] = op
        await self.send({"type": "submit", "op": op_id, "envelope": envelope, "credits": window})
        return op

    async def chat(self, body: dict[str, Any], *, op_id: str | None = None, credits: int | None = None,
                   **envelope: Any) -> Operation:
        """``chat.completions.create`` with ``body``; other envelope members (policy, …) as keywords."""
        return await self.submit({"schema_version": SCHEMA_VERSION, "operation": CHAT_COMPLETIONS_CREATE,
                                  "body": body, **envelope}, op_id=op_id, credits=credits)

    async def responses(self, body: dict[str, Any], *, op_id: str | None = None, credits: int | None = None,
                        **envelope: Any) -> Operation:
        """``responses.create`` with ``body`` (a ``/v1/responses`` request); envelope members as keywords."""
        return await self.submit({"schema_version": SCHEMA_VERSION, "operation": RESPONSES_CREATE,
                                  "body": body, **envelope}, op_id=op_id, credits=credits)

    async def models(self) -> dict[str, Any]:
        """``models.list``: the model list (``GET /v1/models``' body); an error event raises ``NnrpError``."""
        events = await (await self.submit({"schema_version": SCHEMA_VERSION, "operation": MODELS_LIST,
                                           "body": {}})).collect()
        last = events[-1] if events else {}
        if last.get("type") != "response.completed":
            raise NnrpError({"code": (last.get("error") or {}).get("code"), "message": str(last)[:300]})
        return dict(last["response"])

    async def diagnostics(self, op_id: str | None = None) -> dict[str, Any]:
        frame = await self._request({"type": "diagnostics", "op": op_id}, "diagnostics")
        return frame

    async def ping(self, nonce: int = 0) -> dict[str, Any]:
        """Round trip: waits for the pong carrying ``nonce`` (others are answers to earlier pings)."""
        waiter = self._waiters.setdefault("pong", asyncio.Queue())
        await self.send({"type": "ping", "nonce": nonce})
        async with asyncio.timeout(30):
            while True:
                reply = await waiter.get()
                if reply.get("type") == "pong" and reply.get("nonce") == nonce:
                    return reply

    async def send(self, frame: dict[str, Any]) -> None:
        await self.ws.send(F.encode_client(frame, self.encoding))

    async def send_raw(self, data: str | bytes) -> None:
        """Any message, as is (protocol tests)."""
        await self.ws.send(data)

    async def close(self, reason: str = "") -> None:
        """Say close, wait for the server to end the session, and stop."""
        with contextlib.suppress(Exception):
            await self.send({"type": "close", "reason": reason})
            if self._reader is not None:
                await asyncio.wait_for(asyncio.shield(self._reader), 5)
        await self.ws.close()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)

    async def __aenter__(self) -> NnrpClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _request(self, frame: dict[str, Any], answer: str) -> dict[str, Any]:
        """Send a frame and wait for the next frame of type ``answer`` (or an error frame)."""
        waiter = self._waiters.setdefault(answer, asyncio.Queue())
        await self.send(frame)
        reply = await asyncio.wait_for(waiter.get(), 30)
        if reply.get("type") == "error":
            raise NnrpError(reply)
        return reply

    async def _read(self) -> None:
        try:
            async for data in self.ws:
                await self._dispatch(F.decode_server(data))
        finally:
            self.close_code = self.ws.close_code
            for op in self._ops.values():
                op._deliver(_END)

    async def _dispatch(self, frame: dict[str, Any]) -> None:
        kind = frame["type"]
        op_id = frame.get("op")
        op = self._ops.get(op_id) if isinstance(op_id, str) else None
        if kind == "result" and op is not None:
            op.results.append(frame)
            op._deliver(frame)
            if frame["event"].get("type") in TERMINAL_EVENT_TYPES:
                self._end_op(op)
        elif kind == "ping":
            with contextlib.suppress(Exception):
                await self.send({"type": "pong", "nonce": frame.get("nonce")})
        elif kind == "diagnostics" and frame.get("kind") == "summary":
            done = self._recent.get(op_id) if isinstance(op_id, str) else None
            if done is not None:
                done.diagnostics.append(frame)
        elif kind == "error" and op is not None and frame.get("frame_type") == "submit":
            self._end_op(op)
            op._deliver(NnrpError(frame))
        elif kind == "error":
            self.errors.append(frame)
            answer = _ANSWERS.get(frame.get("frame_type") or "")
            if answer in self._waiters:
                self._waiters[answer].put_nowait(frame)
        elif kind in self._waiters:
            self._waiters[kind].put_nowait(frame)

    def _end_op(self, op: Operation) -> None:
        self._ops.pop(op.id, None)
        self._recent[op.id] = op  # summary diagnostics arrive after the terminal event
        while len(self._recent) > 256:
            self._recent.pop(next(iter(self._recent)))


_ANSWERS = {"open": "opened", "diagnostics": "diagnostics", "ping": "pong"}
