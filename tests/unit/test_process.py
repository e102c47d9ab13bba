"""ManagedProcess: prefixed/bounded log pumping, line waits, readiness fail-fast, group-wide stop."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from token_engine.process import ManagedProcess, ProcessExitedError

PY = sys.executable
REPO_ROOT = Path(__file__).resolve().parents[2]


def _running(pid: int) -> bool:
    """Independent of the code under test: exists in /proc and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(code: str) -> list[str]:
    return [PY, "-u", "-c", textwrap.dedent(code)]


# A child that starts a sleeping grandchild, reports both pids, then sleeps.
SPAWNS_GRANDCHILD = """
    import os, signal, subprocess, sys, time
    ignore = len(sys.argv) > 1 and sys.argv[1] == "ignore-term"
    code = "import signal, time\\n"
    if ignore:
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    code += "time.sleep(120)"
    gc = subprocess.Popen([sys.executable, "-c", code])
    print(f"child={os.getpid()} grandchild={gc.pid}", flush=True)
    time.sleep(120)
"""


def test_lines_are_prefixed_logged_and_kept(tmp_path: Path) -> None:
    out = io.StringIO()
    log = tmp_path / "logs" / "kid.log"
    code = "import sys; print('hello'); print('oops', file=sys.stderr); print('world')"
    with ManagedProcess(_child(code), name="kid", echo_stream=out, log_path=log) as p:
        assert p.wait(10) == 0
        assert p.wait_for_line(r"^world$", timeout=5) == "world"
    # stderr is merged into the same stream, in order (the child is unbuffered).
    assert out.getvalue().splitlines() == ["[kid] hello", "[kid] oops", "[kid] world"]
    assert log.read_text().splitlines() == ["hello", "oops", "world"]  # the file has no prefix
    assert p.lines() == ["hello", "oops", "world"]


def test_echo_off_prints_nothing_but_still_records(tmp_path: Path) -> None:
    out = io.StringIO()
    with ManagedProcess(_child("print('quiet')"), name="q", echo=False, echo_stream=out) as p:
        assert p.wait_for_line("quiet", timeout=5) == "quiet"
    assert out.getvalue() == ""


def test_buffer_is_bounded_but_line_count_is_total() -> None:
    code = "for i in range(50): print(f'line {i}')"
    with ManagedProcess(_child(code), name="b", echo=False, max_lines=5) as p:
        p.wait(10)
        assert p.wait_for_line("line 49", timeout=5) == "line 49"
    assert p.line_count() == 50
    assert p.lines() == [f"line {i}" for i in range(45, 50)]


def test_wait_for_line_since_mark_ignores_earlier_lines() -> None:
    code = """
        import time
        print("Aborted request old", flush=True)
        print("phase two", flush=True)
        time.sleep(0.5)
        print("Aborted request new", flush=True)
        time.sleep(30)
    """
    with ManagedProcess(_child(code), name="m", echo=False) as p:
        assert p.wait_for_line("phase two", timeout=10) == "phase two"
        mark = p.line_count()
        assert p.wait_for_line(r"Aborted request", timeout=10, since=mark) == "Aborted request new"
        # Nothing new after the last mark: returns None once the timeout has passed.
        mark = p.line_count()
        started = time.monotonic()
        assert p.wait_for_line(r"Aborted request", timeout=0.5, since=mark) is None
        assert 0.4 <= time.monotonic() - started < 3


def test_wait_for_line_returns_early_when_child_exits() -> None:
    with ManagedProcess(_child("print('bye')"), name="e", echo=False) as p:
        started = time.monotonic()
        assert p.wait_for_line("never printed", timeout=20) is None
        assert time.monotonic() - started < 5


def test_stop_terminates_whole_group_including_grandchild() -> None:
    p = ManagedProcess([*_child(SPAWNS_GRANDCHILD)], name="tree", echo=False).start()
    line = p.wait_for_line(r"grandchild=\d+", timeout=15)
    assert line is not None
    child_pid, grandchild_pid = (int(part.split("=")[1]) for part in line.split())
    assert _running(grandchild_pid)
    rc = p.stop(timeout=10)
    assert rc is not None and rc < 0  # killed by SIGTERM
    assert not _running(child_pid)
    assert not _running(grandchild_pid)
    assert p.stop() == rc  # idempotent


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored() -> None:
    p = ManagedProcess([*_child(SPAWNS_GRANDCHILD), "ignore-term"], name="stubborn", echo=False).start()
    line = p.wait_for_line(r"grandchild=\d+", timeout=15)
    assert line is not None
    grandchild_pid = int(line.split("grandchild=")[1])
    started = time.monotonic()
    rc = p.stop(timeout=1.0)
    assert rc == -9
    assert time.monotonic() - started < 8
    assert not _running(grandchild_pid)


def test_grandchild_is_killed_even_after_child_exited_on_its_own() -> None:
    code = """
        import subprocess, sys
        gc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print(f"grandchild={gc.pid}", flush=True)
    """
    p = ManagedProcess(_child(code), name="orphaner", echo=False).start()
    line = p.wait_for_line(r"grandchild=\d+", timeout=15)
    assert line is not None
    grandchild_pid = int(line.split("=")[1])
    assert p.wait(10) == 0
    assert _running(grandchild_pid)  # orphaned, still in our process group
    p.stop(timeout=5)
    assert not _running(grandchild_pid)


def test_wait_http_ready_fails_fast_with_child_output() -> None:
    code = "import sys; print('boom: model folder has no config.json'); sys.exit(3)"
    with ManagedProcess(_child(code), name="dies", echo=False) as p:
        started = time.monotonic()
        with pytest.raises(ProcessExitedError) as info:
            p.wait_http_ready(f"http://127.0.0.1:{_free_port()}/health", timeout=60)
        assert time.monotonic() - started < 10
    assert info.value.returncode == 3
    assert "boom: model folder has no config.json" in str(info.value)
    assert "exited with code 3" in str(info.value)


def test_exit_error_names_the_first_error_not_only_the_tail() -> None:
    """vLLM prints the EngineCore's own error first and a long API-server traceback after it."""
    code = (
        "import sys\n"
        "print('(EngineCore pid=7) ERROR Available memory on node 0 is less than requested for kv')\n"
        "for i in range(80): print(f'  File \"core_client.py\", line {i}, in __init__')\n"
        "print('RuntimeError: Engine core initialization failed. See root cause above.')\n"
        "sys.exit(1)\n"
    )
    with ManagedProcess(_child(code), name="engine", echo=False) as p:
        with pytest.raises(ProcessExitedError) as info:
            p.wait_http_ready(f"http://127.0.0.1:{_free_port()}/health", timeout=60)
    message = str(info.value)
    assert "Available memory on node 0 is less than requested" in message  # the root cause
    assert "Engine core initialization failed" in message                  # and the tail
    assert "memory available" in message


def test_wait_http_ready_succeeds_when_server_answers(tmp_path: Path) -> None:
    port = _free_port()
    argv = [PY, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    with ManagedProcess(argv, name="http", echo=False) as p:
        took = p.wait_http_ready(f"http://127.0.0.1:{port}/", timeout=30, interval=0.1)
        assert 0 < took < 30
        assert p.is_running()
    assert not p.is_running()


def test_wait_http_ready_times_out_with_tail() -> None:
    code = "import time; print('still warming up', flush=True); time.sleep(60)"
    with ManagedProcess(_child(code), name="slow", echo=False) as p:
        assert p.wait_for_line("warming", timeout=10)
        with pytest.raises(TimeoutError, match="still warming up"):
            p.wait_http_ready(f"http://127.0.0.1:{_free_port()}/health", timeout=1, interval=0.1)


def test_interpreter_exit_stops_forgotten_children(tmp_path: Path) -> None:
    """atexit safety: a script that never calls stop() must not leave its child tree running."""
    script = tmp_path / "forget.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            from token_engine.process import ManagedProcess
            p = ManagedProcess([sys.executable, "-u", "-c", {textwrap.dedent(SPAWNS_GRANDCHILD)!r}],
                               name="forgotten", echo=False).start()
            print(p.wait_for_line("grandchild=", timeout=15), flush=True)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([PY, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[-1]
    pids = [int(part.split("=")[1]) for part in line.split()]
    deadline = time.monotonic() + 5
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_running(pid) for pid in pids)


def test_stop_before_start_is_harmless_and_start_twice_is_refused() -> None:
    p = ManagedProcess(_child("import time; time.sleep(30)"), name="x", echo=False)
    assert p.stop() is None
    p.start()
    try:
        with pytest.raises(RuntimeError):
            p.start()
    finally:
        p.stop()
