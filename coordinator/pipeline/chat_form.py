"""Another API's request → the OpenAI chat request the pipeline serves, converted by the sidecar.

``/v1/messages`` and ``/v1/responses`` are served on the chat path: the render sidecar, which runs
vLLM and has the chat template loaded, converts their requests with vLLM's own code
(``render_sidecar/messages.py``, ``render_sidecar/responses.py``), and from there a request is a
chat request (render, admission, KV-affinity scheduling, the topology, token-only engines,
derender with its tools and parsers, relay). Only the output is turned back, by each API's
``convert.py``. This module is what both translators share: the sidecar call with its errors in the
client's terms, and chat-path refusals renamed to the field the client wrote.

When the sidecar cannot convert (render off, down, or vLLM's own render server, which has no
conversion routes) the translators raise ``ConversionUnavailable``: the door then sends the request
down the native chain (``native_api.py``), or answers its 502/504 when no engine serves the API.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coordinator.pipeline.context import NativeApi, NativeCall
from coordinator.pipeline.errors import BadRequest, PipelineError, UpstreamTimeout, UpstreamUnavailable
from coordinator.pipeline.sidecar import SidecarClient


class ConversionUnavailable(PipelineError):
    """The sidecar could not convert the request; ``call`` is what the native chain needs. Unhandled,
    it is the sidecar's error (502, or 504 after a timeout) saying the API needs our sidecar."""

    def __init__(self, call: NativeCall) -> None:
        super().__init__(call.reason.message, status=call.reason.status, type=call.reason.type)
        self.call = call


async def convert_on_sidecar(sidecar: SidecarClient, path: str, body: Any, request_id: str, *,
                             api: NativeApi) -> Any:
    """The sidecar's answer to ``path`` for ``body``; render off, a sidecar without the route (vLLM's
    own render server answers a bare 404) or none at all is ``ConversionUnavailable``."""
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object")
    needs = (f"/v1/{api} needs the coordinator's render sidecar (render_sidecar), which converts these "
             "requests with vLLM's own code")
    if not sidecar.settings.enable:
        raise ConversionUnavailable(NativeCall(api, UpstreamUnavailable(
            f"{needs}, and render is off (render.enable: false)")))
    try:
        return await sidecar.post(path, body, request_id=request_id, stage="render")
    except (UpstreamUnavailable, UpstreamTimeout) as exc:
        raise ConversionUnavailable(NativeCall(api, type(exc)(f"{needs}: {exc.message}"))) from exc


def in_client_terms(exc: PipelineError, params: Mapping[str, str]) -> PipelineError:
    """A chat-path refusal of a converted request, naming the field the client wrote."""
    if exc.param is None:
        return exc
    root = exc.param.split(".", 1)[0].split("[", 1)[0]
    mapped = params.get(root)
    if mapped is None or mapped == root:
        return exc
    exc.message = exc.message.replace(f"'{root}'", f"'{mapped}'")
    exc.param = mapped + exc.param[len(root):]
    return exc
