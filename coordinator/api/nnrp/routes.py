"""Thin NNRP routes: the WebSocket at ``/nnrp/v1`` runs a ``Session``; ``GET /nnrp/v1/capabilities``.

The manifest is derived from the running configuration: tool-call deltas are declared only when the
render sidecars run parsers (as learned from them, docs/parsers.md), since without one the engine's
output is never split into calls; ``models.list`` and ``responses.create`` only when the router was
given the model list and the Responses conversion to run them with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import APIRouter, Request, Response, WebSocket
from fastapi.responses import JSONResponse
from starlette.websockets import WebSocketState

from coordinator.api.auth import ApiKeyCheck
from coordinator.api.door import peer
from coordinator.api.openai.errors import error_response
from coordinator.api.shutdown import Drain
from coordinator.config import Settings
from coordinator.nnrp.profile import Manifest, ServingCapabilities, build_manifest
from coordinator.nnrp.session import ResponsesForms, Runner, Session
from coordinator.observability.record import Observer
from coordinator.pipeline.errors import PipelineError

PATH = "/nnrp/v1"


def serving_manifest(parsers: bool, *, responses: bool = False, models_list: bool = False) -> Manifest:
    return build_manifest(ServingCapabilities(tool_calls=parsers, responses=responses,
                                              models_list=models_list))


class WebSocketTransport:
    """Starlette's WebSocket as the session's message transport."""

    def __init__(self, ws: WebSocket) -> None:
        self._ws = ws

    async def receive(self) -> str | bytes | None:
        if self._ws.client_state == WebSocketState.DISCONNECTED:
            return None
        message = await self._ws.receive()
        if message["type"] == "websocket.disconnect":
            return None
        text = message.get("text")
        if text is not None:
            return str(text)
        data = message.get("bytes")
        return bytes(data) if data is not None else b""

    async def send(self, data: str | bytes) -> None:
        if isinstance(data, str):
            await self._ws.send_text(data)
        else:
            await self._ws.send_bytes(data)

    async def close(self, code: int, reason: str = "") -> None:
        if self._ws.client_state != WebSocketState.DISCONNECTED \
                and self._ws.application_state != WebSocketState.DISCONNECTED:
            await self._ws.close(code, reason)


def build_nnrp_router(runner: Runner, auth: ApiKeyCheck, settings: Settings,
                      observer: Observer | None = None, drain: Drain | None = None,
                      parsers: Callable[[], bool] | None = None,
                      models: Callable[[Callable[[str], bool]], Mapping[str, Any]] | None = None,
                      responses: ResponsesForms | None = None) -> APIRouter:
    """``observer``: where each operation's observation record goes (the pipeline's); ``drain``: the
    server's shutdown state, which ends sessions with 1001 once their operations are done;
    ``parsers``: whether the sidecars run parsers now (default: ``render.parsers``); ``models``: the
    model list ``models.list`` answers (the catalog's, as ``GET /v1/models``); ``responses``: the
    Responses conversion ``responses.create`` runs (the HTTP door's ``ResponsesTranslator``)."""
    router = APIRouter()
    manifests = {flag: serving_manifest(flag, responses=responses is not None, models_list=models is not None)
                 for flag in (False, True)}
    def current() -> Manifest:
        return manifests[parsers() if parsers is not None else bool(settings.render.parsers)]

    @router.websocket(PATH)
    async def session(ws: WebSocket) -> None:
        await ws.accept()
        s = Session(WebSocketTransport(ws), runner, settings.nnrp, current(), auth,
                    authorization=ws.headers.get("authorization"), observer=observer,
                    connection_id=peer(ws.client), models=models, responses=responses)
        with drain.hold(s) if drain is not None else contextlib.nullcontext():
            await s.run()

    @router.get(f"{PATH}/capabilities")
    async def capabilities(request: Request) -> Response:
        try:
            auth(request.headers.get("authorization"))
        except PipelineError as exc:
            return error_response(exc)
        return JSONResponse(current().to_dict())

    return router
