"""Shared lifecycle for vLLM server launchers (render sidecar, engine) and their foreground CLIs.

Why a base class: both servers have the same life (spawn with the CPU-safe env, wait for
``/health``, stop the whole process group) and only differ in argv. The foreground runner turns
SIGTERM/SIGINT into an orderly stop of the children, because a terminal's Ctrl-C does not reach them
(they run in their own sessions) and Python's default SIGTERM would skip ``finally``/``atexit``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType, TracebackType

from token_engine.process import ManagedProcess
from token_engine.vllm_env import is_cpu_build, vllm_env

DEFAULT_READY_TIMEOUT = 300.0
DEFAULT_STOP_TIMEOUT = 20.0


def port_in_use(host: str, port: int) -> bool:
    """Whether something already listens there; vLLM would only notice after ~1 min of imports."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno in (errno.EADDRINUSE, errno.EACCES)
    return False


class VllmServer:
    """One vLLM HTTP server child; subclasses provide ``name`` and ``build_argv``."""

    name = "vllm"

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        host: str,
        port: int,
        extra_args: Sequence[str] = (),
        log_path: str | os.PathLike[str] | None = None,
        echo: bool = True,
        python: str | None = None,
        cpu: bool | None = None,
        env_overrides: dict[str, str] | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.host = host
        self.port = port
        self.extra_args = tuple(extra_args)
        self.log_path = Path(log_path) if log_path is not None else None
        self.echo = echo
        self.python = python
        self.cpu = is_cpu_build() if cpu is None else cpu
        self.env_overrides = dict(env_overrides or {})
        self.process: ManagedProcess | None = None

    # -- to override
    def build_argv(self) -> list[str]:
        raise NotImplementedError

    def build_env(self) -> dict[str, str]:
        return vllm_env(cpu=self.cpu, overrides=self.env_overrides)

    # -- lifecycle
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> VllmServer:
        """Spawn the server (non-blocking); call ``wait_ready`` next, possibly after starting others."""
        if self.process is not None and self.process.is_running():
            raise RuntimeError(f"{self.name} already running (pid {self.process.pid})")
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"{self.model_dir} is not a model folder (no config.json); run `make model` "
                f"or `python -m token_engine.model_prep`"
            )
        if port_in_use(self.host, self.port):
            raise OSError(errno.EADDRINUSE, f"{self.host}:{self.port} in use; cannot start {self.name}")
        self.process = ManagedProcess(
            self.build_argv(), env=self.build_env(), name=self.name, echo=self.echo, log_path=self.log_path
        )
        self.process.start()
        return self

    def _require_process(self) -> ManagedProcess:
        if self.process is None:
            raise RuntimeError(f"{self.name} not started")
        return self.process

    def wait_ready(
        self, timeout: float = DEFAULT_READY_TIMEOUT, cancel: threading.Event | None = None
    ) -> float:
        """Block until ``GET /health`` is 200; returns seconds since start. Fails fast if the child dies."""
        return self._require_process().wait_http_ready(f"{self.url}/health", timeout, cancel=cancel)

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT) -> int | None:
        """Stop the whole process tree (idempotent); returns the exit status."""
        return None if self.process is None else self.process.stop(timeout)

    def is_running(self) -> bool:
        return self.process is not None and self.process.is_running()

    def __enter__(self) -> VllmServer:
        """Starts (does not wait): lets callers start several servers before waiting on all."""
        if self.process is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@contextlib.contextmanager
def stop_signals() -> Iterator[threading.Event]:
    """Turn SIGTERM/SIGINT into an Event (main thread only), restoring the old handlers afterwards."""
    event = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        event.set()

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield event
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


def run_foreground(server: VllmServer, ready_timeout: float = DEFAULT_READY_TIMEOUT) -> int:
    """CLI body: start, report readiness, run until a signal (exit 0) or the child dies (exit 1)."""
    with stop_signals() as stop:
        try:
            server.start()
        except (OSError, RuntimeError) as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1
        proc = server._require_process()
        failure: str | None = None
        try:
            took = server.wait_ready(ready_timeout, cancel=stop)
            print(f"{server.name} ready: {server.url} (pid {proc.pid}, {took:.1f}s)", flush=True)
            while not stop.is_set() and proc.is_running():
                time.sleep(0.2)
        except InterruptedError:
            pass
        except (TimeoutError, RuntimeError) as exc:  # RuntimeError includes ProcessExitedError
            failure = str(exc)
        finally:
            rc = server.stop()
        if failure is not None:
            print(f"error: {failure}", file=sys.stderr, flush=True)
            return 1
        if stop.is_set():
            print(f"{server.name} stopped (exit status {rc})", flush=True)
            return 0
        print(f"error: {server.name} exited unexpectedly with status {rc}", file=sys.stderr, flush=True)
        return 1
