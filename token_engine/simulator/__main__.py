"""CLI: `python -m token_engine.simulator --port 8300 --model smollm2-135m-instruct --max-model-len 2048`.

Flags mirror the `vllm serve` ones where they exist, so a launcher can swap a real engine for a simulated one.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import uvicorn

from .app import build_app
from .config import SimConfig


def _int_list(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _kv_events_config(text: str) -> dict[str, Any]:
    """vLLM's `--kv-events-config` JSON as SimConfig fields (vLLM's defaults for keys left out)."""
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise argparse.ArgumentTypeError("--kv-events-config must be a JSON object")
    enabled = bool(raw.get("enable_kv_cache_events", False))
    publisher = raw.get("publisher") or ("zmq" if enabled else "null")
    if not enabled or publisher == "null":
        return {"kv_events_endpoint": None}
    if publisher != "zmq":
        raise argparse.ArgumentTypeError(f"unknown KV event publisher {publisher!r}")
    return {
        "kv_events_endpoint": raw.get("endpoint", "tcp://*:5557"),
        "kv_events_topic": raw.get("topic", ""),
        "kv_events_replay_endpoint": raw.get("replay_endpoint"),
    }


def _ec_transfer_config(text: str) -> dict[str, Any]:
    """vLLM's `--ec-transfer-config` JSON as SimConfig fields (ECExampleConnector only)."""
    raw = json.loads(text)
    if not isinstance(raw, dict) or raw.get("ec_connector") != "ECExampleConnector":
        raise argparse.ArgumentTypeError("--ec-transfer-config: only ECExampleConnector is simulated")
    path = (raw.get("ec_connector_extra_config") or {}).get("shared_storage_path")
    if not path:  # vLLM falls back to a fixed system folder; a simulator store is always named
        raise argparse.ArgumentTypeError(
            "--ec-transfer-config: give ec_connector_extra_config.shared_storage_path")
    return {"ec_role": raw.get("ec_role"), "ec_storage_path": path}


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, SimConfig]:
    p = argparse.ArgumentParser(prog="python -m token_engine.simulator", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--model", "--served-model-name", dest="model", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--decode-ms", type=float, default=None, help="milliseconds per generated token")
    p.add_argument("--ttft-ms", type=float, default=None, help="base time to first token")
    p.add_argument(
        "--prefill-us-per-token", type=float, default=None, help="microseconds per uncached prompt token"
    )
    p.add_argument("--mode", choices=["echo", "random", "script", "context"], default=None)
    p.add_argument(
        "--script", type=_int_list, default=None, help="comma-separated token ids for --mode script"
    )
    p.add_argument("--eos-token-id", type=int, default=None)
    p.add_argument("--kv-role", choices=["prefill", "decode", "both"], default=None)
    p.add_argument("--kv-connector", choices=["nixl", "layerwise"], default=None,
                   help="layerwise: trigger P/D (the decode engine calls the metaserver URL)")
    p.add_argument("--engine-id", default=None, help="remote_engine_id in kv_transfer_params")
    p.add_argument("--max-concurrency", "--max-num-seqs", dest="max_concurrency", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--capacity-blocks", type=int, default=None)
    p.add_argument("--kv-offload-blocks", type=int, default=None,
                   help="a CPU offload tier of this many blocks (vLLM's OffloadingConnector; its KV events "
                   "say medium CPU)")
    p.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        help='vLLM\'s flag, e.g. \'{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",'
        '"topic":"kv"}\'',
    )
    p.add_argument("--ec-transfer-config", type=_ec_transfer_config, default=None,
                   help='vLLM\'s flag, e.g. \'{"ec_connector":"ECExampleConnector","ec_role":"ec_producer",'
                   '"ec_connector_extra_config":{"shared_storage_path":"DIR"}}\' (DIR shared by the engines)')
    p.add_argument("--encode-us-per-token", type=float, default=None,
                   help="vision-encoder microseconds per image placeholder token")
    p.add_argument("--kv-lease-s", type=float, default=None, help="NixlConnector kv_lease_duration")
    p.add_argument(
        "--advertise-peer-url",
        action="store_true",
        default=None,
        help="add sim_peer_url to prefill kv_transfer_params (decode simulators then release blocks)",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--config-json", default=None, help="SimConfig as JSON (flags override it)")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)

    base: dict[str, Any] = json.loads(args.config_json) if args.config_json else {}
    overrides: dict[str, Any] = {
        "model": args.model,
        "max_model_len": args.max_model_len,
        "decode_s_per_token": None if args.decode_ms is None else args.decode_ms / 1000.0,
        "ttft_s": None if args.ttft_ms is None else args.ttft_ms / 1000.0,
        "prefill_s_per_token": None if args.prefill_us_per_token is None else args.prefill_us_per_token / 1e6,
        "mode": args.mode,
        "script_tokens": args.script,
        "eos_token_id": args.eos_token_id,
        "kv_role": args.kv_role,
        "kv_connector": args.kv_connector,
        "engine_id": args.engine_id,
        "max_concurrency": args.max_concurrency,
        "block_size": args.block_size,
        "capacity_blocks": args.capacity_blocks,
        "offload_blocks": args.kv_offload_blocks,
        "api_key": args.api_key,
        "seed": args.seed,
        "kv_lease_s": args.kv_lease_s,
        "advertise_peer_url": args.advertise_peer_url,
        "encode_s_per_image_token": None if args.encode_us_per_token is None
        else args.encode_us_per_token / 1e6,
    }
    base.update({k: v for k, v in overrides.items() if v is not None})
    if args.kv_events_config is not None:
        base.update(args.kv_events_config)
    if args.ec_transfer_config is not None:
        base.update(args.ec_transfer_config)
    if args.max_concurrency is not None:
        base.setdefault("max_num_seqs", args.max_concurrency)
    return args, SimConfig(**base)


def main(argv: Sequence[str] | None = None) -> None:
    args, config = parse_args(argv)
    uvicorn.run(build_app(config), host=args.host, port=args.port, log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    main()
