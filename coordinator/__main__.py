"""``python -m coordinator [--config PATH]``: run the coordinator with uvicorn.

SIGTERM (or Ctrl-C) drains it: ``/ready`` turns 503, the listener closes after
``server.drain_delay_s``, in-flight work gets ``server.drain_timeout_s``, then it exits 0; a second
signal exits at once (docs/shutdown.md). With ``server.workers`` > 1 this process supervises that many
worker processes on one port (coordinator/runtime/workers.py)."""

from __future__ import annotations

import argparse

from coordinator.app import build_app
from coordinator.config import load_settings
from coordinator.runtime.server import configure_logging, draining_server, uvicorn_config
from coordinator.runtime.workers import Supervisor


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="coordinator", description=__doc__)
    parser.add_argument("--config", help="YAML config file (also COORD_CONFIG)")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    args = parser.parse_args(argv)
    settings = load_settings(args.config)
    host = args.host or settings.server.host
    port = settings.server.port if args.port is None else args.port  # 0: any free port
    configure_logging(settings)
    if settings.server.workers > 1 or settings.indexer_mode() == "pod":   # pod: the indexer's process too
        raise SystemExit(Supervisor(settings, host, port).run())
    app = build_app(settings)
    # uvicorn's own graceful timeout is the backstop after the drain (which has its own deadline).
    config = uvicorn_config(app, settings, host=host, port=port, log_level=settings.server.log_level,
                            access_log=False, timeout_graceful_shutdown=5)
    draining_server(app, config).run()


if __name__ == "__main__":
    main()
