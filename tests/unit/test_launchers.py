"""The vLLM command lines and environments the launchers build (no vLLM process is started)."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest

from render_sidecar.launch import SESSION_MODULE, RenderSidecar
from token_engine.launch import VllmEngine
from token_engine.vllm_env import ENGINE_MODULE, RENDER_MODULE, is_cpu_build, vllm_env


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_engine_cpu_argv_has_model_flag_numerics_and_request_logging(tmp_path: Path) -> None:
    argv = VllmEngine(tmp_path, port=8299, cpu=True).build_argv()
    assert argv[:3] == [sys.executable, "-m", ENGINE_MODULE]
    assert _flag(argv, "--model") == str(tmp_path)
    assert str(tmp_path) not in argv[3:argv.index("--model")]  # never positional
    assert _flag(argv, "--dtype") == "float32" and "--enforce-eager" in argv
    assert _flag(argv, "--distributed-executor-backend") == "uni"   # one process fewer per boot
    assert _flag(argv, "--max-model-len") == "2048" and _flag(argv, "--port") == "8299"
    assert "--tokens-only" in argv and "--enable-scale-out" not in argv
    assert "--enable-log-requests" in argv


def test_engine_gpu_argv_drops_cpu_only_flags(tmp_path: Path) -> None:
    argv = VllmEngine(tmp_path, cpu=False, mode="scale-out", enable_log_requests=False).build_argv()
    assert "--dtype" not in argv and "--enforce-eager" not in argv
    assert "--distributed-executor-backend" not in argv   # GPUs: vLLM's choice (tensor parallel needs mp)
    assert "--enable-scale-out" in argv and "--tokens-only" not in argv
    assert "--enable-log-requests" not in argv


def test_engine_kv_configs_are_passed_as_json(tmp_path: Path) -> None:
    kv = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"shared_storage_path": "kv-store"}}
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}
    argv = VllmEngine(tmp_path, cpu=True, kv_transfer_config=kv, kv_events_config=events,
                      extra_args=["--max-num-seqs", "4"]).build_argv()
    assert json.loads(_flag(argv, "--kv-transfer-config")) == kv
    assert json.loads(_flag(argv, "--kv-events-config")) == events
    assert argv[-2:] == ["--max-num-seqs", "4"]


def test_engine_rejects_unknown_mode(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode"):
        VllmEngine(tmp_path, mode="both")  # type: ignore[arg-type]


def test_render_argv_keeps_max_model_len_and_parsers(tmp_path: Path) -> None:
    argv = RenderSidecar(tmp_path, max_model_len=1024, tool_call_parser="hermes",
                         enable_auto_tool_choice=True, reasoning_parser="deepseek_r1", cpu=True).build_argv()
    assert argv[:3] == [sys.executable, "-m", SESSION_MODULE]  # this venv: our server with the cache
    assert _flag(argv, "--model") == str(tmp_path)
    assert _flag(argv, "--max-model-len") == "1024"
    assert _flag(argv, "--served-model-name") == "smollm2-135m-instruct"
    assert _flag(argv, "--tool-call-parser") == "hermes" and "--enable-auto-tool-choice" in argv
    assert _flag(argv, "--reasoning-parser") == "deepseek_r1"
    assert "--renderer-num-workers" in argv and "--disable-uvicorn-access-log" in argv
    assert "--dtype" not in argv  # render loads no weights


def test_render_without_session_cache_is_vllms_own_entry(tmp_path: Path) -> None:
    argv = RenderSidecar(tmp_path, cpu=True, session_cache=False).build_argv()
    assert argv[:3] == [sys.executable, "-m", RENDER_MODULE]
    cached = RenderSidecar(tmp_path, cpu=True, session_cache_entries=7, session_cache_bytes=4096).build_argv()
    assert _flag(cached, "--session-cache-entries") == "7" and _flag(cached, "--session-cache-bytes") == "4096"


def test_render_session_cache_refused_on_another_interpreter(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="session cache"):
        RenderSidecar(tmp_path, cpu=True, python="/other/bin/python", session_cache=True)


def test_render_refuses_auto_tool_choice_without_parser(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tool_call_parser"):
        RenderSidecar(tmp_path, enable_auto_tool_choice=True)


def test_cpu_env_sets_the_quirk_fixes_and_respects_user_values() -> None:
    env = vllm_env({"PATH": "/bin"}, cpu=True)
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"   # else the CPU platform undoes ``uni``
    assert env["PATH"] == "/bin"
    user = {"VLLM_CPU_KVCACHE_SPACE": "4"}
    assert vllm_env(user, cpu=True)["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert vllm_env(user, cpu=True, kvcache_space_gib=2)["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_gpu_env_has_no_cpu_settings() -> None:
    env = vllm_env({}, cpu=False)
    assert "VLLM_TARGET_DEVICE" not in env and "VLLM_CPU_KVCACHE_SPACE" not in env
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert env["HF_HUB_OFFLINE"] == "1"


def test_device_detection_overrides() -> None:
    assert is_cpu_build({"LLMC_VLLM_DEVICE": "gpu", "VLLM_TARGET_DEVICE": "cpu"}) is False
    assert is_cpu_build({"VLLM_TARGET_DEVICE": "cpu"}) is True
    assert is_cpu_build({"VLLM_TARGET_DEVICE": "cuda"}) is False


def test_start_refuses_a_folder_that_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model_prep"):
        VllmEngine(tmp_path, cpu=True, echo=False).start()


def test_start_fails_at_once_when_the_port_is_taken(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        sidecar = RenderSidecar(tmp_path, port=port, cpu=True, echo=False)
        started = time.monotonic()
        with pytest.raises(OSError, match="in use"):
            sidecar.start()
        assert time.monotonic() - started < 2
        assert sidecar.process is None
