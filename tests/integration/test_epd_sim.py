"""Encoder disaggregation (EPD) on simulated engines behind the real vision render sidecar: an encode
engine (``ec_producer``) and an answering engine (``ec_consumer``) share an ECExampleConnector store.

What a user sees: a prompt with an image is encoded once on the encode engine and the answering engine
takes the embedding from the store (it spends no encoder time); an image encoded a moment ago is not
sent to the encoder again; text goes straight to the answering engine; and when the encode engine is
down, slow or failing, the request is still answered: the answering engine encodes (the hybrid rule).
tests/e2e/test_images_real.py runs the same on real vLLM engines.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import VISION, CoordinatorFactory
from tests.support import sse_events, streamed_text
from token_engine.simulator import SimConfig, SimulatedEngine

ENCODE_S = 0.01  # per image token: a 19-token image costs the engine that encodes it 0.19 s


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "ec"


@pytest.fixture
def engines(store: Path) -> Iterator[tuple[SimulatedEngine, SimulatedEngine]]:
    cfg = {"model": VISION, "vocab_size": 49156, "encode_s_per_image_token": ENCODE_S,
           "ec_storage_path": str(store)}
    with SimulatedEngine(SimConfig(ec_role="ec_producer", **cfg)) as enc, \
            SimulatedEngine(SimConfig(ec_role="ec_consumer", **cfg)) as union:
        yield enc, union


def png(color: str) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 40), color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(*images: str, text: str = "What is in this picture?", **extra: Any) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return {"model": VISION, "messages": [{"role": "user", "content": parts}], "max_tokens": 4,
            "temperature": 0, **extra}


def ask(coord: Any, body: dict[str, Any]) -> str:
    """The answer's text, streamed or not."""
    r = httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        return streamed_text(sse_events(r))[0]
    return str(r.json()["choices"][0]["message"]["content"])


def legs(coord: Any) -> dict[str, float]:
    text = httpx.get(f"{coord.url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("coordinator_encode_legs_total{"):
            outcome = line.split('outcome="')[1].split('"')[0]
            out[outcome] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture
def coord(vision_render: Any, engines: tuple[SimulatedEngine, SimulatedEngine],
          coordinator_factory: CoordinatorFactory) -> Any:
    enc, union = engines
    return coordinator_factory(str(vision_render.url), [], models=[{"name": VISION}],
                               engines=[{"url": enc.url, "role": "encode"}, {"url": union.url}],
                               engine_client={"health_interval_s": 0.2},
                               resilience={"breaker_failures": 2},
                               topology={"encode": {"timeout_s": 1.0}})


def test_images_are_encoded_once_on_the_encode_engine(coord: Any, engines: tuple[SimulatedEngine, SimulatedEngine],
                                                      store: Path) -> None:
    enc, union = engines
    ask(coord, chat(png("red"), png("blue"), stream=True))
    [e] = enc.state()["history"]
    [u] = union.state()["history"]
    assert e["sampling_params"]["max_tokens"] == 1 and not e["stream"]
    assert len(e["media"]) == 2 and u["media"] == e["media"]
    # The answering engine got the encoder's ec_transfer_params, and the store holds both embeddings.
    assert set(u["ec_transfer_params"]) == set(e["media"])
    assert all((store / h / "encoder_cache.safetensors").exists() for h in e["media"])
    assert legs(coord) == {"encoded": 1.0}

    # The same image again (another question): the store has it, the encode engine is not asked.
    ask(coord, chat(png("red"), text="And its colour?"))
    assert len(enc.state()["history"]) == 1 and len(union.state()["history"]) == 2
    # Text alone never goes to the encode engine.
    ask(coord, chat())
    assert len(enc.state()["history"]) == 1
    assert legs(coord) == {"encoded": 1.0, "reused": 1.0}


def test_the_answering_engine_encodes_when_the_encode_engine_fails(
        coord: Any, engines: tuple[SimulatedEngine, SimulatedEngine], store: Path) -> None:
    enc, union = engines
    enc.set_faults(fail_next=1, fail_status=500)
    assert ask(coord, chat(png("green")))
    assert not union.state()["history"][-1]["ec_transfer_params"]
    assert not any(store.glob("*/encoder_cache.safetensors"))
    enc.clear_faults()
    enc.set_faults(hang=True)                      # slower than topology.encode.timeout_s
    ask(coord, chat(png("yellow"), stream=True))
    assert legs(coord) == {"fallback": 2.0}
    # Both misses count against the encoder (resilience.breaker_failures 2 here): its breaker opens,
    # and the next image request does not wait for it at all.
    assert coord.components.registry.get(enc.url).breaker.state == "open"
    enc.clear_faults()
    enc.stop()                                     # gone: probes take it out, nothing waits for it
    for color in ("purple", "teal"):
        ask(coord, chat(png(color)))
    assert legs(coord)["fallback"] == 4.0
    assert union.state()["errored"] == 0


def test_a_stream_relayed_after_its_engine_failed_keeps_its_images(
        vision_render: Any, store: Path, coordinator_factory: CoordinatorFactory) -> None:
    """An answering engine that drops the stream mid-way: the next engine gets the replay with the
    same images (and their encoder entries, not re-encoded), and the client sees one unbroken stream."""
    cfg = {"model": VISION, "vocab_size": 49156, "mode": "context", "decode_s_per_token": 0.003,
           "encode_s_per_image_token": ENCODE_S, "ec_storage_path": str(store)}
    with SimulatedEngine(SimConfig(ec_role="ec_producer", **cfg)) as enc, \
            SimulatedEngine(SimConfig(ec_role="ec_consumer", **cfg)) as a, \
            SimulatedEngine(SimConfig(ec_role="ec_consumer", **cfg)) as b:
        coord = coordinator_factory(str(vision_render.url), [], models=[{"name": VISION}],
                                    engines=[{"url": enc.url, "role": "encode"}, {"url": a.url}, {"url": b.url}])
        body = chat(png("navy"), max_tokens=24, stream=True)
        baseline = ask(coord, body)
        victim, other = (a, b) if a.state()["generate_calls"] else (b, a)
        victim.set_faults(calls=1, drop_after_tokens=6)
        assert ask(coord, body) == baseline          # prefix affinity sends it to the victim first
        assert coord.components.metrics.relays._value.get() == 1
        [first] = victim.state()["history"][-1:]
        [replay] = other.state()["history"]
        assert replay["media"] == first["media"] and len(replay["media"]) == 1
        assert replay["prompt_tokens"] > first["prompt_tokens"]   # the prompt plus what was streamed
        assert len(enc.state()["history"]) == 1                    # encoded once, for the baseline


def test_with_prefill_and_decode_engines_the_prefill_leg_reads_the_store(
        vision_render: Any, store: Path, coordinator_factory: CoordinatorFactory) -> None:
    """E + P + D: the encoder's ``ec_transfer_params`` go with the prefill leg, the engine that runs the
    prompt's images; the decode leg continues from the prefill's KV as in any handoff."""
    cfg = {"model": VISION, "vocab_size": 49156, "encode_s_per_image_token": ENCODE_S,
           "ec_storage_path": str(store)}
    with SimulatedEngine(SimConfig(ec_role="ec_producer", **cfg)) as enc, \
            SimulatedEngine(SimConfig(ec_role="ec_consumer", kv_role="prefill", **cfg)) as pre, \
            SimulatedEngine(SimConfig(kv_role="decode", **cfg)) as dec:
        coord = coordinator_factory(str(vision_render.url), [], models=[{"name": VISION}],
                                    engines=[{"url": enc.url, "role": "encode"},
                                             {"url": pre.url, "role": "prefill"}, {"url": dec.url, "role": "decode"}],
                                    topology={"pd_min_uncached_tokens": 0})
        assert ask(coord, chat(png("maroon"), stream=True))
        [e], [p], [d] = (s.state()["history"] for s in (enc, pre, dec))
        assert p["ec_transfer_params"] == {e["media"][0]: {"item_indices": [0], "metadata": {}}}
        assert p["sampling_params"]["max_tokens"] == 1 and p["kv_transfer_params"]["do_remote_decode"]
        assert d["kv_transfer_params"]["do_remote_prefill"] and d["media"] == e["media"]
        assert legs(coord) == {"encoded": 1.0}
