"""Child processes for benchmarks that measure CPU per process: the coordinator, simulated engines,
render sidecars, and their CPU seconds.

Why child processes: a coordinator embedded in the benchmark shares its event loop (and GIL) with
the load generator, so neither its throughput nor its CPU time can be told apart from the harness's.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Any

import httpx
import psutil

from coordinator.config import RenderSettings
from coordinator.embedded import free_port
from token_engine.simulator import SimConfig, SimulatedEngine

SERVED = "smollm2-135m-instruct"


def reserved_port() -> int:
    """A port below the kernel's ephemeral range, free on every interface.

    vLLM processes booting side by side take ephemeral ports for their internal ZMQ sockets; a port
    picked by ``free_port`` (an ephemeral one, released at once) can be handed to one of them before
    the process it was meant for binds it, and a retry with the same flags then fails the same way.
    Ports below the range are never handed out implicitly, so only an explicit bind can take them."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randint(max(1025, low - 12000), low - 1)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port
    return free_port()


class RedisServer:
    """A real ``redis-server`` on a free loopback port, without persistence (``make test`` installs it).

    ``stop()`` and ``start()`` again keep the port, so a client configured with ``url`` sees an outage
    and a recovery of the same server."""

    def __init__(self) -> None:
        import shutil

        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed; `make test` and `make redis` install it "
                               "(apt-get install redis-server)")
        self.binary = binary
        self.port = reserved_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: Any = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else int(self._proc.pid)

    def start(self, timeout: float = 20.0) -> RedisServer:
        import socket
        import subprocess

        self._proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                                       "--save", "", "--appendonly", "no", "--protected-mode", "no"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode} on port {self.port}")
            with socket.socket() as sock:
                sock.settimeout(0.5)
                try:
                    sock.connect(("127.0.0.1", self.port))
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return self
                except OSError:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer PING on port {self.port}")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
        self._proc = None


def tree_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of a process and its live descendants (None if it is gone or unknown)."""
    if pid is None:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def own_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process alone (its children, e.g. engines it spawned, excluded)."""
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def cpu_sum(pids: Sequence[int | None]) -> float | None:
    values = [tree_cpu_s(p) for p in pids]
    return None if not values or any(v is None for v in values) else sum(v for v in values if v is not None)


_HTTP_TOTAL = re.compile(r'^http_requests_total\{([^}]*)\}\s+([0-9.eE+-]+)$')


def sidecar_calls(url: str, suffix: str = "/derender") -> int | None:
    """Requests a vLLM sidecar served on routes ending in ``suffix``, from its own ``/metrics``
    (``http_requests_total`` per handler); None when the server exposes no such counter."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    total, seen = 0.0, False
    for line in text.splitlines():
        m = _HTTP_TOTAL.match(line)
        if m and re.search(r'handler="[^"]*' + re.escape(suffix) + '"', m.group(1)):
            total += float(m.group(2))
            seen = True
    return int(total) if seen else None


def render_config(urls: Sequence[str]) -> dict[str, Any]:
    """The ``render`` config section for one or several sidecars: ``render.urls`` where the coordinator
    has it (a pool of sidecar processes), else ``render.url``; several URLs without ``urls`` raise."""
    if "urls" in RenderSettings.model_fields:
        return {"urls": list(urls)}
    if len(urls) != 1:
        raise NotImplementedError("this coordinator has no render.urls (one sidecar only)")
    return {"url": urls[0]}


def supports_render_pool() -> bool:
    return "urls" in RenderSettings.model_fields


class CoordinatorProcess:
    """``python -m coordinator --config FILE`` on a free port; the config is a JSON (= YAML) file."""

    def __init__(self, config: dict[str, Any], log_path: Path | None = None) -> None:
        self.config = {"server": {"log_level": "warning"}, **config}
        self.port = free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="coord-")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def __enter__(self) -> CoordinatorProcess:
        path = Path(self._dir.name) / "config.yaml"
        path.write_text(json.dumps(self.config))
        env = {k: v for k, v in os.environ.items() if not k.startswith("COORD_")}
        self._log = open(self.log_path, "ab") if self.log_path else None  # closed in __exit__
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator", "--config", str(path), "--host", "127.0.0.1",
             "--port", str(self.port)], env=env, stdout=self._log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"coordinator exited with {self.proc.returncode} (log: {self.log_path})")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError("coordinator did not become ready")
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._log is not None:
            self._log.close()
        self._dir.cleanup()


def _serve_engines(configs: list[dict[str, Any]], conn: Connection) -> None:
    """Child process: run the simulated engines until the parent says stop."""
    engines = [SimulatedEngine(SimConfig(**c)).start() for c in configs]
    conn.send([e.url for e in engines])
    conn.recv()
    for e in engines:
        e.stop()


@contextmanager
def sim_engines(configs: list[dict[str, Any]]) -> Iterator[tuple[list[str], int]]:
    """Simulated engines in one spawned child process; yields their URLs and the child's pid."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_engines, args=(configs, child), name="sim-engines", daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("simulated engines did not start")
        urls: list[str] = parent.recv()
        assert proc.pid is not None
        yield urls, proc.pid
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.terminate()


@contextmanager
def render_sidecars(n: int, say: Callable[[str], None], *, log_dir: Path | None = None,
                    model: Path | None = None, served: str = SERVED, **kwargs: Any) -> Iterator[list[Any]]:
    """``n`` real vLLM render sidecars started together (start-up is mostly ``import vllm``); their
    logs go to ``log_dir/render-<i>.log`` when given. ``model``: another model folder than SmolLM2's,
    served as ``served``."""
    from render_sidecar.launch import RenderSidecar
    from token_engine.model_prep import ensure_model

    model = model or ensure_model()
    with ExitStack() as stack:
        sidecars = []
        for i in range(n):
            log = None if log_dir is None else log_dir / f"render-{i}.log"
            s = RenderSidecar(model, port=free_port(), served_model_name=served, echo=False, log_path=log,
                              **kwargs)
            s.start()
            stack.callback(s.stop)
            sidecars.append(s)
        say(f"waiting for {n} render sidecar(s) (real vLLM)")
        for s in sidecars:
            s.wait_ready(timeout=600)
        yield sidecars


def sidecar_pid(sidecar: Any) -> int | None:
    proc = getattr(sidecar, "process", None)
    pid = getattr(proc, "pid", None)
    return pid if isinstance(pid, int) else None


async def sim_cache_counts(client: Any, sims: Sequence[str]) -> tuple[float, float]:
    """The simulated engines' prefix-cache counters summed (``/sim/state``): tokens found, looked up."""
    hits = queries = 0.0
    for u in sims:
        state = (await client.get(f"{u}/sim/state", timeout=30)).json()["prefix_cache"]
        hits += float(state["hits"])
        queries += float(state["queries"])
    return hits, queries


@contextmanager
def render_sidecar(url: str | None, say: Callable[[str], None], *,
                   max_model_len: int | None = None) -> Iterator[str]:
    """``url`` when given (a running sidecar), else a real vLLM render sidecar started here for the
    benchmark's duration (the model prepared first, with progress)."""
    if url:
        yield url
        return
    from render_sidecar.launch import RenderSidecar
    from token_engine.model_prep import ensure_model

    say("preparing model, starting the render sidecar (real vLLM)")
    extra: dict[str, Any] = {} if max_model_len is None else {"max_model_len": max_model_len}
    render = RenderSidecar(ensure_model(), port=free_port(), served_model_name=SERVED, echo=False, **extra)
    render.start()
    try:
        render.wait_ready(timeout=600)
        yield render.url
    finally:
        render.stop()
