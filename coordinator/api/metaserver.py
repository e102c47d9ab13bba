"""The metaserver door: where trigger-mode decode engines call back (``POST /v1/metaserver``).

Its own port, apart from the client API (as MindIE Motor's per-worker metaserver app): engines call
it from inside the cluster, with no API key, so it must not share a listener that clients reach
through a load balancer. What a callback may do is bounded by the unguessable per-attempt token in
its URL (``pipeline/topology/trigger.py``). Answers, as upstream's (docs/trigger-protocol.md, B14-B17):
the prefill engine's JSON once the prefill leg is done; ``{}`` for a repeat after that; 404 for an
unknown attempt, 409 for a stale one or one whose prefill is still running, 400 for a malformed call,
500 when the prefill leg failed. Error bodies are the OpenAI error shape the coordinator uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from coordinator.api.server import QuietServer
from coordinator.config import TriggerSettings
from coordinator.pipeline.topology.trigger import METASERVER_PATH, CallbackRefused, TriggerBoard

log = logging.getLogger(__name__)
_TYPES = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError", 500: "InternalServerError"}


def build_metaserver_app(board: TriggerBoard) -> Starlette:
    async def metaserver(request: Request) -> Response:
        raw = await request.body()
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            board.answered(400)
            return _error(CallbackRefused(400, "Invalid JSON format"))
        try:
            result = await board.callback(request.query_params.get("attempt"), body)
        except CallbackRefused as refused:
            return _error(refused)
        return JSONResponse(result)

    return Starlette(routes=[Route(METASERVER_PATH, metaserver, methods=["POST"])])


def _error(refused: CallbackRefused) -> JSONResponse:
    return JSONResponse({"error": {"message": refused.message, "type": _TYPES.get(refused.status, "Error"),
                                   "param": None, "code": refused.status}}, status_code=refused.status)


class Metaserver:
    """The metaserver's listener, run on the coordinator's event loop; tells ``board`` its URL."""

    def __init__(self, settings: TriggerSettings, board: TriggerBoard) -> None:
        self._settings = settings
        self._board = board
        self._server: QuietServer | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> None:
        s = self._settings
        family = socket.AF_INET6 if ":" in s.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((s.host, s.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(build_metaserver_app(self._board), lifespan="off", access_log=False,
                                log_level="warning")
        self._server = QuietServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="metaserver")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the metaserver stopped while starting")
            await asyncio.sleep(0.01)
        host = s.advertise_host or s.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        self._board.base_url = f"http://{host}:{self.port}{METASERVER_PATH}"
        log.info("trigger metaserver on %s:%d, engines call %s", s.host, self.port, self._board.base_url)

    async def stop(self) -> None:
        self._board.base_url = None
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._server = self._task = None
