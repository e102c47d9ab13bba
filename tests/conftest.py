"""Session-wide real vLLM parts (render sidecar, CPU engines) and per-test coordinators.

The render sidecar and both engines are started together the first time a test needs any of them
(they boot in parallel: about a minute or two on 2 cores) and stopped at the end of the session.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import EngineSettings, ModelSettings, Settings
from tests.support import CoordinatorServer, RedisServer, free_port, reserved_port

SERVED = "smollm2-135m-instruct"
MAX_MODEL_LEN = 2048
# The test session's stored Responses: one SQLite file for every coordinator of this process (as the
# workers of one pod share one), outside the checkout.
RESPONSE_STORE = Path(tempfile.mkdtemp(prefix="llmc-responses-")) / "responses.sqlite3"


@dataclass
class VllmStack:
    render: Any
    engine: Any          # --tokens-only: what the coordinator uses
    native: Any          # --enable-scale-out: the native OpenAI reference on the same model
    engine2: Any         # a second --tokens-only engine (routing between two real engines)
    kv_events: dict[str, str]  # engine url → ZMQ endpoint its KV events are published on

    @property
    def render_url(self) -> str:
        return str(self.render.url)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from token_engine.model_prep import ensure_model

    return ensure_model()


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


def _echo() -> bool:
    return bool(os.environ.get("LLMC_TEST_ECHO"))


def _ready(server: Any, timeout: float = 600) -> None:
    """Wait for a started vLLM server; one that dies while booting is started once more.

    Why a second try: these tests are about the coordinator, and a CPU vLLM boot can fail for reasons
    outside it (a port taken between picking and binding, memory briefly short while three engines
    load at once). The first failure, root cause included, is printed so it is never hidden; a second
    failure fails the session.
    """
    from token_engine.process import ProcessExitedError

    try:
        server.wait_ready(timeout=timeout)
    except ProcessExitedError as first:
        print(f"\n{server.name} died while booting; starting it once more. First failure:\n{first}\n",
              file=sys.stderr, flush=True)
        server.stop()
        server.start()
        server.wait_ready(timeout=timeout)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real Redis for the fleet budget's shared ledger (a fresh database per test: ``redis_url``)."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def render_sidecar(model_dir: Path, logs_dir: Path) -> Iterator[Any]:
    """The real render sidecar, shared by every test that needs render/derender."""
    yield from _render(model_dir, SERVED, logs_dir / "render.log")


def _render(model: Path, served: str, log_path: Path, **kw: Any) -> Iterator[Any]:
    """A render sidecar for a session fixture: started, ready, stopped at the end."""
    from render_sidecar.launch import RenderSidecar

    render = RenderSidecar(model, port=free_port(), served_model_name=served, max_model_len=MAX_MODEL_LEN,
                           log_path=log_path, echo=_echo(), **kw)
    try:
        render.start()
        _ready(render)
        yield render
    finally:
        render.stop()


VISION = "smolvlm-tiny"
VISION_MM_LIMIT = ["--limit-mm-per-prompt", '{"image": 3}']


@pytest.fixture(scope="session")
def vision_render(logs_dir: Path) -> Iterator[Any]:
    """Our render sidecar of the tiny vision model (``token_engine.vision_prep``), booted once for every
    image test, real engine or simulated: one image download try of 2 s, private URLs allowed (the
    tests serve a slow image from loopback)."""
    from render_sidecar.launch import media_env
    from token_engine.vision_prep import ensure_vision_model

    yield from _render(ensure_vision_model(), VISION, logs_dir / "vision-render.log", extra_args=VISION_MM_LIMIT,
                       env_overrides=media_env(2, allow_private_urls=True), name="vision-render")


@pytest.fixture(scope="session")
def vllm_stack(request: pytest.FixtureRequest, model_dir: Path, logs_dir: Path) -> Iterator[VllmStack]:
    """Render sidecar + token-only engine + native (scale-out) reference engine.

    The engines are started before the sidecar fixture is resolved so that all three boot in parallel.
    """
    from token_engine.launch import VllmEngine

    events = [reserved_port(), reserved_port()]  # ZMQ binds them on every interface

    def kv_events(port: int) -> dict[str, Any]:
        # "tcp://*:PORT": the engine binds and subscribers connect (vLLM's publisher rule).
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                "topic": "kv"}

    engine = VllmEngine(model_dir, port=free_port(), served_model_name=SERVED, mode="tokens-only",
                        max_model_len=MAX_MODEL_LEN, log_path=logs_dir / "engine.log", echo=_echo(),
                        kv_events_config=kv_events(events[0]))
    engine2 = VllmEngine(model_dir, port=free_port(), served_model_name=SERVED, mode="tokens-only",
                         max_model_len=MAX_MODEL_LEN, log_path=logs_dir / "engine2.log", echo=_echo(),
                         kv_events_config=kv_events(events[1]), name="engine2")
    # Native with its Responses store on (as the coordinator's is by default): store, previous_response_id.
    native = VllmEngine(model_dir, port=free_port(), served_model_name=SERVED, mode="scale-out",
                        max_model_len=MAX_MODEL_LEN, log_path=logs_dir / "native.log", echo=_echo(),
                        name="native", env_overrides={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    engines = [engine, engine2, native]
    try:
        for e in engines:
            e.start()
        render = request.getfixturevalue("render_sidecar")
        for e in engines:
            _ready(e)
        yield VllmStack(render, engine, native, engine2,
                        {engine.url: f"tcp://127.0.0.1:{events[0]}", engine2.url: f"tcp://127.0.0.1:{events[1]}"})
    finally:
        for e in engines:
            e.stop()


@dataclass
class ToolStack:
    render: Any   # our render sidecar with the hermes tool parser (forced tool calls need one)
    native: Any   # --enable-scale-out with the hermes parser: the native reference for tool calls


@pytest.fixture(scope="session")
def tool_stack(model_dir: Path, logs_dir: Path) -> Iterator[ToolStack]:
    """A hermes render sidecar and a hermes native engine, started once for every tool-call test."""
    from render_sidecar.launch import RenderSidecar
    from token_engine.launch import VllmEngine

    render = RenderSidecar(model_dir, port=free_port(), served_model_name=SERVED, max_model_len=MAX_MODEL_LEN,
                           tool_call_parser="hermes", enable_auto_tool_choice=True,
                           log_path=logs_dir / "render-tools.log", echo=_echo(), name="render-tools")
    native = VllmEngine(model_dir, port=free_port(), served_model_name=SERVED, mode="scale-out",
                        max_model_len=MAX_MODEL_LEN, log_path=logs_dir / "native-tools.log", echo=_echo(),
                        extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                        name="native-tools")
    try:
        native.start()
        render.start()
        _ready(render)
        _ready(native)
        yield ToolStack(render, native)
    finally:
        native.stop()
        render.stop()


def make_settings(render_url: str, engine_urls: list[str], **overrides: Any) -> Settings:
    base: dict[str, Any] = {
        "render": {"url": render_url},
        "engines": [EngineSettings(url=u) for u in engine_urls],
        "models": [ModelSettings(name=SERVED, aliases=["gpt-4o-mini"])],
        "responses": {"store": {"path": str(RESPONSE_STORE)}},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    os.environ.pop("COORD_CONFIG", None)
    return Settings(**base)


CoordinatorFactory = Callable[..., CoordinatorServer]


@pytest.fixture
def coordinator_factory() -> Iterator[CoordinatorFactory]:
    """``make(render_url, [engine urls], **settings overrides)`` → a started coordinator."""
    started: list[CoordinatorServer] = []

    def make(render_url: str, engine_urls: list[str], **overrides: Any) -> CoordinatorServer:
        server = CoordinatorServer(make_settings(render_url, engine_urls, **overrides)).__enter__()
        started.append(server)
        return server

    yield make
    for s in started:
        s.__exit__(None, None, None)
