"""Start vLLM's render server ("render sidecar") as a supervised child process.

The coordinator never tokenizes itself: it sends chat/completion requests to this sidecar to get a
``GenerateRequest`` (token ids + sampling params), and sends engine output back for derendering. The
sidecar must use the same tokenizer, ``--max-model-len`` (render computes the default ``max_tokens``
from it) and parser flags as the engines' model, so all of those are explicit parameters here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from token_engine.vllm_env import DEFAULT_MAX_MODEL_LEN, render_base_argv
from token_engine.vllm_server import VllmServer

DEFAULT_PORT = 8100
DEFAULT_SERVED_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_RENDERER_WORKERS = 2


class RenderSidecar(VllmServer):
    """``python -m vllm.entrypoints.launchers.render.entry --model DIR ...`` with CPU-safe settings.

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
    ) -> None:
        if enable_auto_tool_choice and not tool_call_parser:
            raise ValueError("enable_auto_tool_choice requires tool_call_parser (vLLM refuses it otherwise)")
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

    def build_argv(self) -> list[str]:
        argv = render_base_argv(self.model_dir, self.host, self.port, self.python)
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
