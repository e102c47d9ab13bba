"""Child-process supervision for the render sidecar, the engines and the coordinator.

Why not plain ``subprocess.Popen``: vLLM servers fork an EngineCore (and sometimes more helpers), log
a lot, and take a minute to come up. Tests and the local stack need to (a) see the log live with a
prefix, (b) wait for a specific log line or for an HTTP endpoint, and fail fast with the log tail when
the child dies instead of waiting out a 5-minute timeout, and (c) kill the *whole* tree reliably so
that no orphan keeps a port or 2 GiB of RAM. Each child is therefore started in its own session /
process group and stopped group-wide (SIGTERM, then SIGKILL).

This module must not import vLLM: it is also used for the coordinator and in unit tests.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

import httpx

__all__ = [
    "ManagedProcess",
    "ProcessExitedError",
    "echo_line",
    "group_alive",
    "pid_alive",
    "wait_http_ready_all",
]

DEFAULT_MAX_LINES = 5000
TAIL_LINES = 40
ROOT_CAUSE_LINES = 30
_ERROR_LINE = re.compile(r"Traceback \(most recent call last\)|\bERROR\b|Error:|Exception:")

_echo_lock = threading.Lock()  # keeps prefixed lines of concurrent children from interleaving
_live: set[ManagedProcess] = set()  # strong refs: a forgotten, unstopped child is still reaped at exit


def echo_line(text: str, stream: IO[str] | None = None) -> None:
    """Print a whole line without interleaving with the children's prefixed output."""
    with _echo_lock, contextlib.suppress(ValueError, OSError):
        out = stream or sys.stdout
        out.write(text + "\n")
        out.flush()


class ProcessExitedError(RuntimeError):
    """The child exited while we were waiting for it; the message carries its last log lines."""

    def __init__(self, message: str, returncode: int | None) -> None:
        super().__init__(message)
        self.returncode = returncode


def _proc_state(pid: int) -> str | None:
    """Linux process state letter from /proc, or None if the pid does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return "?"
    return stat[stat.rfind(")") + 2 :].split(" ", 1)[0]


def pid_alive(pid: int) -> bool:
    """True if the pid runs; a zombie counts as dead (our init may never reap orphans)."""
    if Path("/proc").is_dir():
        state = _proc_state(pid)
        return state is not None and state not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_alive(pgid: int) -> bool:
    """True if any non-zombie process is still in the process group ``pgid``."""
    if not Path("/proc").is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return bool(group_pids(pgid))


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of the process group ``pgid``, from ``/proc``."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split(" ")
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            pids.append(int(entry.name))
    return pids


class ManagedProcess:
    """A child process in its own process group, with a line-pumped, prefixed, bounded log.

    Typical use::

        with ManagedProcess(["python", "-m", "x"], name="engine") as p:
            p.wait_http_ready("http://127.0.0.1:8200/health", timeout=300)
            mark = p.line_count()
            ...
            assert p.wait_for_line(r"Aborted request", timeout=5, since=mark)
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        name: str = "proc",
        prefix: str | None = None,
        echo: bool = True,
        log_path: str | os.PathLike[str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        max_lines: int = DEFAULT_MAX_LINES,
        echo_stream: IO[str] | None = None,
    ) -> None:
        if not argv:
            raise ValueError("argv must not be empty")
        self.argv = [str(a) for a in argv]
        self.env = dict(os.environ if env is None else env)
        self.name = name
        self.prefix = f"[{name}] " if prefix is None else prefix
        self.echo = echo
        self.log_path = Path(log_path) if log_path is not None else None
        self.cwd = cwd
        self._echo_stream = echo_stream
        self._lines: deque[tuple[int, str]] = deque(maxlen=max_lines)
        self._count = 0
        self._cond = threading.Condition()
        self._popen: subprocess.Popen[bytes] | None = None
        self._pump: threading.Thread | None = None
        self._log_fh: IO[str] | None = None
        self._stopped = False
        self._stop_lock = threading.Lock()
        self.started_at: float | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> ManagedProcess:
        """Spawn the child in a new session so signals to our terminal do not hit it directly."""
        if self._popen is not None:
            raise RuntimeError(f"{self.name} already started")
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_fh = self.log_path.open("a", encoding="utf-8")
        self._popen = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.started_at = time.monotonic()
        _live.add(self)
        self._pump = threading.Thread(target=self._pump_output, name=f"pump-{self.name}", daemon=True)
        self._pump.start()
        return self

    @property
    def pid(self) -> int:
        """The child's pid, which is also its process-group id."""
        if self._popen is None:
            raise RuntimeError(f"{self.name} not started")
        return self._popen.pid

    @property
    def started(self) -> bool:
        return self._popen is not None

    @property
    def returncode(self) -> int | None:
        """Exit status (negative = killed by that signal), or None while running / before start."""
        return None if self._popen is None else self._popen.poll()

    def is_running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the child itself to exit; returns None on timeout."""
        if self._popen is None:
            return None
        try:
            return self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the whole group, SIGKILL whatever is left after ``timeout``. Idempotent.

        Waits for grandchildren too (vLLM's EngineCore holds the RAM), not only for the leader.
        """
        with self._stop_lock:
            if self._popen is None:
                return None
            if self._stopped:
                return self._popen.returncode
            pgid = self._popen.pid
            deadline = time.monotonic() + max(0.0, timeout)
            self._signal_group(pgid, signal.SIGTERM)
            if self._popen.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._popen.wait(max(0.0, deadline - time.monotonic()))
            while group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if self._popen.poll() is None or group_alive(pgid):
                self._emit(f"still running after {timeout:.0f}s, sending SIGKILL", own=True)
                self._signal_group(pgid, signal.SIGKILL)
                self._popen.wait()
                kill_deadline = time.monotonic() + 5.0
                while group_alive(pgid) and time.monotonic() < kill_deadline:
                    time.sleep(0.05)
            self._stopped = True
            if self._pump is not None:
                self._pump.join(timeout=5.0)
            if self._log_fh is not None:
                with contextlib.suppress(OSError):
                    self._log_fh.close()
                self._log_fh = None
            _live.discard(self)
            return self._popen.returncode

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    def __enter__(self) -> ManagedProcess:
        if self._popen is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ output
    def _emit(self, line: str, *, own: bool = False) -> None:
        text = f"({line})" if own else line
        if self.echo:
            stream = self._echo_stream or sys.stdout
            with _echo_lock, contextlib.suppress(ValueError, OSError):
                stream.write(f"{self.prefix}{text}\n")
                stream.flush()
        if self._log_fh is not None:
            with contextlib.suppress(ValueError, OSError):
                self._log_fh.write(text + "\n")
                self._log_fh.flush()

    def _pump_output(self) -> None:
        assert self._popen is not None and self._popen.stdout is not None
        stdout = self._popen.stdout
        try:
            for raw in iter(stdout.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                self._emit(line)
                with self._cond:
                    self._lines.append((self._count, line))
                    self._count += 1
                    self._cond.notify_all()
        finally:
            with contextlib.suppress(OSError):
                stdout.close()
            with self._cond:
                self._cond.notify_all()

    def _pump_done(self) -> bool:
        return self._pump is not None and not self._pump.is_alive()

    def line_count(self) -> int:
        """Number of lines seen so far; use it as a mark for ``wait_for_line(since=...)``."""
        with self._cond:
            return self._count

    def lines(self, since: int = 0) -> list[str]:
        """Retained lines with index >= ``since`` (older ones may have left the bounded buffer)."""
        with self._cond:
            return [text for idx, text in self._lines if idx >= since]

    def tail(self, n: int = TAIL_LINES) -> str:
        with self._cond:
            return "\n".join(text for _, text in list(self._lines)[-n:])

    def failure_excerpt(self, n: int = TAIL_LINES) -> str:
        """The log's first error block and its last ``n`` lines.

        Why not the tail alone: when vLLM's EngineCore dies, its own exception (the root cause) is
        printed first and the API server's ~40-line "Engine core initialization failed" traceback
        after it, so a tail shows only the consequence.
        """
        with self._cond:
            lines = [text for _, text in self._lines]
        tail_from = max(0, len(lines) - n)
        first = next((i for i, text in enumerate(lines[:tail_from]) if _ERROR_LINE.search(text)), None)
        if first is None:
            return "\n".join(lines[tail_from:])
        block = lines[first : min(first + ROOT_CAUSE_LINES, tail_from)]
        return "\n".join([f"first error at line {first + 1}:", *block, "...", f"last {n} lines:",
                          *lines[tail_from:]])

    def wait_for_line(self, pattern: str | re.Pattern[str], timeout: float, since: int = 0) -> str | None:
        """First line (index >= ``since``) matching ``pattern`` (``re.search``), or None on timeout.

        Returns early with None once the child's output has ended (it exited), so a test does not
        sit out its timeout on a dead process.
        """
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        checked = since
        with self._cond:
            while True:
                for idx, text in self._lines:
                    if idx >= checked and regex.search(text):
                        return text
                checked = max(checked, self._count)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._pump_done():
                    return None
                self._cond.wait(min(remaining, 0.5))

    # ------------------------------------------------------------------ readiness
    def _exited_error(self, what: str) -> ProcessExitedError:
        if self._pump is not None:
            self._pump.join(timeout=2.0)  # make sure the last words are in the buffer
        rc = self.returncode
        return ProcessExitedError(
            f"{self.name} (pid {self.pid}) exited with code {rc} {what}; {_memory_note()}\n"
            f"{self.failure_excerpt(TAIL_LINES)}",
            rc,
        )

    def check_http_ready(self, url: str, *, client: httpx.Client | None = None) -> bool:
        """One probe: True on HTTP 200; raises ``ProcessExitedError`` if the child is gone."""
        if self._popen is None:
            raise RuntimeError(f"{self.name} not started")
        if self._popen.poll() is not None:
            raise self._exited_error(f"before {url} answered 200")
        try:
            if client is not None:
                resp = client.get(url)
            else:
                resp = httpx.get(url, timeout=2.0)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    def wait_http_ready(
        self, url: str, timeout: float, *, interval: float = 0.5, cancel: threading.Event | None = None
    ) -> float:
        """Poll ``url`` until it answers 200; return the seconds since start.

        Fails fast with ``ProcessExitedError`` (with the log tail) if the child exits, and raises
        ``TimeoutError`` (also with the tail) after ``timeout``; ``cancel`` aborts the wait early.
        """
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=min(5.0, max(interval * 4, 1.0))) as client:
            while True:
                if self.check_http_ready(url, client=client):
                    return time.monotonic() - (self.started_at or time.monotonic())
                if cancel is not None and cancel.is_set():
                    raise InterruptedError(f"waiting for {url} was cancelled")
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{self.name} (pid {self.pid}) not ready at {url} after {timeout:.0f}s; "
                        f"{_memory_note()}\n{self.failure_excerpt(TAIL_LINES)}"
                    )
                time.sleep(interval)

    def __repr__(self) -> str:
        state = "not started" if self._popen is None else f"pid={self._popen.pid} rc={self.returncode}"
        return f"ManagedProcess({self.name!r}, {state})"


def wait_http_ready_all(
    targets: Sequence[tuple[ManagedProcess, str]],
    timeout: float,
    *,
    interval: float = 0.5,
    cancel: threading.Event | None = None,
    on_ready: Callable[[ManagedProcess, float], None] | None = None,
) -> dict[str, float]:
    """Wait for several children at once (they start in parallel); returns name -> seconds to ready.

    Fails as soon as any of them exits (``ProcessExitedError`` with that child's log tail), so a
    crashed engine is reported in seconds rather than after the slowest sibling's timeout.
    """
    pending = list(targets)
    ready: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=min(5.0, max(interval * 4, 1.0))) as client:
        while pending:
            for proc, url in list(pending):
                if proc.check_http_ready(url, client=client):
                    took = time.monotonic() - (proc.started_at or time.monotonic())
                    ready[proc.name] = took
                    pending.remove((proc, url))
                    if on_ready is not None:
                        on_ready(proc, took)
            if not pending:
                break
            if cancel is not None and cancel.is_set():
                raise InterruptedError("waiting for readiness was cancelled")
            if time.monotonic() >= deadline:
                names = ", ".join(p.name for p, _ in pending)
                tails = "\n".join(f"--- {p.name}:\n{p.failure_excerpt(TAIL_LINES)}" for p, _ in pending)
                raise TimeoutError(f"not ready after {timeout:.0f}s: {names}\n{tails}")
            time.sleep(interval)
    return ready


def _memory_note() -> str:
    """The machine's available memory: an engine that dies at start-up mostly lacked it."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
        info = dict(line.split(":", 1) for line in lines if ":" in line)
        avail, total = (int(info[k].split()[0]) / 2**20 for k in ("MemAvailable", "MemTotal"))
    except (OSError, KeyError, ValueError):
        return "memory unknown"
    return f"memory available {avail:.1f} of {total:.1f} GiB"


@atexit.register
def _stop_all_at_exit() -> None:
    """Last line of defence: an interpreter exiting normally never leaves a child group behind."""
    for proc in list(_live):
        with contextlib.suppress(Exception):
            proc.stop(timeout=5.0)
