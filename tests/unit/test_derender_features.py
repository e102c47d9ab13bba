"""What the coordinator learns from its render sidecars, and how a stream's derender calls use it.

The sidecars here are stand-ins answering as our render server and vLLM's do (their answers are
checked against the real ones in tests/integration/test_parser_sessions.py); what is under test is
the coordinator's side: which sidecar gets a call, what the call carries, what stops a start.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from coordinator.config import RenderSettings
from coordinator.pipeline.context import PromptPlan, RequestContext, StopSpec
from coordinator.pipeline.derender.client import Derenderer
from coordinator.pipeline.derender.features import (
    EXACT_UNDER_COALESCING,
    FeatureBook,
    SidecarFeatures,
    SidecarsDisagree,
    agree,
    from_probe,
)
from coordinator.pipeline.errors import DerenderRejected
from coordinator.pipeline.sidecar import Affinity, SidecarClient

URLS = ["http://s0:8100", "http://s1:8101"]
HERMES = {"tool_call_parser": "hermes", "reasoning_parser": None, "enable_auto_tool_choice": True,
          "parsers": True, "session_cache": {"max_entries": 8, "max_bytes": 1, "idle_ttl_s": 1}}
PLAIN = {"tool_call_parser": None, "reasoning_parser": None, "enable_auto_tool_choice": False,
         "parsers": False, "session_cache": {"max_entries": 8, "max_bytes": 1, "idle_ttl_s": 1}}
VLLM_PARSER_400 = {"error": {"message": "prompt_token_ids is required when a tool or reasoning parser is "
                             "configured. Without it ...", "type": "BadRequestError", "param": None, "code": 400}}
SESSION_MISS = {"error": {"message": "no session", "type": "stream_session_miss", "param": None, "code": 409}}


class Sidecars:
    """Stand-in sidecars: per URL, capabilities (None = plain vLLM: 404) and how derender answers."""

    def __init__(self, capabilities: dict[str, dict[str, Any] | None], *, vllm_parsers: bool = False) -> None:
        self.capabilities = capabilities
        self.vllm_parsers = vllm_parsers
        self.sessions: set[tuple[str, str]] = set()   # (sidecar, stream) that hold a session
        self.calls: list[tuple[str, str, dict[str, Any] | None]] = []
        self.down: set[str] = set()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        url = f"http://{request.url.host}:{request.url.port}"
        body = json.loads(request.content) if request.content else None
        self.calls.append((url, request.url.path, body))
        if url in self.down:
            raise httpx.ConnectError("refused")
        if request.url.path == "/derender/capabilities":
            caps = self.capabilities[url]
            return httpx.Response(404, json={"detail": "Not Found"}) if caps is None else httpx.Response(200, json=caps)
        assert body is not None
        if self.capabilities[url] is None:  # vLLM's render server
            if self.vllm_parsers and body.get("prompt_token_ids") is None:
                return httpx.Response(400, json=VLLM_PARSER_400)
            return httpx.Response(200, json={"chunk": {"choices": []}, "stream_state": {"n": 1}})
        rid = body["generate_chunk"].get("request_id", "")
        if body.get("stream_state") is not None and (url, rid) not in self.sessions \
                and body.get("prompt_token_ids") is None:
            return httpx.Response(409, json=SESSION_MISS)
        self.sessions.add((url, rid))
        return httpx.Response(200, json={"chunk": {"choices": []}, "stream_state": {"n": 1}})


def client(sidecars: Sidecars, urls: list[str] = URLS) -> SidecarClient:
    return SidecarClient(RenderSettings(urls=urls), transport=httpx.MockTransport(sidecars))


def test_pool_features_need_the_same_parsers_and_name_each_sidecar_when_not() -> None:
    hermes, plain = SidecarFeatures.from_capabilities(HERMES), SidecarFeatures.from_capabilities(PLAIN)
    assert agree({URLS[0]: hermes, URLS[1]: hermes}).session_cache
    with pytest.raises(SidecarsDisagree) as exc:
        agree({URLS[0]: hermes, URLS[1]: plain})
    assert URLS[0] in str(exc.value) and URLS[1] in str(exc.value) and "hermes" in str(exc.value)


def test_a_plain_vllm_sidecar_is_told_by_its_answer_to_a_probe() -> None:
    assert from_probe(200, {}) == SidecarFeatures(parsers=False, names_known=False)
    assert from_probe(400, VLLM_PARSER_400) == SidecarFeatures(parsers=True, names_known=False)
    assert from_probe(500, None) is None


def test_coalescing_only_for_parsers_measured_exact() -> None:
    assert {"hermes", "qwen3"} <= EXACT_UNDER_COALESCING
    assert not {"olmo3", "deepseek_r1"} & EXACT_UNDER_COALESCING
    assert SidecarFeatures.from_capabilities(HERMES).coalesce_exact
    assert not SidecarFeatures(parsers=True, reasoning_parser="olmo3").coalesce_exact
    assert not SidecarFeatures(parsers=True, names_known=False).coalesce_exact  # unknown names: 1 token
    assert SidecarFeatures(parsers=False, names_known=False).coalesce_exact


async def test_start_refuses_sidecars_that_disagree() -> None:
    book = FeatureBook(client(Sidecars({URLS[0]: HERMES, URLS[1]: None})))
    with pytest.raises(SidecarsDisagree, match=r"s0:8100.*hermes.*s1:8101"):
        await book.learn(strict=True)


async def test_a_parser_sidecar_under_a_config_that_says_nothing_is_learned() -> None:
    derenderer = Derenderer(client(Sidecars({URLS[0]: None, URLS[1]: None}, vllm_parsers=True)))
    mode = await derenderer.mode()
    assert mode.parsers and not mode.coalesce  # plain vLLM: names unknown, so one token per call


async def test_a_sidecar_that_comes_back_disagreeing_is_excluded() -> None:
    sidecars = Sidecars({URLS[0]: HERMES, URLS[1]: HERMES})
    pool = client(sidecars)
    book = FeatureBook(pool)
    await book.learn(strict=True)
    sidecars.capabilities[URLS[1]] = PLAIN       # restarted without the parser flags
    pool.sidecars[1].relearn = True              # as after a refused connection
    features = await book.ensure()
    assert features.tool_call_parser == "hermes"
    assert pool.sidecars[1].excluded is not None
    assert all(pool.pick(stage="derender") is pool.sidecars[0] for _ in range(4))


def _ctx() -> tuple[RequestContext, PromptPlan]:
    ctx = RequestContext(kind="chat", request_id="r", body={"model": "m", "messages": []}, model="m",
                         stream=True, include_usage=False, priority=0)
    plan = PromptPlan(index=0, generate={"request_id": "r"}, prompt_token_ids=list(range(1, 500)), n=1,
                      stop=StopSpec())
    return ctx, plan


async def test_prompt_ids_travel_only_to_start_or_replay_a_stream() -> None:
    sidecars = Sidecars({URLS[0]: HERMES, URLS[1]: HERMES})
    derenderer = Derenderer(client(sidecars))
    await derenderer.mode()
    ctx, plan = _ctx()
    route, state = Affinity(), None
    for tok in range(5):
        chunk = {"request_id": "r-0", "choices": [{"index": 0, "token_ids": [tok]}]}
        _, state = await derenderer.stream_chunk(ctx, plan, chunk, state, route=route)
    calls = [(u, b) for u, p, b in sidecars.calls if p.endswith("/derender") and b and "generate_chunk" in b]
    assert len({u for u, _ in calls}) == 1, "a stream's calls stay on one sidecar"
    assert [b["prompt_token_ids"] is not None for _, b in calls] == [True, False, False, False, False]

    sidecars.sessions.clear()  # the sidecar restarted: its sessions are gone
    sidecars.calls.clear()
    chunk = {"request_id": "r-0", "choices": [{"index": 0, "token_ids": [9]}]}
    await derenderer.stream_chunk(ctx, plan, chunk, state, route=route)
    sent = [b["prompt_token_ids"] is not None for _, p, b in sidecars.calls if b and "generate_chunk" in b]
    assert sent == [False, True], "a 409 session miss is sent again with the prompt ids"


async def test_a_stream_moves_when_its_sidecar_is_gone() -> None:
    sidecars = Sidecars({URLS[0]: HERMES, URLS[1]: HERMES})
    pool = client(sidecars)
    derenderer = Derenderer(pool)
    await derenderer.mode()
    ctx, plan = _ctx()
    route = Affinity()
    chunk = {"request_id": "r-0", "choices": [{"index": 0, "token_ids": [1]}]}
    _, state = await derenderer.stream_chunk(ctx, plan, chunk, None, route=route)
    first = route.sidecar
    assert first is not None
    sidecars.down.add(first.url)
    await derenderer.stream_chunk(ctx, plan, chunk, state, route=route)
    assert route.sidecar is not None and route.sidecar is not first


async def test_other_derender_refusals_still_fail_the_call() -> None:
    async def refuse(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/derender/capabilities":
            return httpx.Response(200, json=HERMES)
        return httpx.Response(400, json={"error": {"message": "bad state", "type": "BadRequestError"}})

    derenderer = Derenderer(SidecarClient(RenderSettings(urls=URLS), transport=httpx.MockTransport(refuse)))
    await derenderer.mode()
    ctx, plan = _ctx()
    route = Affinity(derenderer._sidecar.sidecars[0])
    with pytest.raises(DerenderRejected):
        await derenderer.stream_chunk(ctx, plan, {"request_id": "x", "choices": []}, {"n": 1}, route=route)
