"""The whole serving stack on one machine, in the foreground: render sidecar, engine, coordinator.

``python deploy/local_stack.py`` (or ``python -m deploy.local_stack``, or ``make run``):

1. prepares the SmolLM2 model folder if needed (``token_engine.model_prep``);
2. starts the render sidecars (one process per ``render.urls`` entry, or the one ``render.url``) and an
   engine **in parallel**: ``--enable-scale-out`` by default (it loads the tokenizer, so structured
   outputs, forced tool calls and the native fallback work; ``--engine-mode tokens-only`` for the
   lighter engine without them, docs/engine-capabilities.md); each needs ~15-60 s, mostly
   ``import vllm``; their logs carry ``[render]``, ``[render-1]``, ... / ``[engine]`` prefixes;
3. when both answer ``/health``, starts ``python -m coordinator --config deploy/local/coordinator.yaml``
   and prints a ``ready:`` line with a curl example once its ``/ready`` answers 200.

Addresses come from the coordinator YAML, so ports are configured in one place. Ctrl-C / SIGTERM stops
everything, coordinator first (so no request reaches a half-stopped engine), then engine, then the
render sidecars, and exits 0. If any child dies on its own, the rest are stopped and the exit status is 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python deploy/local_stack.py` puts deploy/ first, not the root
    sys.path.insert(0, str(REPO_ROOT))

import yaml  # noqa: E402

from render_sidecar.launch import RenderSidecar, media_env  # noqa: E402
from token_engine.launch import EngineMode, VllmEngine  # noqa: E402
from token_engine.model_prep import MissingDependencyError, ModelPrepError, ensure_model  # noqa: E402
from token_engine.process import ManagedProcess, echo_line, wait_http_ready_all  # noqa: E402
from token_engine.vllm_env import DEFAULT_MAX_MODEL_LEN  # noqa: E402
from token_engine.vllm_server import VllmServer, stop_signals  # noqa: E402

DEFAULT_CONFIG = REPO_ROOT / "deploy" / "local" / "coordinator.yaml"
COORDINATOR_READY_TIMEOUT = 120.0

TOOL_PARSER = "hermes"  # the parser make test's tool stack runs with this model (tests/conftest.py)


def say(message: str) -> None:
    echo_line(f"[stack] {message}")


@dataclass(frozen=True)
class StackPlan:
    """What to start, derived from the coordinator YAML (defaults = the coordinator's own)."""

    renders: tuple[tuple[str, int], ...]   # (host, port) of each render sidecar process
    engine_host: str
    engine_port: int
    server_host: str
    server_port: int
    model_name: str
    aliases: tuple[str, ...]
    render_workers: int | None
    fetch_timeout_s: int = 3                # media.fetch_timeout_s: render's image download limit
    allow_private_urls: bool = False        # media.allow_private_urls (render follows redirects then)


def _host_port(url: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or default_port


def models_with_path(config_path: Path, model_dir: Path) -> dict[str, str]:
    """``COORD_MODELS`` with the prepared model folder as each model's ``path`` where the YAML sets
    none (the folder is machine-specific), so the local tokenizer can size requests when render is
    off or down (the render fallback and the native chain). Empty when the caller set COORD_MODELS."""
    if "COORD_MODELS" in os.environ:
        return {}
    data: dict[str, Any] = yaml.safe_load(config_path.read_text(encoding="utf-8")) or {}
    models = [{"path": str(model_dir), **m} for m in data.get("models") or [] if isinstance(m, dict)]
    return {"COORD_MODELS": json.dumps(models)} if models else {}


def load_plan(config_path: Path) -> StackPlan:
    """Read only the fields the stack needs; the coordinator validates the full file itself."""
    data: dict[str, Any] = yaml.safe_load(config_path.read_text(encoding="utf-8")) or {}
    render = data.get("render") or {}
    engines = data.get("engines") or [{"url": "http://127.0.0.1:8200"}]
    unions = [e for e in engines if e.get("role", "union") == "union"]
    if len(engines) != 1 or not unions:
        raise ValueError(f"{config_path}: the local stack runs exactly one engine with role union")
    models = data.get("models") or [{"name": "smollm2-135m-instruct", "aliases": ["gpt-4o-mini"]}]
    server = data.get("server") or {}
    urls = render.get("urls") or [render.get("url", "http://127.0.0.1:8100")]
    renders = tuple(_host_port(str(u), 8100) for u in urls)
    engine_host, engine_port = _host_port(str(unions[0]["url"]), 8200)
    workers = render.get("workers")
    return StackPlan(
        renders=renders,
        engine_host=engine_host,
        engine_port=engine_port,
        server_host=str(server.get("host", "127.0.0.1")),
        server_port=int(server.get("port", 8000)),
        model_name=str(models[0]["name"]),
        aliases=tuple(str(a) for a in models[0].get("aliases", [])),
        render_workers=int(workers) if workers is not None else None,
        fetch_timeout_s=int((data.get("media") or {}).get("fetch_timeout_s", 3)),
        allow_private_urls=bool((data.get("media") or {}).get("allow_private_urls", False)),
    )


def coordinator_available() -> bool:
    try:
        return importlib.util.find_spec("coordinator.__main__") is not None
    except (ImportError, ValueError):
        return False


def _curl_example(base: str, model: str) -> str:
    body = (
        f'{{"model":"{model}","messages":[{{"role":"user","content":"What is the capital of France?"}}],'
        '"max_tokens":20,"temperature":0}'
    )
    return f"curl -s {base}/chat/completions -H 'Content-Type: application/json' -d '{body}'"


def run_stack(
    config_path: Path, model_dir: Path, *, ready_timeout: float, log_dir: Path | None, with_coordinator: bool,
    engine_mode: EngineMode = "scale-out",
) -> int:
    """Start, supervise and stop the stack; returns the process exit status."""
    plan = load_plan(config_path)
    started_at = time.monotonic()

    def log_path(name: str) -> Path | None:
        return None if log_dir is None else log_dir / f"{name}.log"

    # The hermes tool parser on render (and on the engine's own API, the render fallback): agent
    # frameworks send tools with tool_choice auto or "required", which vLLM refuses without a parser.
    media = media_env(plan.fetch_timeout_s, plan.allow_private_urls)
    render_kwargs: dict[str, Any] = {"tool_call_parser": TOOL_PARSER, "enable_auto_tool_choice": True,
                                     "env_overrides": media}
    if plan.render_workers is not None:
        render_kwargs["renderer_num_workers"] = plan.render_workers
    render_names = ["render"] + [f"render-{i}" for i in range(1, len(plan.renders))]
    renders = [
        RenderSidecar(
            model_dir, host=host, port=port, served_model_name=plan.model_name,
            max_model_len=DEFAULT_MAX_MODEL_LEN, log_path=log_path(name), name=name, **render_kwargs,
        )
        for name, (host, port) in zip(render_names, plan.renders, strict=True)
    ]
    engine = VllmEngine(
        model_dir, host=plan.engine_host, port=plan.engine_port, served_model_name=plan.model_name,
        mode=engine_mode, max_model_len=DEFAULT_MAX_MODEL_LEN, log_path=log_path("engine"),
        extra_args=(["--enable-auto-tool-choice", "--tool-call-parser", TOOL_PARSER]
                    if engine_mode == "scale-out" else []),
    )
    coordinator: ManagedProcess | None = None
    servers: list[VllmServer] = [*renders, engine]
    failure: str | None = None

    with stop_signals() as stop:
        try:
            for server in servers:
                server.start()
                say(f"started {server.name} (pid {server.process.pid if server.process else '?'})")
            targets = [(s.process, f"{s.url}/health") for s in servers if s.process is not None]
            wait_http_ready_all(
                targets, ready_timeout, cancel=stop,
                on_ready=lambda proc, took: say(f"{proc.name} ready in {took:.1f}s"),
            )
            base = f"http://{plan.server_host}:{plan.server_port}"
            if with_coordinator and coordinator_available():
                env = {**os.environ, "COORD_CONFIG": str(config_path), "PYTHONUNBUFFERED": "1",
                       **models_with_path(config_path, model_dir)}
                coordinator = ManagedProcess(
                    [sys.executable, "-m", "coordinator", "--config", str(config_path)],
                    env=env, name="coordinator", cwd=REPO_ROOT, log_path=log_path("coordinator"),
                ).start()
                took = coordinator.wait_http_ready(f"{base}/ready", COORDINATOR_READY_TIMEOUT, cancel=stop)
                say(f"coordinator ready in {took:.1f}s")
                names = ", ".join((plan.model_name, *plan.aliases))
                say(f"ready: {base}/v1 (models: {names}; {time.monotonic() - started_at:.0f}s since launch)")
                say(f"try:   {_curl_example(base + '/v1', plan.model_name)}")
            else:
                reason = "disabled" if not with_coordinator else "module `coordinator` not found"
                say(f"ready without coordinator ({reason}): render {', '.join(r.url for r in renders)}, "
                    f"engine {engine.url}")
            say("Ctrl-C stops everything")
            children = [p for p in (*(s.process for s in servers), coordinator) if p is not None]
            while not stop.is_set():
                dead = [p for p in children if not p.is_running()]
                if dead:
                    failure = ", ".join(f"{p.name} exited with status {p.returncode}" for p in dead)
                    break
                time.sleep(0.2)
        except InterruptedError:
            pass  # a signal arrived while waiting for readiness
        except (OSError, RuntimeError, TimeoutError) as exc:  # RuntimeError covers ProcessExitedError
            failure = str(exc)
        finally:
            order = ([] if coordinator is None else ["coordinator"]) + ["engine"] + [r.name for r in renders]
            say(f"stopping: {', '.join(order)}")
            if coordinator is not None:
                coordinator.stop(timeout=10)
            engine.stop()
            for render in renders:
                render.stop()
    if failure is not None:
        say(f"FAILED: {failure}")
        return 1
    say("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="local_stack", description="Run the stack locally.")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="coordinator YAML")
    parser.add_argument("--model-dir", type=Path, default=None, help="skip preparation, use this folder")
    parser.add_argument("--cache-dir", type=Path, default=None, help="model cache (default .cache/models)")
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds for render + engine")
    parser.add_argument("--log-dir", type=Path, default=None, help="also write <name>.log files here")
    parser.add_argument("--no-coordinator", action="store_true", help="only render sidecar + engine")
    parser.add_argument("--engine-mode", choices=["scale-out", "tokens-only"], default="scale-out",
                        help="scale-out (default): tokenizer loaded, structured outputs and the native "
                        "fallback; tokens-only: lighter, neither (the coordinator learns which)")
    args = parser.parse_args(argv)
    try:
        model_dir = args.model_dir or ensure_model(args.cache_dir)
    except MissingDependencyError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except ModelPrepError as exc:
        print(f"error: model preparation failed: {exc}", file=sys.stderr, flush=True)
        return 1
    return run_stack(
        args.config.resolve(), model_dir, ready_timeout=args.ready_timeout, log_dir=args.log_dir,
        with_coordinator=not args.no_coordinator, engine_mode=args.engine_mode,
    )


if __name__ == "__main__":
    sys.exit(main())
