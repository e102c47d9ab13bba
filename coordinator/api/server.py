"""The HTTP listener's pieces: the one protection uvicorn lacks, a deadline for request headers, and a
quiet server for second listeners (the runtime's ``runtime/server.py`` puts them together).

uvicorn times out idle keep-alive connections, but not a client that opens a connection and sends
nothing, or trickles its headers a byte at a time (slowloris): each byte cancels the keep-alive
timer, and no other timer exists. Enough of those exhaust file descriptors for every other client.
The protocol below arms a timer when a request's first bytes (or a new connection) arrive and
cancels it once the headers are complete; if it fires, the client gets ``408`` and the connection
is closed. Bodies have their own deadline in ``api/body.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Generator
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from coordinator.pipeline.errors import RequestTimeout

_BODY = json.dumps(RequestTimeout("Request headers were not received in time").body(),
                   separators=(",", ":")).encode()
# Written straight to the transport: no request exists yet for the application to answer.
_REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(_BODY), _BODY))


def header_timeout_protocol(timeout_s: float, base: type[asyncio.Protocol] = AutoHTTPProtocol
                            ) -> type[asyncio.Protocol]:
    """``base`` (uvicorn's httptools or h11 protocol) with a header deadline of ``timeout_s``."""

    class HeaderDeadlineProtocol(base):  # type: ignore[valid-type,misc]
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            idle = self.cycle is None or self.cycle.response_complete
            if idle:
                self._arm()  # the first bytes of a new request start its header clock
            before = self.cycle
            super().data_received(data)
            if (self.cycle is not None and self.cycle is not before) or self._upgraded():
                self._disarm()  # headers complete: the request is the application's now

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _upgraded(self) -> bool:
            """The connection became a WebSocket (uvicorn handed the transport to another protocol):
            no HTTP request will follow on it, and a late 408 would corrupt the WebSocket stream."""
            return bool(self.transport is not None and self.transport.get_protocol() is not self)

        def _expired(self) -> None:
            self._header_timer = None
            if (self.transport.is_closing() or self._upgraded()
                    or not (self.cycle is None or self.cycle.response_complete)):
                return
            self.transport.write(_REQUEST_TIMEOUT)
            self.transport.close()

    return HeaderDeadlineProtocol


class QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers, for a second listener on a coordinator's loop (the
    metaserver, a worker's private socket): the coordinator's own server owns SIGTERM (the drain)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield
