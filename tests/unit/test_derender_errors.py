"""Derender failures are response-stage errors: typed by cause, never an engine's fault.

Inference already ran when derender fails, so none of them may match a rule that retries engine
work, relays a stream or feeds an engine breaker (all of those match ``Upstream*`` errors only).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from coordinator.config import RenderSettings
from coordinator.pipeline.context import PromptPlan, RequestContext, StopSpec
from coordinator.pipeline.derender.client import Derenderer
from coordinator.pipeline.errors import (
    DerenderRejected,
    DerenderTimeout,
    DerenderUnavailable,
    PipelineError,
    ResponseStageError,
    UpstreamClientError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from coordinator.pipeline.sidecar import SidecarClient

URLS = ["http://s0:8100", "http://s1:8101"]
DERENDER = "/v1/chat/completions/derender"


def pool(answer: httpx.Response | Exception, calls: list[str]) -> SidecarClient:
    async def handler(request: httpx.Request) -> httpx.Response:
        calls.append(str(request.url.port))
        if isinstance(answer, Exception):
            raise answer
        return answer

    return SidecarClient(RenderSettings(urls=URLS), transport=httpx.MockTransport(handler))


VLLM_400 = {"error": {"message": "Invalid stream_state: expected a dict", "type": "BadRequestError",
                      "param": "stream_state", "code": 400}}
CASES: list[tuple[str, httpx.Response | Exception, type[PipelineError], int, str, int]] = [
    # name, sidecar answer, error type, client status, OpenAI type, sidecars tried
    ("400", httpx.Response(400, json=VLLM_400), DerenderRejected, 400, "BadRequestError", 1),
    ("422", httpx.Response(422, json={"detail": "Unprocessable"}), DerenderRejected, 422, "BadRequestError", 1),
    ("bare 404", httpx.Response(404, json={"detail": "Not Found"}), ResponseStageError, 502,
     "ResponseStageError", 1),
    ("405", httpx.Response(405, json={"detail": "Method Not Allowed"}), ResponseStageError, 502,
     "ResponseStageError", 1),
    ("501", httpx.Response(501, json={"error": {"message": "not implemented", "code": 501}}),
     ResponseStageError, 502, "ResponseStageError", 1),
    ("500", httpx.Response(500, text="Internal Server Error"), DerenderUnavailable, 502, "BadGatewayError", 2),
    ("refused", httpx.ConnectError("refused"), DerenderUnavailable, 502, "BadGatewayError", 2),
    ("cut", httpx.RemoteProtocolError("Server disconnected"), DerenderUnavailable, 502, "BadGatewayError", 2),
    ("timeout", httpx.ReadTimeout("timed out"), DerenderTimeout, 504, "GatewayTimeoutError", 1),
    ("malformed JSON", httpx.Response(200, content=b"{not json"), DerenderUnavailable, 502,
     "BadGatewayError", 1),
]


@pytest.mark.parametrize(("name", "answer", "kind", "status", "type_", "tried"), CASES,
                         ids=[c[0] for c in CASES])
async def test_derender_failures_map_to_response_stage_errors(
        name: str, answer: httpx.Response | Exception, kind: type[PipelineError], status: int, type_: str,
        tried: int) -> None:
    calls: list[str] = []
    with pytest.raises(ResponseStageError) as info:
        await pool(answer, calls).post(DERENDER, {"x": 1}, stage="derender")
    exc = info.value
    assert type(exc) is kind and exc.status == status and exc.type == type_
    assert exc.body()["error"]["code"] == status
    assert len(calls) == tried  # only a failure without a usable answer is retried on another sidecar
    assert not isinstance(exc, UpstreamUnavailable | UpstreamTimeout | UpstreamClientError)


async def test_a_derender_400_keeps_the_sidecars_detail() -> None:
    with pytest.raises(DerenderRejected) as info:
        await pool(httpx.Response(400, json=VLLM_400), []).post(DERENDER, {}, stage="derender")
    assert info.value.message == "Invalid stream_state: expected a dict"
    assert info.value.param == "stream_state"


async def test_render_keeps_its_upstream_errors_for_the_fallback() -> None:
    """Render failures stay ``Upstream*``: the render fallback decides on those."""
    with pytest.raises(UpstreamUnavailable):
        await pool(httpx.Response(404, json={"detail": "Not Found"}), []).post("/v1/x/render", {})
    with pytest.raises(UpstreamClientError):
        await pool(httpx.Response(422, json={"detail": "bad"}), []).post("/v1/x/render", {})


def _ctx() -> tuple[RequestContext, PromptPlan]:
    ctx = RequestContext(kind="chat", request_id="r", body={"model": "m", "messages": []}, model="m",
                         stream=True, include_usage=False, priority=0)
    plan = PromptPlan(index=0, generate={"request_id": "r"}, prompt_token_ids=[1, 2, 3], n=1, stop=StopSpec())
    return ctx, plan


@pytest.mark.parametrize("body", [{"no_chunk": 1}, [1, 2], {"chunk": "text"}])
async def test_an_unexpected_derender_body_is_a_response_stage_502(body: Any) -> None:
    ctx, plan = _ctx()
    derenderer = Derenderer(pool(httpx.Response(200, json=body), []), parsers=False)
    with pytest.raises(DerenderUnavailable):
        await derenderer.stream_chunk(ctx, plan, {"choices": [{"index": 0, "token_ids": [5]}]}, None)
