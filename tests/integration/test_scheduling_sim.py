"""Admission, routing policies, retries, breakers and P/D handoff through the whole coordinator.

Real render sidecar, simulated engines (vLLM's wire format; tests/e2e checks it against a real engine),
so faults, slow engines and many engines are cheap.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from tests.conftest import SERVED, CoordinatorFactory
from tests.support import CoordinatorServer, free_port, sse_events, streamed_text, wait_until
from token_engine.simulator import SimConfig, SimulatedEngine


@contextlib.contextmanager
def sims(n: int, **cfg: Any) -> Iterator[list[SimulatedEngine]]:
    with ExitStack() as stack:
        yield [stack.enter_context(SimulatedEngine(SimConfig(model=SERVED, seed=i, **cfg))) for i in range(n)]


@pytest.fixture
def two() -> Iterator[list[SimulatedEngine]]:
    with sims(2, decode_s_per_token=0.002) as engines:
        yield engines


def chat(content: str = "Tell me a long story.", **extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": content}], "max_tokens": 20, **extra}


def sample(coord: CoordinatorServer, name: str, **labels: str) -> float:
    value = coord.components.metrics.registry.get_sample_value(name, labels or None)
    return float(value or 0.0)


def released(coord: CoordinatorServer) -> bool:
    """Nothing held: no admitted tokens, nobody queued, every engine's counters at zero."""
    c = coord.components
    return (c.ledger.global_inflight == 0 and c.admission.queue_length == 0
            and all(e.inflight_tokens == 0 and e.inflight_requests == 0 for e in c.registry.engines))


def held_report(coord: CoordinatorServer, sim: SimulatedEngine, seen: list[str]) -> str:
    """What a failed "still held" assertion needs to be read: the lines the client got, the engine's
    requests and the coordinator's request and relay counters."""
    metrics = [line for line in httpx.get(f"{coord.url}/metrics").text.splitlines()
               if line.startswith(("coordinator_requests_total", "coordinator_relay", "coordinator_engine_",
                                   "coordinator_inflight", "coordinator_rejected"))]
    state = sim.state()
    engine = {k: state[k] for k in ("running", "waiting", "aborted", "completed", "errored", "generate_calls")}
    history = [{k: h.get(k) for k in ("request_id", "stream", "sampling_params")} for h in state["history"]]
    return "\n".join([f"client lines: {seen}", f"engine: {engine}", f"engine received: {history}",
                      f"pipeline inflight: {coord.inflight}", *metrics])


def queued(coord: CoordinatorServer, n: int) -> bool:
    return coord.components.admission.queue_length == n


def in_background(fn: Any, *args: Any, **kwargs: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


# --------------------------------------------------------------------------- admission

def small_budget(render: Any, factory: CoordinatorFactory, sim: SimulatedEngine, **admission: Any
                 ) -> CoordinatorServer:
    """One engine whose budget (1000 tokens) fits one request of max_tokens 600 at a time."""
    return factory(render.url, [], engines=[{"url": sim.url, "max_inflight_tokens": 1000}],
                   admission={"max_queue": 4, "queue_timeout_s": 5, "retry_after_s": 2, **admission})


def hold(coord: CoordinatorServer, sim: SimulatedEngine, seconds: float) -> threading.Thread:
    """Occupy the engine's whole budget for ``seconds``: the engine never answers this one request and
    its client gives up after ``seconds`` (which releases the budget)."""
    sim.set_faults(hang=True, calls=1)

    def run() -> None:
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(f"{coord.url}/v1/chat/completions", json=chat(max_tokens=900), timeout=seconds)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert wait_until(lambda: coord.components.ledger.global_inflight > 0)
    return t


def test_requests_wait_for_budget_then_run(render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    with sims(1, decode_s_per_token=0.001) as (sim,):
        coord = small_budget(render_sidecar, coordinator_factory, sim)
        holder = hold(coord, sim, 1.5)
        t, out = in_background(httpx.post, f"{coord.url}/v1/chat/completions", json=chat(max_tokens=600),
                               timeout=30)
        assert wait_until(lambda: coord.components.admission.queue_length == 1)
        assert sim.state()["completed"] == 0              # it waits in the coordinator, not in the engine
        holder.join(10)
        t.join(30)
        assert out["result"].status_code == 200
        assert wait_until(lambda: released(coord))
        assert sample(coord, "coordinator_queue_wait_seconds_count") == 2


def test_full_queue_is_429_with_retry_after_and_timeout_is_503(render_sidecar: Any,
                                                               coordinator_factory: CoordinatorFactory) -> None:
    with sims(1) as (sim,):
        coord = small_budget(render_sidecar, coordinator_factory, sim, max_queue=1, queue_timeout_s=1.5)
        url = f"{coord.url}/v1/chat/completions"
        holder = hold(coord, sim, 4)
        t, waiting = in_background(httpx.post, url, json=chat(max_tokens=600), timeout=30)
        assert wait_until(lambda: coord.components.admission.queue_length == 1)
        full = httpx.post(url, json=chat(max_tokens=600, stream=True), timeout=30)
        assert full.status_code == 429 and full.headers["retry-after"] == "2"
        assert full.json()["error"]["type"] == "RateLimitError"
        t.join(30)
        timed_out = waiting["result"]
        assert timed_out.status_code == 503 and timed_out.headers["retry-after"] == "2"
        assert set(timed_out.json()["error"]) == {"message", "type", "param", "code"}
        holder.join(10)
        assert wait_until(lambda: released(coord))
        assert sample(coord, "coordinator_rejected_total", reason="queue_full") == 1
        assert sample(coord, "coordinator_rejected_total", reason="queue_timeout") == 1


def test_priority_header_and_field_order_the_queue(render_sidecar: Any,
                                                   coordinator_factory: CoordinatorFactory) -> None:
    with sims(1, decode_s_per_token=0.0005) as (sim,):
        coord = small_budget(render_sidecar, coordinator_factory, sim)
        url = f"{coord.url}/v1/chat/completions"
        done: list[str] = []

        def send(tag: str, headers: dict[str, str] | None = None, **kw: Any) -> None:
            r = httpx.post(url, timeout=30, headers={"X-Request-Id": f"tag-{tag}", **(headers or {})}, **kw)
            assert r.status_code == 200
            done.append(tag)

        holder = hold(coord, sim, 2)
        threads = []
        for tag, kw in [("low", {"json": chat(max_tokens=600), "headers": {"X-Request-Priority": "5"}}),
                        ("default", {"json": chat(max_tokens=600)}),
                        ("urgent", {"json": chat(max_tokens=600, priority=-3)})]:
            threads.append(in_background(send, tag, **kw)[0])
            assert wait_until(functools.partial(queued, coord, len(threads)))
        holder.join(10)
        for t in threads:
            t.join(30)
        assert sorted(done) == ["default", "low", "urgent"]
        # The order the engine received them in (the budget fits one at a time) is the queue's order;
        # the order the clients finished in may differ by what happens after the engine is released.
        received = [h["request_id"].split("-")[2] for h in sim.state()["history"]
                    if h["request_id"].startswith("chatcmpl-tag-")]
        assert received == ["urgent", "default", "low"]
        assert wait_until(lambda: released(coord))


def test_the_clients_priority_orders_the_engines_own_queue(render_sidecar: Any,
                                                            coordinator_factory: CoordinatorFactory) -> None:
    """An engine run with ``--scheduling-policy priority`` orders what waits in it by the request's
    ``priority``: the coordinator passes the client's on, from the body or the priority header."""
    with sims(1, decode_s_per_token=0.004, max_concurrency=1, scheduling_policy="priority") as (sim,):
        coord = coordinator_factory(render_sidecar.url, [sim.url])  # no coordinator queue: all reach it
        url = f"{coord.url}/v1/chat/completions"
        done: list[str] = []

        def send(tag: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
            r = httpx.post(url, json=body, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
            done.append(tag)

        threads = [in_background(send, "running", chat(max_tokens=150))[0]]
        assert wait_until(lambda: len(sim.state()["running"]) == 1)
        for tag, body, headers in [("default", chat(max_tokens=30), None),
                                   ("header", chat(max_tokens=30), {"X-Request-Priority": "-2"}),
                                   ("field", chat(max_tokens=30, priority=-5), None)]:
            threads.append(in_background(send, tag, body, headers)[0])
            waiting = len(threads) - 1
            assert wait_until(lambda n=waiting: len(sim.state()["waiting"]) == n)  # type: ignore[misc]
        for t in threads:
            t.join(30)
        assert done == ["running", "field", "header", "default"]


def test_bad_priority_header_is_400(render_sidecar: Any, two: list[SimulatedEngine],
                                    coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [two[0].url])
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), headers={"X-Request-Priority": "high"})
    assert r.status_code == 400 and "priority" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["success", "success_stream", "engine_4xx", "engine_5xx", "midstream_error",
                                  "stream_timeout", "client_leaves_stream", "client_leaves_json",
                                  "client_leaves_queue"])
def test_budget_is_released_on_every_exit_path(render_sidecar: Any, coordinator_factory: CoordinatorFactory,
                                               path: str) -> None:
    with sims(1, decode_s_per_token=0.005) as (sim,):
        # Only the stall path needs a short idle timeout: elsewhere a loaded machine's pause between two
        # tokens must not turn the path under test into a stream timeout.
        idle = {"stream_idle_timeout_s": 0.5} if path == "stream_timeout" else {}
        coord = coordinator_factory(render_sidecar.url, [], engines=[{"url": sim.url, "max_inflight_tokens": 600}],
                                    engine_client=idle)
        url = f"{coord.url}/v1/chat/completions"
        if path == "success":
            assert httpx.post(url, json=chat(), timeout=30).status_code == 200
        elif path == "success_stream":
            assert sse_events(httpx.post(url, json=chat(stream=True), timeout=30))[-1] == "[DONE]"
        elif path == "engine_4xx":
            sim.set_faults(fail_next=1, fail_status=400)
            assert httpx.post(url, json=chat(), timeout=30).status_code == 400
        elif path == "engine_5xx":
            sim.set_faults(fail_next=1, fail_status=500)
            assert httpx.post(url, json=chat(stream=True), timeout=30).status_code == 502
        elif path == "midstream_error":
            sim.set_faults(error_after_tokens=3)
            assert "error" in sse_events(httpx.post(url, json=chat(stream=True), timeout=30))[-2]
        elif path == "stream_timeout":
            sim.set_faults(stall_after_tokens=2)
            assert sse_events(httpx.post(url, json=chat(stream=True), timeout=30))[-2]["error"]["code"] == 504
        elif path == "client_leaves_stream":
            # The engine stalls after a few tokens, so the stream is certainly open when the ledger
            # is read; the client then leaves without reading on. ``lines`` stays referenced: a line
            # iterator dropped mid-stream (a `for` over a temporary, a `next(genexp)`) is closed
            # when collected, and that closes the response, which is this path's exit, too early.
            sim.set_faults(stall_after_tokens=4)
            with httpx.Client(timeout=30) as c, c.stream("POST", url, json=chat(max_tokens=400, stream=True)) as r:
                seen: list[str] = []
                lines = r.iter_lines()
                for line in lines:
                    seen.append(line)
                    assert '"error"' not in line, seen
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                        break  # a derendered token reached the client: the stream is live
                assert coord.components.ledger.global_inflight > 0, held_report(coord, sim, seen)
        elif path == "client_leaves_json":
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url, json=chat(max_tokens=400), timeout=0.3)
        elif path == "client_leaves_queue":
            holder = hold(coord, sim, 1.5)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url, json=chat(max_tokens=400, stream=True), timeout=0.5)
            assert wait_until(lambda: sample(coord, "coordinator_rejected_total", reason="cancelled") == 1)
            assert coord.components.admission.queue_length == 0
            holder.join(10)
        assert wait_until(lambda: released(coord)), path
        assert wait_until(lambda: sim.state()["running"] == [])


def test_no_healthy_engine_is_503_without_queueing(render_sidecar: Any,
                                                   coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [f"http://127.0.0.1:{free_port()}"],
                                resilience={"breaker_failures": 1})
    assert wait_until(lambda: not coord.components.registry.any_healthy())
    # The first request is still tried (panic routing: probes alone do not refuse) and opens the breaker.
    assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30).status_code == 502
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    assert released(coord)


# --------------------------------------------------------------------------- policies

def served_by(coord: CoordinatorServer) -> dict[str, float]:
    return {e.url: sample(coord, "coordinator_scheduling_decisions_total",
                          policy=coord.components.scheduler.profile.policy, engine=e.url)
            for e in coord.components.registry.engines}


def route(coord: CoordinatorServer, body: dict[str, Any]) -> str:
    before = served_by(coord)
    assert httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    after = served_by(coord)
    (engine,) = [u for u in after if after[u] > before[u]]
    return engine


LONG = "You are a meticulous librarian. " * 40  # ~280 tokens of shared system prompt


def convo(tag: str, turn: int) -> dict[str, Any]:
    msgs = [{"role": "system", "content": f"{tag}: {LONG}"}]
    for i in range(turn):
        msgs += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    return chat(messages=[*msgs, {"role": "user", "content": f"question {turn}"}], max_tokens=4)


def test_affinity_keeps_a_conversation_on_its_engine(render_sidecar: Any,
                                                     coordinator_factory: CoordinatorFactory) -> None:
    with sims(3) as engines:
        coord = coordinator_factory(render_sidecar.url, [e.url for e in engines])
        homes = {tag: route(coord, convo(tag, 0)) for tag in ("alpha", "beta", "gamma")}
        assert len(set(homes.values())) == 3           # new conversations spread by load (ties rotate)
        for turn in (1, 2, 3):
            for tag, home in homes.items():
                assert route(coord, convo(tag, turn)) == home
        assert sample(coord, "coordinator_prefix_hit_ratio") > 0.5
        # The engines' own counters agree: later turns hit their prefix cache.
        for e in engines:
            assert e.state()["prefix_cache"]["hits"] > 0
        # Every prompt's hashes came from the render sidecar, none were computed on the event loop.
        assert sample(coord, "coordinator_prefix_hashes_total", source="render") == 12
        assert sample(coord, "coordinator_prefix_hashes_total", source="coordinator") == 0


def test_render_sidecar_hashes_prompts_exactly_as_the_coordinator_does(render_sidecar: Any) -> None:
    """Our sidecar adds each rendered prompt's block hashes when asked, equal to the coordinator's own
    (salt included, every prompt of a batch), and answers vLLM's body untouched when not asked."""
    from coordinator.contracts.hashing import block_hashes, chain_seed

    ask = {"x-prefix-hash": f"16 {SERVED}"}
    body = convo("hash", 2)
    plain = httpx.post(f"{render_sidecar.url}/v1/chat/completions/render", json=body, timeout=30)
    hashed = httpx.post(f"{render_sidecar.url}/v1/chat/completions/render", json=body, headers=ask, timeout=30)
    assert plain.status_code == hashed.status_code == 200 and "block_hashes" not in plain.json()
    got = hashed.json()
    assert hashed.headers["x-prefix-hash"] == ask["x-prefix-hash"]
    same = {k: v for k, v in plain.json().items() if k != "request_id"}   # a fresh id per call
    assert {k: v for k, v in got.items() if k not in ("block_hashes", "request_id")} == same
    ids = got["token_ids"]
    assert len(ids) >= 32 and got["block_hashes"] == block_hashes(ids, 16, chain_seed(SERVED))
    salted = httpx.post(f"{render_sidecar.url}/v1/chat/completions/render", json={**body, "cache_salt": "t1"},
                        headers={"x-prefix-hash": f"8 {SERVED}"}, timeout=30).json()
    assert salted["block_hashes"] == block_hashes(salted["token_ids"], 8, chain_seed(SERVED, "t1"))
    batch = httpx.post(f"{render_sidecar.url}/v1/completions/render", headers=ask, timeout=30,
                       json={"model": SERVED, "prompt": [list(range(100, 140)), list(range(200, 250))]}).json()
    assert [g["block_hashes"] for g in batch] == [block_hashes(g["token_ids"], 16, chain_seed(SERVED))
                                                  for g in batch]
    assert [len(g["block_hashes"]) for g in batch] == [2, 3]
    bad = httpx.post(f"{render_sidecar.url}/v1/chat/completions/render", headers=ask, timeout=30,
                     json={"model": SERVED, "messages": "not a list"})
    assert bad.status_code == 400 and "block_hashes" not in bad.text   # vLLM's error, passed on


def test_round_robin_and_least_load_policies(render_sidecar: Any,
                                             coordinator_factory: CoordinatorFactory) -> None:
    with sims(2, decode_s_per_token=0.002) as engines:
        rr = coordinator_factory(render_sidecar.url, [e.url for e in engines], scheduling={"policy": "round_robin"})
        order = [route(rr, convo("same", 0)) for _ in range(4)]
        assert order[0] != order[1] and order[0::2] == [order[0]] * 2
        ll = coordinator_factory(render_sidecar.url, [e.url for e in engines], scheduling={"policy": "least_load"})
        engines[1].set_faults(hang=True, calls=1)
        holder = hold(ll, engines[0], 2)                 # lands on one of them and hangs there
        busy = next(e for e in ll.components.registry.engines if e.inflight_requests)
        for e in engines:
            e.clear_faults()
        assert all(route(ll, convo(f"c{i}", 0)) != busy.url for i in range(3))
        holder.join(10)


def test_custom_profile_from_config(render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    with sims(2) as engines:
        coord = coordinator_factory(render_sidecar.url, [e.url for e in engines],
                                    scheduling={"policy": "custom", "picker": "random",
                                                "scorers": [{"name": "queue", "weight": 1}]})
        profile = coord.components.scheduler.profile
        assert profile.picker.name == "random" and [s.name for s, _ in profile.scorers] == ["queue"]
        assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30).status_code == 200


# --------------------------------------------------------------------------- retries and breakers

def test_unreachable_engine_is_retried_elsewhere_before_the_first_byte(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    with sims(2) as (gone, sim):
        coord = coordinator_factory(render_sidecar.url, [gone.url, sim.url], scheduling={"policy": "round_robin"},
                                    engine_client={"health_interval_s": 60})
        gone.stop()                                      # healthy at the last probe, unreachable now
        for stream in (False, True, False, True):
            r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(stream=stream), timeout=30)
            assert r.status_code == 200
        assert sample(coord, "coordinator_retries_total") >= 1
        assert sim.state()["completed"] == 4
        assert released(coord)


def test_breaker_opens_after_failures_and_a_half_open_trial_closes_it(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    with sims(2) as (flaky, steady):
        coord = coordinator_factory(render_sidecar.url, [flaky.url, steady.url],
                                    scheduling={"policy": "round_robin"},
                                    resilience={"breaker_failures": 2, "breaker_cooldown_s": 0.5})
        flaky.set_faults(fail_next=100, fail_status=500)
        for _ in range(6):
            assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30).status_code == 200
        engine = coord.components.registry.get(flaky.url)
        assert engine is not None and engine.breaker.state == "open"
        assert sample(coord, "coordinator_breaker_state", engine=flaky.url) == 2
        attempts = flaky.state()["requests_total"]
        for _ in range(4):                               # open: the flaky engine gets nothing
            httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30)
        assert flaky.state()["requests_total"] == attempts
        flaky.clear_faults()
        time.sleep(0.6)                                  # cooldown → half-open
        for _ in range(4):
            assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30).status_code == 200
        assert engine.breaker.state == "closed"
        assert flaky.state()["completed"] >= 1


def test_mid_stream_failure_is_relayed_once_per_engine(render_sidecar: Any,
                                                      coordinator_factory: CoordinatorFactory) -> None:
    """A relay never goes back to an engine the stream failed on: with every engine failing, the
    stream ends with an error after each was tried once (tests/integration/test_relay_sim.py has the
    successful relays)."""
    with sims(2) as (a, b):
        coord = coordinator_factory(render_sidecar.url, [a.url, b.url])
        a.set_faults(drop_after_tokens=3)
        b.set_faults(drop_after_tokens=3)
        events = sse_events(httpx.post(f"{coord.url}/v1/chat/completions", json=chat(stream=True), timeout=30))
        assert "error" in events[-2] and events[-1] == "[DONE]"
        assert a.state()["requests_total"] == b.state()["requests_total"] == 1
        assert sample(coord, "coordinator_retries_total") == 0
        assert sample(coord, "coordinator_relays_total") == 1


# --------------------------------------------------------------------------- P/D handoff

@pytest.fixture
def pd() -> Iterator[tuple[SimulatedEngine, SimulatedEngine, SimulatedEngine]]:
    with (SimulatedEngine(SimConfig(model=SERVED, kv_role="prefill", engine_id="p0")) as p,
          SimulatedEngine(SimConfig(model=SERVED, kv_role="decode", engine_id="d0")) as d,
          SimulatedEngine(SimConfig(model=SERVED)) as u):
        yield p, d, u


def pd_coord(factory: CoordinatorFactory, render: Any, p: SimulatedEngine, d: SimulatedEngine,
             **topology: Any) -> CoordinatorServer:
    return factory(render.url, [], engines=[{"url": p.url, "role": "prefill"}, {"url": d.url, "role": "decode"}],
                   topology={"pd_min_uncached_tokens": 0, **topology})


@pytest.mark.parametrize("stream", [False, True])
def test_handoff_matches_union_and_passes_kv_transfer_params(render_sidecar: Any, coordinator_factory: CoordinatorFactory,
                                                             pd: Any, stream: bool) -> None:
    p, d, u = pd
    coord = pd_coord(coordinator_factory, render_sidecar, p, d)
    union = coordinator_factory(render_sidecar.url, [u.url])
    body = chat(stream=stream, seed=7, temperature=0)
    got = httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=30)
    want = httpx.post(f"{union.url}/v1/chat/completions", json=body, timeout=30)
    if stream:
        assert streamed_text(sse_events(got)) == streamed_text(sse_events(want))
    else:
        assert got.json()["choices"] == want.json()["choices"]
    pre, dec = p.state()["history"][-1], d.state()["history"][-1]
    assert pre["sampling_params"]["max_tokens"] == 1 and pre["stream"] is False
    assert pre["kv_transfer_params"]["do_remote_decode"] is True
    assert dec["kv_transfer_params"]["remote_engine_id"] == "p0"
    assert dec["kv_transfer_params"]["do_remote_prefill"] is True
    assert sample(coord, "coordinator_pd_decisions_total", path="handoff") == 1
    assert wait_until(lambda: released(coord))


def test_conditional_pd_skips_prefill_for_short_uncached_prompts(render_sidecar: Any,
                                                                coordinator_factory: CoordinatorFactory,
                                                                pd: Any) -> None:
    p, d, _ = pd
    coord = pd_coord(coordinator_factory, render_sidecar, p, d, pd_min_uncached_tokens=10_000)
    assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30).status_code == 200
    assert p.state()["requests_total"] == 0 and d.state()["completed"] == 1
    assert sample(coord, "coordinator_pd_decisions_total", path="decode_only") == 1


def test_failed_decode_reruns_prefill_never_reuses_stale_params(render_sidecar: Any,
                                                                coordinator_factory: CoordinatorFactory) -> None:
    with (SimulatedEngine(SimConfig(model=SERVED, kv_role="prefill", engine_id="p0")) as p,
          SimulatedEngine(SimConfig(model=SERVED, kv_role="decode", engine_id="d0")) as d0,
          SimulatedEngine(SimConfig(model=SERVED, kv_role="decode", engine_id="d1")) as d1):
        coord = coordinator_factory(render_sidecar.url, [],
                                    topology={"pd_min_uncached_tokens": 0, "hybrid_fallback": False},
                                    engines=[{"url": p.url, "role": "prefill"}, {"url": d0.url, "role": "decode"},
                                             {"url": d1.url, "role": "decode"}])
        d0.set_faults(fail_next=1, fail_status=500)
        d1.set_faults(fail_next=1, fail_status=500)
        r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(stream=True), timeout=30)
        assert r.status_code == 502
        prefills = [h["kv_transfer_params"] for h in p.state()["history"]]
        decodes = [h["kv_transfer_params"]["remote_request_id"] for h in
                   d0.state()["history"] + d1.state()["history"]]
        assert len(prefills) == 2 and len(decodes) == 2 and len(set(decodes)) == 2  # fresh params per attempt
        assert wait_until(lambda: released(coord))


def hybrid_coord(factory: CoordinatorFactory, render: Any, p: SimulatedEngine, d: SimulatedEngine,
                 u: SimulatedEngine, **resilience: Any) -> CoordinatorServer:
    return factory(render.url, [], topology={"pd_min_uncached_tokens": 0},
                   resilience={"breaker_failures": 1, "breaker_cooldown_s": 600, **resilience},
                   engines=[{"url": p.url, "role": "prefill"}, {"url": d.url, "role": "decode"},
                            {"url": u.url, "role": "union"}])


@pytest.mark.parametrize("stream", [False, True])
def test_with_both_pd_breakers_open_a_union_engine_serves(render_sidecar: Any, coordinator_factory: CoordinatorFactory,
                                                          pd: Any, stream: bool) -> None:
    p, d, u = pd
    coord = hybrid_coord(coordinator_factory, render_sidecar, p, d, u)
    body = chat(stream=stream, temperature=0)
    want = httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=30)   # the pair serves it
    assert p.state()["requests_total"] == 1 and u.state()["requests_total"] == 0
    for engine in coord.components.registry.engines:
        if engine.role != "union":
            engine.breaker.record_failure()                 # breaker_failures 1: open for 600 s
    got = httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=30)
    assert got.status_code == 200, got.text
    if stream:
        assert streamed_text(sse_events(got)) == streamed_text(sse_events(want))
    else:
        assert got.json()["choices"] == want.json()["choices"]
    assert u.state()["requests_total"] == 1 and p.state()["requests_total"] == 1
    assert sample(coord, "coordinator_pd_decisions_total", path="fallback_union") == 1
    assert wait_until(lambda: released(coord))


@pytest.mark.parametrize("stream", [False, True])
def test_a_pd_request_failing_before_the_first_byte_restarts_on_the_fallback(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory, pd: Any, stream: bool) -> None:
    """The decode engine fails: the retry finds no routable pair (the only decode engine failed it) and
    runs on the union engine; the next request goes there at once (the decode breaker is open)."""
    p, d, u = pd
    coord = hybrid_coord(coordinator_factory, render_sidecar, p, d, u)
    d.set_faults(fail_next=1, fail_status=500)
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=chat(stream=stream), timeout=30)
    assert r.status_code == 200 and (not stream or sse_events(r)[-1] == "[DONE]")
    assert d.state()["generate_calls"] == 1 and u.state()["requests_total"] == 1
    assert sample(coord, "coordinator_retries_total") == 1
    assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30).status_code == 200
    assert u.state()["requests_total"] == 2 and d.state()["generate_calls"] == 1
    assert sample(coord, "coordinator_pd_decisions_total", path="fallback_union") == 2
    assert wait_until(lambda: released(coord))


def test_a_pd_stream_failing_mid_way_continues_on_the_fallback_by_relay(
        render_sidecar: Any, coordinator_factory: CoordinatorFactory) -> None:
    """Output is a function of the context (simulator ``mode: context``), so a relayed stream must read
    exactly like an unbroken one."""
    with (SimulatedEngine(SimConfig(model=SERVED, kv_role="prefill", engine_id="p0", mode="context")) as p,
          SimulatedEngine(SimConfig(model=SERVED, kv_role="decode", engine_id="d0", mode="context")) as d,
          SimulatedEngine(SimConfig(model=SERVED, mode="context")) as u):
        coord = hybrid_coord(coordinator_factory, render_sidecar, p, d, u)
        body = chat(stream=True, max_tokens=24)
        want = streamed_text(sse_events(httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=30)))
        d.set_faults(drop_after_tokens=6)
        events = sse_events(httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=30))
        assert events[-1] == "[DONE]" and "error" not in events[-2]
        assert streamed_text(events) == want
        assert u.state()["requests_total"] == 1 and sample(coord, "coordinator_relays_total") == 1
        assert sample(coord, "coordinator_pd_decisions_total", path="fallback_union") == 1
        assert wait_until(lambda: released(coord))


def test_client_leaving_after_prefill_releases_the_prefill_kv(render_sidecar: Any,
                                                              coordinator_factory: CoordinatorFactory) -> None:
    """The decode leg waits in a busy decode engine when the client gives up: the coordinator aborts it
    there, and the decode side tells the prefill engine to free the blocks it pinned for the transfer
    (vLLM's behaviour; aborting the finished prefill itself would free nothing)."""
    with (SimulatedEngine(SimConfig(model=SERVED, kv_role="prefill", engine_id="p0",
                                    advertise_peer_url=True)) as p,
          SimulatedEngine(SimConfig(model=SERVED, kv_role="decode", engine_id="d0", max_concurrency=1,
                                    decode_s_per_token=0.01)) as d):
        coord = pd_coord(coordinator_factory, render_sidecar, p, d)
        in_background(httpx.post, f"{d.url}/inference/v1/generate", timeout=30, json={
            "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1000}})
        assert wait_until(lambda: len(d.state()["running"]) == 1)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{coord.url}/v1/chat/completions", json=chat(stream=True), timeout=1.0)
        assert wait_until(lambda: p.state()["pinned_transfers"] == [])
        assert p.state()["kv_transfer_released"].get("consumed") == 1   # freed by the decode side, not the lease
        assert len(p.state()["history"]) == 1 and d.state()["completed"] == 0
        assert wait_until(lambda: released(coord))


# --------------------------------------------------------------------------- metrics

def test_metrics_expose_the_scheduling_series_and_can_be_switched_off(
        render_sidecar: Any, two: list[SimulatedEngine], coordinator_factory: CoordinatorFactory) -> None:
    coord = coordinator_factory(render_sidecar.url, [e.url for e in two])
    assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30).status_code == 200
    text = httpx.get(f"{coord.url}/metrics").text
    for series in ("coordinator_queue_length 0.0", "coordinator_queue_wait_seconds_count 1.0",
                   "coordinator_admitted_total 1.0", "coordinator_prefix_hit_ratio",
                   f'coordinator_engine_inflight_tokens{{engine="{two[0].url}"}} 0.0',
                   f'coordinator_breaker_state{{engine="{two[1].url}"}} 0.0',
                   f'coordinator_engine_state{{engine="{two[0].url}",state="healthy"}} 1.0',
                   'coordinator_scheduling_decisions_total{engine="', 'policy="affinity"'):
        assert series in text, series
    off = coordinator_factory(render_sidecar.url, [two[0].url], server={"metrics": False})
    assert httpx.get(f"{off.url}/metrics").status_code == 404


def test_admin_api_drains_and_replaces_engines(render_sidecar: Any, two: list[SimulatedEngine],
                                               coordinator_factory: CoordinatorFactory) -> None:
    a, b = two
    coord = coordinator_factory(render_sidecar.url, [a.url, b.url], scheduling={"policy": "round_robin"})
    r = httpx.post(f"{coord.url}/admin/engines/drain", params={"url": a.url})
    assert r.status_code == 200 and r.json()["state"] == "draining"
    for _ in range(3):
        assert httpx.post(f"{coord.url}/v1/chat/completions", json=chat(), timeout=30).status_code == 200
    assert a.state()["requests_total"] == 0 and b.state()["completed"] == 3
    assert httpx.post(f"{coord.url}/admin/engines/undrain", params={"url": a.url}).json()["state"] == "healthy"
    listed = httpx.get(f"{coord.url}/admin/engines").json()["engines"]
    assert {e["url"]: e["state"] for e in listed} == {a.url: "healthy", b.url: "healthy"}
    r = httpx.put(f"{coord.url}/admin/engines", json=[{"url": b.url}])
    assert r.status_code == 200 and [e["url"] for e in r.json()["engines"]] == [b.url]
    bad = httpx.put(f"{coord.url}/admin/engines", json=[{"url": b.url, "role": "chef"}])
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
    # P/D protocols: a mixed pool is refused as at start-up, and trigger engines need the metaserver,
    # which this coordinator (started without any) does not run; the engine set is left as it was.
    mixed = [{"url": a.url, "role": "prefill", "pd_protocol": "trigger"}, {"url": b.url, "role": "decode"}]
    r = httpx.put(f"{coord.url}/admin/engines", json=mixed)
    assert r.status_code == 400 and "mixes handoff and trigger" in r.json()["error"]["message"]
    trigger = [{**e, "pd_protocol": "trigger"} for e in mixed]
    r = httpx.put(f"{coord.url}/admin/engines", json=trigger)
    assert r.status_code == 400 and "metaserver" in r.json()["error"]["message"]
    assert [e["url"] for e in httpx.get(f"{coord.url}/admin/engines").json()["engines"]] == [b.url]
    assert httpx.post(f"{coord.url}/admin/engines/drain", params={"url": "http://nowhere:1"}).status_code == 404
