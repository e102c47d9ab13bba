"""Trigger P/D on simulated layer-wise engines: the wire each engine sees, the metaserver's answers,
and what happens when a leg fails (docs/scheduling.md, docs/trigger-protocol.md).

The decode simulators act as vLLM-Ascend's MooncakeLayerwiseConnector: they call the metaserver URL
in their request and wait for the prefill engine's KV before they stream. The matrix in
test_topology_matrix.py covers the client's view (text, usage, relay, leaving clients); these tests
read what the engines received and what the metaserver answered.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from tests.conftest import SERVED, CoordinatorFactory
from tests.support import CoordinatorServer, sse_events, streamed_text, wait_until
from token_engine.simulator import SimConfig, SimulatedEngine


def _sim(stack: ExitStack, role: str, **cfg: Any) -> SimulatedEngine:
    return stack.enter_context(SimulatedEngine(SimConfig(
        model=SERVED, mode="context", decode_s_per_token=0.004, kv_role=role, kv_connector="layerwise",
        **cfg)))


class Pair:
    def __init__(self, coord: CoordinatorServer, prefill: SimulatedEngine, decode: SimulatedEngine) -> None:
        self.coord, self.prefill, self.decode = coord, prefill, decode

    def held(self) -> int:
        return int(httpx.get(f"{self.coord.url}/admin/accounting", timeout=10).json()["held"])

    def idle(self) -> bool:
        return self.held() == 0 and all(not e.state()["running"] and not e.state()["waiting"]
                                        for e in (self.prefill, self.decode))

    def path(self, name: str) -> float:
        value = self.coord.components.metrics.registry.get_sample_value(
            "coordinator_pd_decisions_total", {"path": name})
        return float(value or 0)


def make_pair(stack: ExitStack, render_url: str, factory: CoordinatorFactory, **trigger: Any) -> Pair:
    p, d = _sim(stack, "prefill", engine_id="p0"), _sim(stack, "decode", engine_id="d0")
    engines = [{"url": p.url, "role": "prefill", "pd_protocol": "trigger"},
               {"url": d.url, "role": "decode", "pd_protocol": "trigger"}]
    coord = factory(render_url, [], engines=engines, engine_client={"health_interval_s": 60},
                    topology={"pd_min_uncached_tokens": 0, "trigger": {"port": 0, **trigger}})
    return Pair(coord, p, d)


@pytest.fixture
def pair(render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> Iterator[Pair]:
    with ExitStack() as stack:
        yield make_pair(stack, render_sidecar.url, coordinator_factory)


def chat(stream: bool, max_tokens: int = 16) -> dict[str, Any]:
    body: dict[str, Any] = {"model": SERVED, "messages": [{"role": "user", "content": "Tell me about the sea."}],
                            "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def test_decode_first_then_the_prefill_under_the_same_id_with_the_callback_params(pair: Pair) -> None:
    r = httpx.post(f"{pair.coord.url}/v1/chat/completions", json=chat(False), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    (decode,) = pair.decode.state()["history"]
    (prefill,) = pair.prefill.state()["history"]
    # The decode engine got the whole request, told to wait for a remote prefill and where to call.
    kv = decode["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    url = urlsplit(kv["metaserver"])
    assert url.path == "/v1/metaserver" and url.port == pair.coord.components.metaserver.port
    token = parse_qs(url.query)["attempt"][0]
    assert len(token) >= 24  # unguessable, one per attempt
    assert decode["sampling_params"]["max_tokens"] == 16
    # The prefill: one token, not streamed, under the decode leg's id, with the decode engine's own
    # transfer parameters (from its callback), roles swapped and no metaserver.
    assert prefill["request_id"] == decode["request_id"]
    assert prefill["stream"] is False and prefill["sampling_params"] == {"max_tokens": 1, "n": 1, "min_tokens": 1}
    pkv = prefill["kv_transfer_params"]
    assert pkv["do_remote_decode"] is True and pkv["do_remote_prefill"] is False and "metaserver" not in pkv
    assert pkv["request_id"] == f"generate-tokens-{decode['request_id']}"
    assert pkv["remote_engine_id"] == "d0" and pkv["remote_port"] == urlsplit(pair.decode.url).port
    # The connector's keys, in its order (docs/trigger-protocol.md A4), passed through unchanged.
    assert list(pkv) == ["token_ids", "request_id", "do_remote_prefill", "do_remote_decode", "remote_block_ids",
                         "remote_block_size", "remote_engine_id", "remote_host", "remote_port", "remote_tp_size",
                         "remote_pcp_size", "remote_dcp_size", "remote_cached_tokens"]
    # The decode engine's callback was answered 200, and the prefill engine pushed the KV to it.
    assert pair.decode.state()["layerwise"]["callback_statuses"] == [200]
    assert pair.prefill.state()["layerwise"]["pushed"] == {"done": 1, "failed": 0}
    assert pair.path("trigger") == 1
    assert wait_until(pair.idle, timeout=10)


def test_the_metaserver_refuses_what_is_not_a_live_attempt(pair: Pair) -> None:
    """Unknown token 404, no token or a malformed body 400, a repeat after the prefill ``{}``, a
    callback for an attempt that ended 409 (stale)."""
    meta = pair.coord.components.metaserver
    base = f"http://127.0.0.1:{meta.port}/v1/metaserver"
    body = {"request_id": "generate-tokens-x", "do_remote_decode": True}
    r = httpx.post(f"{base}?attempt=not-a-token", json=body)
    assert r.status_code == 404 and r.json()["error"]["message"] == "Trigger attempt not found"
    assert httpx.post(base, json=body).status_code == 400
    bad = httpx.post(f"{base}?attempt=x", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
    assert httpx.post(f"{base}?attempt=x", json={}).status_code == 400
    # A long stream: once its first chunk is out the prefill is done; a repeat callback gets {}.
    with httpx.stream("POST", f"{pair.coord.url}/v1/chat/completions", json=chat(True, 400), timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        (decode,) = pair.decode.state()["history"]
        url, rid = decode["kv_transfer_params"]["metaserver"], f"generate-tokens-{decode['request_id']}"
        # The prefill engine's share of the budget went back with the first chunk; the decode's is held.
        shares = {e["url"]: e["inflight_tokens"] for e in
                  httpx.get(f"{pair.coord.url}/admin/accounting", timeout=10).json()["engines"]}
        assert shares[pair.prefill.url] == 0 and shares[pair.decode.url] > 0
        repeat = httpx.post(url, json={"request_id": rid, "do_remote_decode": True})
        assert repeat.status_code == 200 and repeat.json() == {}
        other = httpx.post(url, json={"request_id": "generate-tokens-someone-else"})
        assert other.status_code == 409
    assert wait_until(pair.idle, timeout=10)
    stale = httpx.post(url, json={"request_id": rid})
    assert stale.status_code == 409 and stale.json()["error"]["message"] == "Stale trigger attempt callback"
    assert len(pair.prefill.state()["history"]) == 1  # no callback started a second prefill
    answered = {status: pair.coord.components.metrics.registry.get_sample_value(
        "coordinator_trigger_callbacks_total", {"status": status}) for status in ("200", "400", "404", "409")}
    assert answered == {"200": 2, "400": 3, "404": 1, "409": 2}  # the engine's call and the repeat: 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_prefill_leg_is_retried_and_the_decode_engine_prefills_itself(pair: Pair, stream: bool) -> None:
    """The only prefill engine answers 500: the callback gets a 500, the decode request is aborted,
    and the retry (no prefill engine left for this request) runs on the decode engine alone."""
    want = httpx.post(f"{pair.coord.url}/v1/chat/completions", json=chat(stream), timeout=60)
    pair.prefill.set_faults(fail_next=1, fail_status=500)
    got = httpx.post(f"{pair.coord.url}/v1/chat/completions", json=chat(stream), timeout=60)
    assert got.status_code == 200, got.text
    if stream:
        assert streamed_text(sse_events(got)) == streamed_text(sse_events(want))
    else:
        assert got.json()["choices"][0]["message"] == want.json()["choices"][0]["message"]
    assert pair.decode.state()["layerwise"]["callback_statuses"] == [200, 500]
    first, failed, third = pair.decode.state()["history"]
    assert "metaserver" in first["kv_transfer_params"] and "metaserver" in failed["kv_transfer_params"]
    assert third["kv_transfer_params"] is None  # decode_only: the engine computes the prompt itself
    assert len(pair.decode.state()["aborted"]) == 1
    assert pair.path("decode_only") == 1
    assert wait_until(pair.idle, timeout=10)


def test_a_decode_engine_that_never_calls_back_fails_over_to_the_prefill_engine_alone(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """The engines are told to call an address where nothing listens: the attempt waits
    ``callback_timeout_s``, fails on the decode engine (its request aborted), and the retry, with no
    decode engine left for this request, runs alone on the prefill engine (the hybrid fallback);
    the client gets its answer and nothing stays held."""
    with ExitStack() as stack:
        pair = make_pair(stack, render_sidecar.url, coordinator_factory, advertise_host="127.0.0.2",
                         callback_timeout_s=0.5)
        r = httpx.post(f"{pair.coord.url}/v1/chat/completions", json=chat(False), timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 16
        assert pair.decode.state()["layerwise"]["callbacks_failed"] == 1
        (alone,) = pair.prefill.state()["history"]
        assert alone["kv_transfer_params"] is None and alone["sampling_params"]["max_tokens"] == 16
        assert pair.path("trigger") == 1 and pair.path("fallback_prefill") == 1
        assert wait_until(pair.idle, timeout=10)
        assert len(pair.decode.state()["aborted"]) == 1
