"""CLI: ``python -m token_engine --model DIR [--port 8200] [--scale-out] [...] [-- extra vLLM flags]``.

Runs one real vLLM engine in the foreground until SIGTERM/SIGINT, then stops its whole process tree.
Unknown flags are passed through to vLLM unchanged (e.g. ``--max-num-seqs 8``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from token_engine.launch import DEFAULT_PORT, DEFAULT_SERVED_MODEL_NAME, VllmEngine
from token_engine.vllm_env import DEFAULT_MAX_MODEL_LEN
from token_engine.vllm_server import DEFAULT_READY_TIMEOUT, run_foreground


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m token_engine", description="Run a real vLLM engine.")
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face model folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--served-model-name", default=DEFAULT_SERVED_MODEL_NAME)
    parser.add_argument("--scale-out", action="store_true",
                        help="--enable-scale-out (OpenAI API + scale-out routes) instead of --tokens-only")
    parser.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    parser.add_argument("--no-log-requests", action="store_true", help="drop --enable-log-requests")
    parser.add_argument("--kv-transfer-config", type=_json_object, default=None)
    parser.add_argument("--kv-events-config", type=_json_object, default=None)
    parser.add_argument("--kvcache-space-gib", type=int, default=None, help="CPU: VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--name", default=None, help="log prefix (default: engine)")
    parser.add_argument("--log-file", type=Path, default=None, help="also append the server log here")
    parser.add_argument("--ready-timeout", type=float, default=DEFAULT_READY_TIMEOUT)
    args, extra = parser.parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    engine = VllmEngine(
        args.model, host=args.host, port=args.port, served_model_name=args.served_model_name,
        mode="scale-out" if args.scale_out else "tokens-only", max_model_len=args.max_model_len,
        enable_log_requests=not args.no_log_requests, kv_transfer_config=args.kv_transfer_config,
        kv_events_config=args.kv_events_config, extra_args=extra, log_path=args.log_file,
        name=args.name, kvcache_space_gib=args.kvcache_space_gib,
    )
    return run_foreground(engine, args.ready_timeout)


if __name__ == "__main__":
    sys.exit(main())
