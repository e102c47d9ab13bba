"""Start a real vLLM engine (token-in/token-out) as a supervised child process.

Two modes, because the coordinator needs both:

* ``tokens-only`` (default): ``--tokens-only``, the "disaggregated everything" engine. No tokenizer is
  loaded, so it serves only ``/inference/v1/generate`` (+ abort) and rejects stop strings and text
  output; the coordinator renders/derenders through the sidecar and matches stop strings itself.
* ``scale-out``: ``--enable-scale-out``, a normal OpenAI server that also exposes the scale-out routes;
  used for A/B comparisons with the coordinator and as the native fallback path. Lines before the
  ``launchers`` entry modules have no such flag (their scale-out routes are always on), so it is left
  out there (``token_engine.vllm_env.scale_out_flags``).

The interpreter is ``python`` if given, else ``$LLMC_VLLM_PYTHON``, else this venv's: that is how
``make compat-vllm`` runs engines from another vLLM line's venv (docs/versions.md).

``--enable-log-requests`` is on by default: tests assert on the engine's "Aborted request" lines to
prove that a client disconnect really cancelled work inside the engine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from token_engine.vllm_env import DEFAULT_MAX_MODEL_LEN, engine_base_argv, scale_out_flags, vllm_env
from token_engine.vllm_server import VllmServer

EngineMode = Literal["tokens-only", "scale-out"]
DEFAULT_PORT = 8200
DEFAULT_SERVED_MODEL_NAME = "smollm2-135m-instruct"
MODE_FLAGS: dict[str, str] = {"tokens-only": "--tokens-only", "scale-out": "--enable-scale-out"}


class VllmEngine(VllmServer):
    """``python -m vllm.entrypoints.launchers.api_server.entry --model DIR ...``.

    On CPU it adds ``--dtype float32 --enforce-eager`` and ``VLLM_CPU_KVCACHE_SPACE``; on GPU neither
    (see ``token_engine.vllm_env``). ``kv_transfer_config`` / ``kv_events_config`` /
    ``ec_transfer_config`` (``ec_store_config``) are passed as JSON,
    e.g. ``{"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_connector_extra_config":
    {"shared_storage_path": DIR}}`` for P/D on CPU or ``{"kv_connector": "NixlConnector", ...}`` on GPU.
    """

    name = "engine"

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        served_model_name: str = DEFAULT_SERVED_MODEL_NAME,
        mode: EngineMode = "tokens-only",
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        enable_log_requests: bool = True,
        kv_transfer_config: Mapping[str, Any] | None = None,
        kv_events_config: Mapping[str, Any] | None = None,
        ec_transfer_config: Mapping[str, Any] | None = None,
        extra_args: Sequence[str] = (),
        log_path: str | os.PathLike[str] | None = None,
        echo: bool = True,
        *,
        name: str | None = None,
        kvcache_space_gib: int | None = None,
        python: str | None = None,
        cpu: bool | None = None,
        env_overrides: dict[str, str] | None = None,
    ) -> None:
        if mode not in MODE_FLAGS:
            raise ValueError(f"mode must be one of {sorted(MODE_FLAGS)}, not {mode!r}")
        super().__init__(
            model_dir, host=host, port=port, extra_args=extra_args, log_path=log_path, echo=echo,
            python=python, cpu=cpu, env_overrides=env_overrides,
        )
        if name:
            self.name = name  # e.g. "prefill"/"decode" when several engines share one terminal
        self.served_model_name = served_model_name
        self.mode = mode
        self.max_model_len = max_model_len
        self.enable_log_requests = enable_log_requests
        self.kv_transfer_config = dict(kv_transfer_config) if kv_transfer_config is not None else None
        self.ec_transfer_config = dict(ec_transfer_config) if ec_transfer_config is not None else None
        self.kv_events_config = dict(kv_events_config) if kv_events_config is not None else None
        self.kvcache_space_gib = kvcache_space_gib

    def build_argv(self) -> list[str]:
        argv = engine_base_argv(self.model_dir, self.host, self.port, cpu=self.cpu, python=self.python)
        argv += [
            "--served-model-name", self.served_model_name,
            "--max-model-len", str(self.max_model_len),
            *([MODE_FLAGS[self.mode]] if self.mode == "tokens-only" else scale_out_flags(self.python)),
        ]
        if self.enable_log_requests:
            argv.append("--enable-log-requests")
        if self.kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(self.kv_transfer_config, separators=(",", ":"))]
        if self.ec_transfer_config is not None:
            argv += ["--ec-transfer-config", json.dumps(self.ec_transfer_config, separators=(",", ":"))]
        if self.kv_events_config is not None:
            argv += ["--kv-events-config", json.dumps(self.kv_events_config, separators=(",", ":"))]
        return argv + list(self.extra_args)

    def build_env(self) -> dict[str, str]:
        return vllm_env(cpu=self.cpu, kvcache_space_gib=self.kvcache_space_gib, overrides=self.env_overrides)


def ec_store_config(role: str, store: str | os.PathLike[str]) -> dict[str, Any]:
    """vLLM's ``--ec-transfer-config`` for encoder disaggregation over a shared directory
    (ECExampleConnector, the connector vLLM 0.32 ships that runs on CPU): ``ec_producer`` for an
    encode engine, ``ec_consumer`` for the engines that answer."""
    return {"ec_connector": "ECExampleConnector", "ec_role": role,
            "ec_connector_extra_config": {"shared_storage_path": str(store)}}
