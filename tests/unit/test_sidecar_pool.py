"""The render sidecar pool: which sidecar takes each call, retries, skipping a dead one, JSON on the wire."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import httpx
import msgspec
import pytest

from coordinator.api.openai.sse import frame
from coordinator.config import RenderSettings
from coordinator.pipeline.errors import UpstreamClientError, UpstreamTimeout, UpstreamUnavailable
from coordinator.pipeline.sidecar import SidecarClient, encode

URLS = ["http://s0:8100", "http://s1:8101", "http://s2:8102"]
Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pool(handler: Handler, urls: list[str] = URLS, clock: Clock | None = None, **settings: object
         ) -> SidecarClient:
    return SidecarClient(RenderSettings(urls=urls, **settings), transport=httpx.MockTransport(handler),
                         clock=clock or Clock())


def host(request: httpx.Request) -> str:
    return f"http://{request.url.host}:{request.url.port}"


async def ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"served_by": host(request)})


async def served_by(client: SidecarClient) -> str:
    out = await client.post("/v1/chat/completions/derender", {"x": 1})
    return str(out["served_by"])


async def test_idle_sidecars_take_calls_in_turn() -> None:
    client = pool(ok)
    assert [await served_by(client) for _ in range(6)] == URLS + URLS


async def test_renders_take_turns_whatever_derender_calls_come_between() -> None:
    """Render and derender keep their own turn: an odd number of derender calls between renders (a
    stream's chunks) must not send every render to the same sidecar."""
    client = pool(ok, urls=URLS[:2])
    renders = []
    for _ in range(4):
        out = await client.post("/v1/chat/completions/render", {"x": 1}, stage="render")
        renders.append(out["served_by"])
        await client.post("/v1/chat/completions/derender", {"x": 1}, stage="derender")
    assert renders == URLS[:2] * 2


async def test_a_call_goes_to_the_sidecar_with_fewest_calls_in_flight() -> None:
    gates = {u: asyncio.Event() for u in URLS}

    async def slow(request: httpx.Request) -> httpx.Response:
        await gates[host(request)].wait()
        return await ok(request)

    client = pool(slow)
    first = [asyncio.create_task(served_by(client)) for _ in range(3)]  # one on each, all held
    await asyncio.sleep(0.01)
    gates[URLS[1]].set()
    assert await first[1] == URLS[1]
    gates[URLS[1]].clear()
    # s1 is the only idle one: it takes the next two calls even though round robin would move on
    nxt = [asyncio.create_task(served_by(client)) for _ in range(2)]
    await asyncio.sleep(0.01)
    assert [s.outstanding for s in client.sidecars] == [1, 2, 1]
    for gate in gates.values():
        gate.set()
    assert await asyncio.gather(*nxt) == [URLS[1], URLS[1]]
    await asyncio.gather(*first)


async def test_a_refused_connection_is_retried_elsewhere_and_the_sidecar_skipped_for_a_while() -> None:
    attempts: dict[str, int] = {}
    dead = {URLS[0]}

    async def handler(request: httpx.Request) -> httpx.Response:
        attempts[host(request)] = attempts.get(host(request), 0) + 1
        if host(request) in dead:
            raise httpx.ConnectError("connection refused", request=request)
        return await ok(request)

    clock = Clock()
    client = pool(handler, clock=clock, skip_s=2.0)
    served = [await served_by(client) for _ in range(6)]
    assert URLS[0] not in served and set(served) == {URLS[1], URLS[2]}
    assert attempts[URLS[0]] == 1  # tried once, then skipped
    clock.now += 2.5  # skip over: tried again within a turn, still dead, skipped again
    assert URLS[0] not in {await served_by(client) for _ in range(6)} and attempts[URLS[0]] == 2
    dead.clear()
    clock.now += 2.5  # back: it takes calls again
    assert URLS[0] in {await served_by(client) for _ in range(3)}


@pytest.mark.parametrize("failure", ["5xx", "broken"])
async def test_a_failed_answer_is_retried_once_on_another_sidecar(failure: str) -> None:
    attempts: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        attempts.append(host(request))
        if len(attempts) > 1:
            return await ok(request)
        if failure == "5xx":
            return httpx.Response(500, text="Internal Server Error")
        raise httpx.RemoteProtocolError("Server disconnected without sending a response", request=request)

    client = pool(handler)
    assert await served_by(client) == attempts[1] != attempts[0]
    assert client.sidecars[0].skip_until == 0.0  # a failed answer is not a dead sidecar


@pytest.mark.parametrize("failure", ["broken", "5xx", "refused"])
async def test_a_lone_sidecar_gets_a_second_try_only_for_a_broken_connection(failure: str) -> None:
    attempts: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        attempts.append(host(request))
        if len(attempts) > 1:
            return await ok(request)
        if failure == "5xx":
            return httpx.Response(500, text="Internal Server Error")
        if failure == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        raise httpx.ReadError("[Errno 104] Connection reset by peer", request=request)

    client = pool(handler, urls=[URLS[0]])
    if failure == "broken":
        assert await served_by(client) == URLS[0] and attempts == [URLS[0], URLS[0]]
    else:
        with pytest.raises(UpstreamUnavailable):
            await served_by(client)
        assert attempts == [URLS[0]]


async def test_the_keepalive_race_on_a_real_socket_costs_the_client_nothing() -> None:
    """A real server that, like uvicorn at its keep-alive timeout, resets a pooled connection just as
    the next call arrives on it: the call is answered from a fresh connection."""
    import socket
    import struct

    served = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        calls_here = 0
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            calls_here += 1
            if calls_here == 2:  # the second call on one connection: reset it (RST, no answer)
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return
            served += 1
            body = json.dumps({"served": served}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = SidecarClient(RenderSettings(url=f"http://127.0.0.1:{port}", max_connections=1))
    try:
        assert (await client.post("/v1/chat/completions/derender", {"x": 1}))["served"] == 1
        assert (await client.post("/v1/chat/completions/derender", {"x": 2}))["served"] == 2
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_two_failures_surface_as_502_and_client_errors_or_timeouts_are_not_retried() -> None:
    attempts: list[str] = []

    async def fail(request: httpx.Request) -> httpx.Response:
        attempts.append(host(request))
        return httpx.Response(503, text="overloaded")

    with pytest.raises(UpstreamUnavailable) as info:
        await served_by(pool(fail))
    assert info.value.status == 502 and len(attempts) == 2

    attempts.clear()

    async def refuse(request: httpx.Request) -> httpx.Response:
        attempts.append(host(request))
        return httpx.Response(400, json={"error": {"message": "bad", "type": "BadRequestError"}})

    with pytest.raises(UpstreamClientError):
        await served_by(pool(refuse))
    assert len(attempts) == 1

    attempts.clear()

    async def stall(request: httpx.Request) -> httpx.Response:
        attempts.append(host(request))
        raise httpx.ReadTimeout("timed out", request=request)

    with pytest.raises(UpstreamTimeout):
        await served_by(pool(stall))
    assert len(attempts) == 1


async def test_all_sidecars_down_is_a_502_after_trying_two() -> None:
    attempts: list[str] = []

    async def refuse(request: httpx.Request) -> httpx.Response:
        attempts.append(host(request))
        raise httpx.ConnectError("connection refused", request=request)

    client = pool(refuse)
    for _ in range(3):
        with pytest.raises(UpstreamUnavailable):
            await served_by(client)
    assert len(attempts) == 6  # every call still tries two sidecars (the longest-skipped first)


async def test_without_urls_the_single_url_is_used() -> None:
    settings = RenderSettings(url="http://only:9000")
    assert settings.endpoints == ["http://only:9000"]
    client = SidecarClient(settings, transport=httpx.MockTransport(ok))
    assert {await served_by(client) for _ in range(3)} == {"http://only:9000"}
    assert RenderSettings(url="http://only:9000", urls=URLS[:2]).endpoints == URLS[:2]


def test_sidecar_urls_are_validated() -> None:
    with pytest.raises(ValueError, match="twice"):
        RenderSettings(urls=[URLS[0], URLS[0]])
    with pytest.raises(ValueError, match="http"):
        RenderSettings(urls=["127.0.0.1:8100"])


async def test_health_reports_each_sidecar_and_models_come_from_a_live_one() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if host(request) == URLS[0]:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "served_by": host(request)}]})
        return httpx.Response(200 if host(request) == URLS[1] else 503)

    client = pool(handler)
    assert await client.health() == {URLS[0]: False, URLS[1]: True, URLS[2]: False}
    assert await client.healthy()
    assert (await client.models())[0]["served_by"] == URLS[1]


async def test_bodies_are_utf8_json_and_raw_fragments_are_spliced_verbatim() -> None:
    seen: list[httpx.Request] = []

    async def echo(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=request.content, headers={"content-type": "application/json"})

    client = pool(echo, urls=URLS[:1])
    options = msgspec.Raw(encode({"tools": [{"name": "é"}], "temperature": 0.5}))
    out = await client.post("/p", {"chunk": [1, 2], "chat_request": options}, request_id="r-1")
    assert out == {"chunk": [1, 2], "chat_request": {"tools": [{"name": "é"}], "temperature": 0.5}}
    assert seen[0].headers["content-type"] == "application/json" and seen[0].headers["x-request-id"] == "r-1"
    assert "é".encode() in seen[0].content
    assert await client.post_raw("/p", b'{"a":[1,{"b":null}]}') == {"a": [1, {"b": None}]}


def test_sse_frame_is_compact_utf8_json_with_the_exact_framing() -> None:
    chunk = {"choices": [{"delta": {"content": "héllo \u2028 \"😀\""}, "index": 0}], "usage": None}
    data = frame(chunk)
    assert data.startswith(b"data: {") and data.endswith(b"}\n\n") and data.count(b"\n") == 2
    assert "😀".encode() in data and b"\\u" not in data
    assert json.loads(data[len(b"data: "):]) == chunk
