"""Start vLLM's render server ("render sidecar") as a supervised child process.

The coordinator never tokenizes itself: it sends chat/completion requests to this sidecar to get a
``GenerateRequest`` (token ids + sampling params), and sends engine output back for derendering. The
sidecar must use the same tokenizer, ``--max-model-len`` (render computes the default ``max_tokens``
from it) and parser flags as the engines' model, so all of those are explicit parameters here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from token_engine.vllm_env import DEFAULT_MAX_MODEL_LEN, render_base_argv, render_python, vllm_line
from token_engine.vllm_server import VllmServer

DEFAULT_PORT = 8100
DEFAULT_SERVED_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_RENDERER_WORKERS = 2
SESSION_MODULE = "render_sidecar.server"  # vLLM's render server + the parser-session cache
SESSION_CACHE_LINE = (0, 32)             # the vLLM line whose internals the cache drives
SERVER_LINES = ((0, 32), (0, 33))        # lines our server runs on (0.33: without the cache)
# What our server imports besides vLLM: this package and ``coordinator.contracts`` (standard library
# and msgspec only), found through PYTHONPATH by another line's interpreter.
SOURCE_ROOT = Path(__file__).resolve().parent.parent


def media_env(fetch_timeout_s: int, allow_private_urls: bool) -> dict[str, str]:
    """The environment that holds a sidecar's image downloads to the coordinator's ``media`` settings.

    vLLM retries a failed download with a timeout four times longer each try
    (``VLLM_MEDIA_FETCH_MAX_RETRIES``, default 3: 3 s, 12 s, 48 s), which outlasts any render timeout;
    one try keeps a slow URL the client's 400 instead of the coordinator's 504. A redirect may point
    where the coordinator's address check never looked, so redirects are not followed unless private
    addresses are allowed anyway (docs/multimodal.md)."""
    return {"VLLM_IMAGE_FETCH_TIMEOUT": str(fetch_timeout_s), "VLLM_MEDIA_FETCH_MAX_RETRIES": "1",
            "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "1" if allow_private_urls else "0"}


class RenderSidecar(VllmServer):
    """Our render server (``python -m render_sidecar.server``: vLLM's render entry point plus the
    parser-session cache, docs/parsers.md) or vLLM's own
    (``python -m vllm.entrypoints.launchers.render.entry``), with CPU-safe settings.

    ``session_cache``: None picks ours with the cache where the cache can run (vLLM 0.32), ours without
    it on the other lines ours runs on (``SERVER_LINES``: 0.33, whose derender internals the cache's
    shape check refuses), and vLLM's on any other line; False always picks vLLM's. The interpreter is
    ``python``, else ``$LLMC_RENDER_PYTHON``, else ``$LLMC_VLLM_PYTHON``, else this venv's.

    ``start()`` spawns, ``wait_ready()`` waits for ``/health`` 200 (about 60 s on 2 cores, mostly
    ``import vllm``), ``stop()`` stops the process group; as a context manager it starts on enter
    and stops on exit.
    """

    name = "render"

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        served_model_name: str = DEFAULT_SERVED_MODEL_NAME,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        tool_call_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
        reasoning_parser: str | None = None,
        extra_args: Sequence[str] = (),
        log_path: str | os.PathLike[str] | None = None,
        echo: bool = True,
        *,
        renderer_num_workers: int = DEFAULT_RENDERER_WORKERS,
        name: str | None = None,
        python: str | None = None,
        cpu: bool | None = None,
        env_overrides: dict[str, str] | None = None,
        session_cache: bool | None = None,
        session_cache_entries: int | None = None,
        session_cache_bytes: int | None = None,
    ) -> None:
        if enable_auto_tool_choice and not tool_call_parser:
            raise ValueError("enable_auto_tool_choice requires tool_call_parser (vLLM refuses it otherwise)")
        python = render_python(python)
        super().__init__(
            model_dir, host=host, port=port, extra_args=extra_args, log_path=log_path, echo=echo,
            python=python, cpu=cpu, env_overrides=env_overrides,
        )
        if name:
            self.name = name  # e.g. "render-1" when several sidecars share one terminal
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.tool_call_parser = tool_call_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.reasoning_parser = reasoning_parser
        self.renderer_num_workers = renderer_num_workers
        available = session_cache_available(python)
        if session_cache and not available:
            raise ValueError("the parser-session cache needs this venv's interpreter and vLLM "
                             f"{SESSION_CACHE_LINE[0]}.{SESSION_CACHE_LINE[1]}")
        self.session_cache = available if session_cache is None else session_cache
        # Ours runs without the cache on the other lines it knows, unless vLLM's was asked for.
        self.ours = self.session_cache or (session_cache is None and server_available(python))
        self.session_cache_entries = session_cache_entries
        self.session_cache_bytes = session_cache_bytes

    def build_argv(self) -> list[str]:
        argv = render_base_argv(self.model_dir, self.host, self.port, self.python)
        if self.ours:
            index = argv.index("--model")
            argv = [render_python(self.python), "-m", SESSION_MODULE, *argv[index:]]
            if not self.session_cache:
                argv.append("--no-session-cache")
        if self.session_cache:
            if self.session_cache_entries is not None:
                argv += ["--session-cache-entries", str(self.session_cache_entries)]
            if self.session_cache_bytes is not None:
                argv += ["--session-cache-bytes", str(self.session_cache_bytes)]
        argv += [
            "--served-model-name", self.served_model_name,
            "--max-model-len", str(self.max_model_len),
            "--renderer-num-workers", str(self.renderer_num_workers),
            "--disable-uvicorn-access-log",
        ]
        if self.tool_call_parser:
            argv += ["--tool-call-parser", self.tool_call_parser]
        if self.enable_auto_tool_choice:
            argv.append("--enable-auto-tool-choice")
        if self.reasoning_parser:
            argv += ["--reasoning-parser", self.reasoning_parser]
        return argv + list(self.extra_args)


    def build_env(self) -> dict[str, str]:
        env = super().build_env()
        if self.ours and self.python != sys.executable:  # another line's venv: our source on its path
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SOURCE_ROOT), env.get("PYTHONPATH")) if p)
        return env


def server_available(python: str | None = None) -> bool:
    """Our server module runs on that interpreter's vLLM line (``SERVER_LINES``)."""
    return vllm_line(render_python(python)) in SERVER_LINES


def session_cache_available(python: str | None = None) -> bool:
    """The parser-session cache runs on the one line whose derender internals it drives."""
    return vllm_line(render_python(python)) == SESSION_CACHE_LINE
