"""Test helpers: the embedded coordinator under its test name, a coordinator process, SSE reading."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from coordinator.embedded import EmbeddedCoordinator, free_port
from perf._procs import RedisServer, reserved_port
from token_engine.process import ManagedProcess
from token_engine.simulator import SimulatedEngine

__all__ = ["CoordinatorProcess", "CoordinatorServer", "RedisServer", "StreamReader", "free_port", "reserved_port", "sse_events", "streamed_text",
           "wait_until"]

ROOT = Path(__file__).resolve().parents[1]


CoordinatorServer = EmbeddedCoordinator


def sse_events(resp: httpx.Response) -> list[Any]:
    """Parse a complete SSE body into JSON objects; the literal "[DONE]" stays a string."""
    out: list[Any] = []
    for block in resp.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), f"bad SSE frame: {block!r}"
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def streamed_text(events: list[Any], kind: str = "chat") -> dict[int, str]:
    texts: dict[int, str] = {}
    for ev in events:
        if not isinstance(ev, dict):
            continue
        for ch in ev.get("choices", []):
            piece = (ch.get("delta") or {}).get("content") if kind == "chat" else ch.get("text")
            texts[ch["index"]] = texts.get(ch["index"], "") + (piece or "")
    return texts


def served_by(sims: dict[str, Any], post: Callable[[], object]) -> str:
    """The one simulated engine (by its key in ``sims``) that ``post()``'s request reached."""
    before = {k: s.state()["requests_total"] for k, s in sims.items()}
    post()
    grew = [k for k, s in sims.items() if s.state()["requests_total"] > before[k]]
    assert len(grew) == 1, grew
    return grew[0]


LONG_HISTORY = " ".join(f"Line {i} of a long shared history about lighthouses." for i in range(60))
"""A prefix long enough that KV affinity, not load, decides where a conversation goes."""


def leave_stream(url: str, body: dict[str, Any], request_id: str, frames: int = 3) -> httpx.Headers:
    """Open an SSE stream, read ``frames`` data frames and leave (close the connection): a client
    that goes away mid-stream. Asserts the stream opened (200) and carried that many frames; returns
    the response's headers."""
    seen = 0
    with httpx.Client(timeout=60) as client, client.stream("POST", url, json=body,
                                                         headers={"X-Request-Id": request_id}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            seen += line.startswith("data: ")
            if seen >= frames:
                break
    assert seen >= frames, f"the stream ended after {seen} frames"
    return resp.headers


def generate_calls(engine_url: str) -> float:
    """A real vLLM engine's own count of answered ``/inference/v1/generate`` calls (its /metrics):
    proof that a request took the token route."""
    text = httpx.get(f"{engine_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("http_requests_total{") and 'handler="/inference/v1/generate"' in line)


def refused(url: str) -> bool:
    """True when a new connection to the server at ``url`` is not served: refused (its listener is
    closed), or taken into the kernel's backlog just as the listener closed and then dropped
    without an answer, closed or reset (several worker processes close a shared socket one after
    another)."""
    try:
        httpx.get(f"{url}/health", timeout=2)
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        return True
    return False


def wait_until(pred: Callable[[], object], timeout: float = 15.0) -> bool:
    """Poll ``pred`` until it holds (state changes on other threads: engines, coordinator tasks).
    The bound only ends a wait that will never succeed: a loaded CI machine can take seconds for
    what takes milliseconds here, and a generous bound costs nothing when the state arrives."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return bool(pred())


class CoordinatorProcess:
    """``python -m coordinator --config <yaml>`` as its own process, as a pod runs it (real signals,
    real exit status). ``config`` is the YAML tree; ``server.host``/``server.port`` are filled in.
    ``with CoordinatorProcess(cfg, tmp_path) as c:`` waits for ``/ready`` and stops the process after."""

    def __init__(self, config: dict[str, Any], workdir: Path, name: str = "coordinator") -> None:
        self.port = reserved_port()  # below the ephemeral range: no outgoing connection takes it meanwhile
        server = {**config.get("server", {}), "host": "127.0.0.1", "port": self.port}
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**config, "server": server}))
        env = {k: v for k, v in os.environ.items() if not k.startswith("COORD_")}
        self.process = ManagedProcess([sys.executable, "-m", "coordinator", "--config", str(path)], env=env,
                                      name=name, cwd=ROOT, echo=bool(os.environ.get("LLMC_TEST_ECHO")),
                                      log_path=workdir / f"{name}.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> CoordinatorProcess:
        self.process.start()
        try:
            self.process.wait_http_ready(f"{self.url}/ready", timeout=120, interval=0.2)
        except BaseException:
            self.process.stop(timeout=5)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.stop(timeout=10)


class StreamReader(threading.Thread):
    """POSTs one streaming request and reads the body to its end in the background, so a test can act
    while the stream runs. ``first`` is set once body bytes arrived; ``error`` keeps a transport error."""

    def __init__(self, url: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.path = url, body, path
        self.first = threading.Event()
        self.text = ""
        self.status = 0
        self.error: Exception | None = None
        self.ended_at: float | None = None  # time.monotonic() when the body ended

    def run(self) -> None:
        try:
            with httpx.Client(timeout=120) as c, c.stream("POST", self.url + self.path, json=self.body) as r:
                self.status = r.status_code
                for chunk in r.iter_text():
                    self.text += chunk
                    self.first.set()
        except Exception as exc:
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.first.set()

    @property
    def events(self) -> list[Any]:
        return sse_events(httpx.Response(200, text=self.text))


def peak_at_engine(urls: list[str], sim: SimulatedEngine, body: dict[str, Any], clients: int,
                    seconds: float, new_connections: bool = False) -> tuple[int, int]:
    """Drive ``clients`` concurrent requests of ``body`` through each coordinator URL for ``seconds``;
    the most requests the engine itself held at once (running + waiting), and how many completed.
    ``new_connections`` opens a connection per request, so that workers sharing one listening socket
    each get some (a kept-alive connection stays with the worker that accepted it)."""
    stop = time.monotonic() + seconds
    done = [0]
    peak = [0]
    lock = threading.Lock()

    def client(url: str) -> None:
        with httpx.Client(timeout=60) as c:
            while time.monotonic() < stop:
                headers = {"Connection": "close"} if new_connections else {}
                r = c.post(f"{url}/v1/completions", json=body, headers=headers)
                assert r.status_code == 200, r.text
                with lock:
                    done[0] += 1

    def sampler() -> None:
        while time.monotonic() < stop:
            state = sim.state()
            peak[0] = max(peak[0], len(state["running"]) + len(state["waiting"]))
            time.sleep(0.01)

    threads = [threading.Thread(target=client, args=(url,)) for url in urls for _ in range(clients)]
    threads.append(threading.Thread(target=sampler))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return peak[0], done[0]
