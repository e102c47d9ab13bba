"""Command lines for other vLLM lines (``make compat-vllm``): the interpreter seam and older entry points."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import types
from pathlib import Path

import pytest

from coordinator.pipeline.engines import versions
from render_sidecar import launch
from render_sidecar.launch import SESSION_MODULE, RenderSidecar
from token_engine import vllm_env
from token_engine.launch import VllmEngine
from token_engine.vllm_env import (
    ENGINE_MODULE,
    LEGACY_ENGINE_MODULE,
    LEGACY_RENDER_CODE,
    RENDER_MODULE,
    RENDER_PYTHON_ENV,
    VLLM_PYTHON_ENV,
    render_python,
    vllm_line,
    vllm_python,
)


def test_interpreter_is_argument_then_env_then_this_venv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    assert vllm_python() == sys.executable
    monkeypatch.setenv(VLLM_PYTHON_ENV, "/other/bin/python")
    assert vllm_python() == "/other/bin/python"
    assert vllm_python("/given/bin/python") == "/given/bin/python"


def test_env_interpreter_reaches_render_and_engines(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(VLLM_PYTHON_ENV, "/other/bin/python")
    monkeypatch.setattr(vllm_env, "vllm_line", lambda python: (0, 32))
    assert RenderSidecar(tmp_path, cpu=True).build_argv()[:3] == ["/other/bin/python", "-m", RENDER_MODULE]
    argv = VllmEngine(tmp_path, cpu=True, mode="scale-out").build_argv()
    assert argv[:3] == ["/other/bin/python", "-m", ENGINE_MODULE] and "--enable-scale-out" in argv


@pytest.mark.parametrize(("line", "launchers", "scale_out_flag"),
                         [((0, 27), False, False), ((0, 28), False, False), ((0, 29), True, False),
                          ((0, 30), True, True), ((0, 32), True, True), (None, True, True)])
def test_older_lines_get_their_entry_points(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                            line: tuple[int, int] | None, launchers: bool,
                                            scale_out_flag: bool) -> None:
    monkeypatch.setattr(vllm_env, "vllm_line", lambda python: line)
    render = RenderSidecar(tmp_path, cpu=True, python="/old/bin/python").build_argv()
    engine = VllmEngine(tmp_path, cpu=True, python="/old/bin/python").build_argv()
    native = VllmEngine(tmp_path, cpu=True, python="/old/bin/python", mode="scale-out").build_argv()
    if launchers:
        assert render[1:3] == ["-m", RENDER_MODULE] and engine[1:3] == ["-m", ENGINE_MODULE]
    else:
        assert render[1:3] == ["-c", LEGACY_RENDER_CODE] and engine[1:3] == ["-m", LEGACY_ENGINE_MODULE]
    assert render[render.index("--model") + 1] == str(tmp_path)  # never positional, on every line
    assert "--tokens-only" in engine
    assert ("--enable-scale-out" in native) is scale_out_flag and "--tokens-only" not in native


def test_legacy_render_code_hands_the_command_line_to_vllms_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines before 0.29 have no render entry module: the ``-c`` program must parse the sidecar's flags
    (after the program itself) with vLLM's serve parser and run the render app with them, only when
    run as the main program. The vLLM modules it imports are stand-ins recording what reached them."""
    seen: dict[str, object] = {}

    def module(name: str, **attrs: object) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
        return mod

    def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--model")
        parser.add_argument("--port", type=int)
        return parser

    async def run_launch_fastapi(args: argparse.Namespace) -> None:
        seen["launched"] = (args.model, args.port)

    module("uvloop", run=lambda coro: asyncio.run(coro))
    module("vllm.entrypoints.cli.launch", run_launch_fastapi=run_launch_fastapi)
    module("vllm.entrypoints.openai.cli_args", make_arg_parser=make_arg_parser,
           validate_parsed_serve_args=lambda args: seen.setdefault("validated", args.model))
    module("vllm.entrypoints.serve.utils.api_utils", cli_env_setup=lambda: seen.setdefault("env", True))
    module("vllm.utils.argparse_utils", FlexibleArgumentParser=argparse.ArgumentParser)

    code = compile(LEGACY_RENDER_CODE, "<render>", "exec")
    monkeypatch.setattr(sys, "argv", ["-c", "--model", "/models/m", "--port", "8100"])
    exec(code, {"__name__": "imported"})   # a spawned child importing it starts nothing
    assert seen == {}
    exec(code, {"__name__": "__main__"})
    assert seen == {"env": True, "validated": "/models/m", "launched": ("/models/m", 8100)}


def test_line_of_this_venv_and_of_no_interpreter() -> None:
    assert vllm_line("/nonexistent/bin/python") is None
    found = vllm_line(sys.executable)
    assert found is None or (isinstance(found, tuple) and len(found) == 2)


def test_render_interpreter_env_moves_the_sidecars_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``$LLMC_RENDER_PYTHON``: a pod that upgrades its render sidecar before its engines."""
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    monkeypatch.setenv(RENDER_PYTHON_ENV, "/render/bin/python")
    assert render_python() == "/render/bin/python" and vllm_python() == sys.executable
    assert RenderSidecar(tmp_path, cpu=True, session_cache=False).build_argv()[0] == "/render/bin/python"
    assert VllmEngine(tmp_path, cpu=True).build_argv()[0] == sys.executable


def test_our_server_runs_without_its_cache_on_033(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """On 0.33 our server (capabilities, prefix hashes, Messages and Responses routes) runs, with the
    cache off and our source on the other venv's path; on a line it does not know, vLLM's own."""
    lines = {"/v33/bin/python": (0, 33), "/v34/bin/python": (0, 34)}
    monkeypatch.setattr(launch, "vllm_line", lambda python: lines.get(python, (0, 32)))
    render = RenderSidecar(tmp_path, cpu=True, python="/v33/bin/python")
    argv = render.build_argv()
    assert argv[:3] == ["/v33/bin/python", "-m", SESSION_MODULE] and "--no-session-cache" in argv
    assert "--session-cache-entries" not in argv
    assert render.build_env()["PYTHONPATH"].split(os.pathsep)[0] == str(launch.SOURCE_ROOT)
    with pytest.raises(ValueError, match="session cache"):
        RenderSidecar(tmp_path, cpu=True, python="/v33/bin/python", session_cache=True)
    assert RenderSidecar(tmp_path, cpu=True, python="/v34/bin/python").build_argv()[1:3] == ["-m", RENDER_MODULE]


@pytest.mark.parametrize(("version", "line"), [("0.32.0", (0, 32)), ("0.34.0rc1.dev12+gabc", (0, 34)),
                                               ("", None), (None, None), ("main", None)])
def test_line_of_a_version_string(version: str | None, line: tuple[int, int] | None) -> None:
    assert versions.line_of(version) == line


def test_lines_before_032_are_refused_and_untested_pairs_told() -> None:
    reason = versions.refusal("engine", "http://e:8000", "0.31.0")
    assert reason is not None and "engine http://e:8000 runs vLLM 0.31.0" in reason
    assert versions.refusal("engine", "http://e:8000", "0.32.1") is None
    assert versions.refusal("engine", "http://e:8000", None) is None      # does not say: taken as current
    assert not versions.untested("0.32.0", "0.32.2") and not versions.untested("0.33.0", "0.32.0")
    assert versions.untested("0.32.0", "0.33.0") and versions.untested("0.34.0", "0.32.0")
    assert not versions.untested(None, "0.34.0") and not versions.untested("0.31.0", "0.32.0")
