"""A fault-injecting HTTP/1.1 reverse proxy, run in a background thread, for the render sidecar.

The render sidecar is a real vLLM process shared by the whole test session, so its failures cannot be
produced by breaking it. The proxy sits between a coordinator and the sidecar and, per request path,
passes the call through or fails it the way a sidecar fails in production:

* ``Status(code, body)``: answer a status (a bare 404 as FastAPI sends it, a vLLM 422, a 500, ...);
* ``Delay(seconds)``: answer late (past ``render.timeout_s``: the coordinator times out);
* ``Malformed()``: a 200 whose body is not JSON;
* ``Cut()``: close the connection after reading the request, without a response;
* ``Rewrite(change)``: forward the JSON body as ``change`` edits it (what a corrupted call does);
* ``stop()``/``start()``: stop listening altogether (connection refused), and listen again on the
  same port.

It speaks HTTP/1.1 with keep-alive through h11 (the sidecar client keeps connections open), forwards
whole bodies (render and derender are JSON calls, not streams) and counts the calls it saw per path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import h11
import httpx

from perf._procs import reserved_port


@dataclass(frozen=True)
class Pass:
    """Forward to the upstream (the default)."""


@dataclass(frozen=True)
class Status:
    """Answer ``code`` with ``body`` (a dict is sent as JSON)."""

    code: int
    body: dict[str, Any] | str = field(default_factory=lambda: {"detail": "Not Found"})


@dataclass(frozen=True)
class Delay:
    """Forward, but only after ``seconds`` (a client with a shorter timeout gives up first)."""

    seconds: float


@dataclass(frozen=True)
class Rewrite:
    """Forward a JSON body after ``change`` edited it (e.g. a corrupted ``stream_state``)."""

    change: Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Malformed:
    """A 200 with a body that is not JSON."""


@dataclass(frozen=True)
class Cut:
    """Read the request, then close the connection without answering."""


Rule = Pass | Status | Delay | Malformed | Cut | Rewrite
RENDER_PATHS = ("/v1/chat/completions/render", "/v1/completions/render")
DERENDER_PATHS = ("/v1/chat/completions/derender", "/v1/completions/derender")


class FaultProxy:
    """``with FaultProxy(upstream_url) as proxy: proxy.set(DERENDER_PATHS, Status(404))``."""

    def __init__(self, upstream: str, port: int | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = port or reserved_port()
        self.calls: Counter[str] = Counter()
        self._rules: dict[str, Rule] = {}
        self._rules_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="fault-proxy")
        self._server: asyncio.Server | None = None
        self._client: httpx.AsyncClient | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- rules ----------------------------------------------------------------------------------
    def set(self, paths: str | tuple[str, ...], rule: Rule) -> None:
        """Apply ``rule`` to every request whose path is one of ``paths`` (exact match)."""
        with self._rules_lock:
            for path in (paths,) if isinstance(paths, str) else paths:
                self._rules[path] = rule

    def clear(self) -> None:
        with self._rules_lock:
            self._rules.clear()

    def rule(self, path: str) -> Rule:
        with self._rules_lock:
            return self._rules.get(path, Pass())

    def count(self, paths: tuple[str, ...]) -> int:
        return sum(self.calls[p] for p in paths)

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> FaultProxy:
        self._thread.start()
        self._call(self._init_client())
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def start(self) -> None:
        """Listen (again) on the same port."""
        if self._server is None:
            self._server = self._call(asyncio.start_server(self._serve, "127.0.0.1", self.port))

    def stop(self) -> None:
        """Stop listening (new connections are refused) and drop every open connection."""
        server, self._server = self._server, None
        if server is not None:
            self._call(self._close(server))

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _init_client(self) -> None:
        self._client = httpx.AsyncClient(base_url=self.upstream, timeout=httpx.Timeout(120.0))

    async def _close(self, server: asyncio.Server) -> None:
        server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await server.wait_closed()

    async def _shutdown(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    # -- one connection -------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request, body = await _read_request(conn, reader)
                if request is None:
                    return
                path = request.target.decode().split("?", 1)[0]
                self.calls[path] += 1
                rule = self.rule(path)
                if isinstance(rule, Cut):
                    writer.transport.abort()
                    return
                if isinstance(rule, Delay):
                    await asyncio.sleep(rule.seconds)
                status, headers, content = await self._answer(rule, request, body)
                writer.write(conn.send(h11.Response(status_code=status, headers=[
                    *headers, ("content-length", str(len(content)))])))
                writer.write(conn.send(h11.Data(data=content)))
                writer.write(conn.send(h11.EndOfMessage()))
                await writer.drain()
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (ConnectionError, h11.RemoteProtocolError, asyncio.IncompleteReadError):
            return
        except asyncio.CancelledError:
            return  # stop(): asyncio's stream callback would log a cancelled handler as an error
        finally:
            self._handlers.discard(task)
            with contextlib.suppress(Exception):
                writer.close()

    async def _answer(self, rule: Rule, request: h11.Request, body: bytes
                      ) -> tuple[int, list[tuple[str, str]], bytes]:
        if isinstance(rule, Status):
            text = rule.body if isinstance(rule.body, str) else json.dumps(rule.body)
            ctype = "text/plain" if isinstance(rule.body, str) else "application/json"
            return rule.code, [("content-type", ctype)], text.encode()
        if isinstance(rule, Malformed):
            return 200, [("content-type", "application/json")], b'{"chunk": {"choices": [truncat'
        assert self._client is not None
        if isinstance(rule, Rewrite):
            body = json.dumps(rule.change(json.loads(body))).encode()
        keep = {"content-type", "x-request-id"}
        headers = {k.decode(): v.decode() for k, v in request.headers if k.decode().lower() in keep}
        resp = await self._client.request(request.method.decode(), request.target.decode(),
                                          headers=headers, content=body)
        ctype = resp.headers.get("content-type", "application/json")
        return resp.status_code, [("content-type", ctype)], resp.content


async def _read_request(conn: h11.Connection, reader: asyncio.StreamReader
                        ) -> tuple[h11.Request | None, bytes]:
    """The next request and its whole body; (None, b"") when the client closed the connection."""
    request: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(65536))  # b"" = the client closed its side
            continue
        if isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return request, bytes(body)
        elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
            return None, b""

