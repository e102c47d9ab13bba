"""CLI: ``python -m render_sidecar --model DIR [--port 8100] [...] [-- extra vLLM flags]``.

Runs the sidecar in the foreground until SIGTERM/SIGINT, then stops it cleanly. Unknown flags are
passed through to vLLM unchanged (e.g. ``--chat-template FILE``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from render_sidecar.launch import (
    DEFAULT_PORT,
    DEFAULT_RENDERER_WORKERS,
    DEFAULT_SERVED_MODEL_NAME,
    RenderSidecar,
)
from token_engine.vllm_env import DEFAULT_MAX_MODEL_LEN
from token_engine.vllm_server import DEFAULT_READY_TIMEOUT, run_foreground


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m render_sidecar", description="Run vLLM's render server.")
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face model folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--served-model-name", default=DEFAULT_SERVED_MODEL_NAME)
    parser.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN,
                        help="must equal the engines' value (render derives max_tokens from it)")
    parser.add_argument("--tool-call-parser", default=None)
    parser.add_argument("--enable-auto-tool-choice", action="store_true")
    parser.add_argument("--reasoning-parser", default=None)
    parser.add_argument("--renderer-num-workers", type=int, default=DEFAULT_RENDERER_WORKERS)
    parser.add_argument("--session-cache", action=argparse.BooleanOptionalAction, default=None,
                        help="parser-session cache (default: on where it can run, docs/parsers.md)")
    parser.add_argument("--log-file", type=Path, default=None, help="also append the server log here")
    parser.add_argument("--ready-timeout", type=float, default=DEFAULT_READY_TIMEOUT)
    args, extra = parser.parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    try:
        sidecar = RenderSidecar(
            args.model, host=args.host, port=args.port, served_model_name=args.served_model_name,
            max_model_len=args.max_model_len, tool_call_parser=args.tool_call_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice, reasoning_parser=args.reasoning_parser,
            extra_args=extra, log_path=args.log_file, renderer_num_workers=args.renderer_num_workers,
            session_cache=args.session_cache,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return run_foreground(sidecar, args.ready_timeout)


if __name__ == "__main__":
    sys.exit(main())
