"""Images on the token path, on real vLLM: render → ``/inference/v1/generate`` with ``features`` →
derender, side by side with the same engine's own ``/v1/chat/completions``.

The model is the tiny SmolVLM-style Idefics3 ``token_engine.vision_prep`` builds (SmolLM2 with a
random vision tower: gibberish answers, but deterministic and different for different images). Its
placeholders hold non-embedding tokens, the case vLLM 0.32's generate path gets wrong without the
sidecar's narrowing (``render_sidecar/mm_placeholders.py``). A vision engine must load its tokenizer
(vLLM's multimodal processor needs it), so it runs ``--enable-scale-out``: that one process is both
the coordinator's engine and the native reference. It publishes its KV events, which shows that the
sidecar's media-aware block hashes are the engine's own blocks.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from coordinator.pipeline.scheduling.prefix.index import PrefixIndex
from coordinator.pipeline.scheduling.prefix.source import PreciseIndexSource
from tests.conftest import MAX_MODEL_LEN, SERVED, VISION, VISION_MM_LIMIT, CoordinatorFactory, _echo, _ready
from tests.support import free_port, reserved_port, sse_events, streamed_text

pytestmark = pytest.mark.e2e

BS = 16


@dataclass
class VisionStack:
    render: Any
    engine: Any        # --enable-scale-out: the coordinator's engine and the native reference
    kv_events: str     # its ZMQ publisher
    encoder: Any       # an encode-only engine (EPD) writing into ``store``, which ``engine`` reads
    store: Path


@pytest.fixture(scope="module")
def vision(vision_render: Any, logs_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VisionStack]:
    """The answering engine is an EC consumer: an image the store lacks it encodes itself, so it also
    serves every test that has no encode engine."""
    from token_engine.launch import VllmEngine, ec_store_config
    from token_engine.vision_prep import ensure_vision_model

    port = reserved_port()
    store = tmp_path_factory.mktemp("ec-store")
    model = ensure_vision_model()
    engine = VllmEngine(model, port=free_port(), served_model_name=VISION, mode="scale-out",
                        max_model_len=MAX_MODEL_LEN, log_path=logs_dir / "vision-engine.log", echo=_echo(),
                        extra_args=VISION_MM_LIMIT, name="vision-engine",
                        ec_transfer_config=ec_store_config("ec_consumer", store),
                        kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                          "endpoint": f"tcp://*:{port}", "topic": "kv"})
    encoder = VllmEngine(model, port=free_port(), served_model_name=VISION, mode="scale-out",
                         max_model_len=MAX_MODEL_LEN, log_path=logs_dir / "vision-encoder.log", echo=_echo(),
                         extra_args=VISION_MM_LIMIT, name="vision-encoder",
                         ec_transfer_config=ec_store_config("ec_producer", store))
    try:
        engine.start()
        encoder.start()
        _ready(engine)
        _ready(encoder)
        yield VisionStack(vision_render, engine, f"tcp://127.0.0.1:{port}", encoder, store)
    finally:
        encoder.stop()
        engine.stop()


def png(color: str, size: tuple[int, int] = (64, 48)) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(*images: str, text: str = "What is in this picture?", **extra: Any) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return {"model": VISION, "messages": [{"role": "user", "content": parts}], "max_tokens": 16,
            "temperature": 0, **extra}


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=180)


def answer(url: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    r = post(url, body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.json()["usage"]


@pytest.fixture
def coordinator(vision: VisionStack, coordinator_factory: CoordinatorFactory) -> Any:
    return coordinator_factory(str(vision.render.url), [vision.engine.url], models=[{"name": VISION}],
                               engine_client={"health_interval_s": 0.5})


def test_images_answer_as_native_does(vision: VisionStack, coordinator: Any) -> None:
    """One image and two, streamed and not: the same text and the same usage as the engine's own chat
    route; different images give different answers, so the image reached the model."""
    native = vision.engine.url
    seen = set()
    for images in ([png("red")], [png("blue")], [png("green"), png("orange", (96, 64))]):
        body = chat(*images)
        expected, usage = answer(native, body)
        text, ours = answer(coordinator.url, body)
        assert text == expected, images
        assert ours["prompt_tokens"] == usage["prompt_tokens"] and ours["completion_tokens"] == usage["completion_tokens"]
        r = post(coordinator.url, {**body, "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text
        events = sse_events(r)
        assert streamed_text(events)[0] == expected
        assert [e for e in events if isinstance(e, dict) and e.get("usage")][-1]["usage"]["prompt_tokens"] == \
            usage["prompt_tokens"]
        seen.add(expected)
    assert len(seen) == 3, "different images gave the same answer: the image never reached the model"
    assert httpx.get(f"{native}/health", timeout=10).status_code == 200


def test_the_openai_sdk_sends_an_image_unmodified(vision: VisionStack, coordinator: Any) -> None:
    """The OpenAI Python SDK sending a data-URL image, streamed and not, parses our answers."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{coordinator.url}/v1", api_key="none", max_retries=0)
    image = png("purple")
    expected, usage = answer(vision.engine.url, chat(image))
    messages: Any = chat(image)["messages"]
    got = client.chat.completions.create(model=VISION, messages=messages, max_tokens=16, temperature=0)
    assert got.choices[0].message.content == expected
    assert got.usage is not None and got.usage.prompt_tokens == usage["prompt_tokens"]
    stream = client.chat.completions.create(model=VISION, messages=messages, max_tokens=16, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_langchain_sends_an_image_unmodified(vision: VisionStack, coordinator: Any) -> None:
    """LangChain's ``ChatOpenAI`` (from the tool venv, as users run it) with an image content part,
    invoked and streamed: the engine's own answer both ways."""
    from tests.compat.conftest import DRIVERS, compat_bin, offline_env, run_tool, tail

    image = png("teal")
    expected, usage = answer(vision.engine.url, chat(image))
    proc = run_tool([compat_bin("python"), DRIVERS / "langchain_images_client.py", f"{coordinator.url}/v1",
                     VISION, image], timeout=300, env=offline_env())
    assert proc.returncode == 0, tail(proc)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["invoke"] == expected and out["stream_text"] == expected and out["stream_chunks"] > 1
    assert out["invoke_usage"]["input_tokens"] == usage["prompt_tokens"]


def test_messages_and_responses_carry_images(vision: VisionStack, coordinator: Any) -> None:
    """An Anthropic Messages ``image`` block and a Responses ``input_image``, through the coordinator:
    the same text as the engine's own /v1/messages and /v1/responses give."""
    image = png("maroon")
    messages = {"model": VISION, "max_tokens": 16, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": image.split(",", 1)[1]}}]}]}
    responses = {"model": VISION, "max_output_tokens": 16, "temperature": 0, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is in this picture?"}, {"type": "input_image", "image_url": image}]}]}

    def text(url: str, path: str, body: dict[str, Any]) -> str:
        r = httpx.post(f"{url}{path}", json=body, timeout=180)
        assert r.status_code == 200, (url, path, r.text)
        doc = r.json()
        if path == "/v1/messages":
            return "".join(b.get("text", "") for b in doc["content"])
        return "".join(c.get("text", "") for item in doc["output"] for c in item.get("content") or ())

    for path, body in (("/v1/messages", messages), ("/v1/responses", responses)):
        expected = text(vision.engine.url, path, body)
        assert expected and text(coordinator.url, path, body) == expected, path


class _Slow(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        time.sleep(6)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def slow_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/cat.png"
    finally:
        server.shutdown()


class _Image(BaseHTTPRequestHandler):
    body = b""
    fetched = 0

    def do_GET(self) -> None:
        type(self).fetched += 1
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


def test_an_http_image_is_downloaded_by_render_and_answered_as_its_data_url(
        vision: VisionStack, coordinator_factory: CoordinatorFactory) -> None:
    """An https/http image URL (here a loopback server, allowed by ``media.allow_private_urls``):
    render downloads it once and the answer is the one the same bytes give as a data URL."""
    data_url = png("salmon")
    _Image.body = base64.b64decode(data_url.split(",", 1)[1])
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Image)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        coord = coordinator_factory(str(vision.render.url), [vision.engine.url], models=[{"name": VISION}],
                                    media={"allow_private_urls": True})
        text, usage = answer(coord.url, chat(f"http://127.0.0.1:{server.server_address[1]}/salmon.png"))
        assert _Image.fetched == 1
        expected, native = answer(vision.engine.url, chat(data_url))
        assert text == expected and usage["prompt_tokens"] == native["prompt_tokens"]
    finally:
        server.shutdown()


class _CutStream(BaseHTTPRequestHandler):
    """In front of a real engine: passes every call through, but ends the first generate stream after
    ``cut_after`` chunks with no ``[DONE]`` (an engine lost mid-stream, as the coordinator sees it)."""

    protocol_version = "HTTP/1.0"  # a body that ends where the connection does
    upstream = ""
    cut_after = 5
    cuts = 0

    def _forward(self, method: str) -> None:
        size = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(size) if size else None
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "x-request-id")}
        cut = self.path == "/inference/v1/generate" and type(self).cuts == 0 and b'"stream":true' in (body or b"")
        with httpx.stream(method, f"{self.upstream}{self.path}", content=body, headers=headers,
                          timeout=120) as r:
            self.send_response(r.status_code)
            self.send_header("Content-Type", r.headers.get("content-type", "application/json"))
            self.end_headers()
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: {")
                if cut and chunks > self.cut_after:
                    type(self).cuts += 1
                    return
                self.wfile.write(f"{line}\n".encode())
                self.wfile.flush()

    def do_GET(self) -> None:
        self._forward("GET")

    def do_POST(self) -> None:
        self._forward("POST")

    def log_message(self, *args: Any) -> None:
        pass


def test_a_stream_cut_mid_way_is_relayed_with_its_images(
        vision: VisionStack, coordinator_factory: CoordinatorFactory) -> None:
    """The engine's stream ends after a few chunks: the coordinator replays the prompt, its images and
    what was already streamed on the next engine (here the same engine by its own address), and the
    client gets one stream with the text and usage of an unbroken one."""
    _CutStream.upstream, _CutStream.cuts = vision.engine.url, 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _CutStream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cut = f"http://127.0.0.1:{server.server_address[1]}"
        coord = coordinator_factory(str(vision.render.url), [], models=[{"name": VISION}],
                                    engines=[{"url": cut}, {"url": vision.engine.url}],
                                    scheduling={"policy": "round_robin"})  # the first attempt: the cut one
        body = chat(png("olive"), png("plum", (96, 64)), max_tokens=24)
        expected, usage = answer(vision.engine.url, body)
        r = post(coord.url, {**body, "stream": True, "stream_options": {"include_usage": True}})
        events = sse_events(r)
        assert _CutStream.cuts == 1 and coord.components.metrics.relays._value.get() == 1
        assert not any(isinstance(e, dict) and "error" in e for e in events) and events[-1] == "[DONE]"
        assert streamed_text(events)[0] == expected
        final = [e for e in events if isinstance(e, dict) and e.get("usage")][-1]["usage"]
        assert final["prompt_tokens"] == usage["prompt_tokens"]
        assert final["completion_tokens"] == usage["completion_tokens"]
    finally:
        server.shutdown()


def test_bad_images_are_400s_naming_the_field_and_the_engine_lives(
        vision: VisionStack, coordinator: Any, coordinator_factory: CoordinatorFactory, slow_url: str,
        vllm_stack: Any) -> None:
    corrupt = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot really a png").decode()
    cases = {
        "not an image": (chat("data:text/plain;base64,aGVsbG8="), "text/plain"),
        "corrupt": (chat(corrupt), None),
        "too many for the model": (chat(png("red"), png("red"), png("red"), png("red")), None),
        "private address": (chat("http://127.0.0.1:9/cat.png"), "private"),
        "file scheme": (chat("file:///etc/passwd"), "scheme file:"),
    }
    for name, (body, words) in cases.items():
        r = post(coordinator.url, body)
        assert r.status_code == 400, (name, r.status_code, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        if words is not None:
            assert words in error["message"] and error["param"] == "messages[0].content[1].image_url.url", error
    # A download that outlasts render's fetch limit (2 s here), from a server allowed to be local.
    open_coord = coordinator_factory(str(vision.render.url), [vision.engine.url], models=[{"name": VISION}],
                                     media={"allow_private_urls": True})
    r = post(open_coord.url, chat(slow_url))
    assert 400 <= r.status_code < 500, r.text
    # An image for the text-only model of the session's stack: its render refuses it.
    text_coord = coordinator_factory(str(vllm_stack.render_url), [vllm_stack.engine.url])
    r = post(text_coord.url, {**chat(png("red")), "model": SERVED})
    assert r.status_code == 400, r.text
    for url in (vision.engine.url, vllm_stack.engine.url):
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    text, _ = answer(coordinator.url, chat(png("red")))
    assert text == answer(vision.engine.url, chat(png("red")))[0]


async def test_the_engines_kv_blocks_are_the_sidecars_media_hashes(vision: VisionStack) -> None:
    """The render-side hashes of a prompt with an image, mirrored from the engine's own KV events:
    the same image matches every block the engine stored, another image with the same text only the
    blocks before it."""
    index = PrefixIndex()
    source = PreciseIndexSource(index, lambda url: VISION, BS, topic="kv")
    long_text = " ".join(f"word{i}" for i in range(150))
    render = str(vision.render.url)
    try:
        sub = await source.attach(vision.engine.url, vision.kv_events)
        async with httpx.AsyncClient(timeout=180) as client:
            async def rendered(color: str) -> dict[str, Any]:
                body = {"model": VISION, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": [
                    {"type": "text", "text": long_text}, {"type": "image_url", "image_url": {"url": png(color)}},
                    {"type": "text", "text": long_text}]}]}
                r = await client.post(f"{render}/v1/chat/completions/render", json=body,
                                      headers={"x-prefix-hash": f"{BS} {VISION}"})
                assert r.status_code == 200, r.text
                return dict(r.json())

            for _ in range(10):  # ZMQ's slow joiner: until one batch arrives
                first = await rendered("navy")
                hashes = first.pop("block_hashes")
                r = await client.post(f"{vision.engine.url}/inference/v1/generate", json=first)
                assert r.status_code == 200, r.text
                if await _until(lambda: sub.mirror.stats.batches > 0, 2.0):
                    break
            placeholder = first["features"]["mm_placeholders"]["image"][0]
            stored = len(first["token_ids"]) // 128 * 128 // BS  # the CPU engine keeps 128-token blocks
            assert await _until(lambda: index.match(hashes).get(vision.engine.url) == stored, 10.0), \
                (index.match(hashes), stored)
            other = (await rendered("olive"))["block_hashes"]
            assert index.match(other) == {vision.engine.url: placeholder["offset"] // BS}
            assert sub.mirror.stats.unhashable_blocks == 0
    finally:
        await source.stop_all()


async def _until(cond: Any, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.05)
    return bool(cond())


def _served(engine: Any) -> float:
    """Requests an engine finished (its /metrics)."""
    text = httpx.get(f"{engine.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def _image_hashes(vision: VisionStack, body: dict[str, Any]) -> list[str]:
    r = httpx.post(f"{vision.render.url}/v1/chat/completions/render", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return list(r.json()["features"]["mm_hashes"]["image"])


def test_an_encode_engine_encodes_the_images_once_and_the_answer_stays_native(
        vision: VisionStack, coordinator_factory: CoordinatorFactory) -> None:
    """EPD on real vLLM (ECExampleConnector): the encode engine encodes a prompt's images once into
    the store, the answering engine reads them from there, and the text is the one the answering
    engine gives when it encodes them itself; with the encode engine gone, requests are still answered."""
    coord = coordinator_factory(str(vision.render.url), [], models=[{"name": VISION}],
                                engines=[{"url": vision.encoder.url, "role": "encode"}, {"url": vision.engine.url}],
                                engine_client={"health_interval_s": 0.5})
    body = chat(png("coral"), png("khaki", (96, 64)))
    # The reference first, salted so that no later prompt hits its KV: the store has no such image yet,
    # so the engine encodes them itself.
    expected, usage = answer(vision.engine.url, {**body, "cache_salt": "reference"})
    encoded_before = _served(vision.encoder)
    text, ours = answer(coord.url, body)
    assert text == expected and ours["prompt_tokens"] == usage["prompt_tokens"]
    r = post(coord.url, {**body, "stream": True})
    assert streamed_text(sse_events(r))[0] == expected
    # One encode for both requests (the second found its images encoded), into the store by hash.
    assert _served(vision.encoder) - encoded_before == 1
    hashes = _image_hashes(vision, body)
    assert all((vision.store / h / "encoder_cache.safetensors").exists() for h in hashes)

    # The answering engine really reads the store: an image it never saw, whose entry holds the
    # coral image's embedding, is answered as the coral one is.
    coral, _ = answer(coord.url, chat(png("coral")))
    [lime] = _image_hashes(vision, chat(png("lime")))
    (vision.store / lime).mkdir()
    (vision.store / lime / "encoder_cache.safetensors").write_bytes(
        (vision.store / hashes[0] / "encoder_cache.safetensors").read_bytes())
    assert answer(vision.engine.url, {**chat(png("lime")), "cache_salt": "swap"})[0] == coral

    # No encode engine reachable: the answering engine encodes, the answer is the same.
    gone = coordinator_factory(str(vision.render.url), [], models=[{"name": VISION}],
                               engines=[{"url": f"http://127.0.0.1:{free_port()}", "role": "encode"},
                                        {"url": vision.engine.url}])
    body = chat(png("indigo"))
    expected, _ = answer(vision.engine.url, {**body, "cache_salt": "reference"})
    assert answer(gone.url, body)[0] == expected
    assert not (vision.store / _image_hashes(vision, body)[0] / "encoder_cache.safetensors").exists()
