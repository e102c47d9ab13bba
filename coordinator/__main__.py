"""``python -m coordinator [--config PATH]``: run the coordinator with uvicorn."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from coordinator.api.server import uvicorn_config
from coordinator.app import build_app
from coordinator.config import load_settings
from coordinator.observability.events import JsonFormatter


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="coordinator", description=__doc__)
    parser.add_argument("--config", help="YAML config file (also COORD_CONFIG)")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    args = parser.parse_args(argv)
    settings = load_settings(args.config)
    host = args.host or settings.server.host
    port = args.port or settings.server.port
    logging.basicConfig(level=settings.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.server.log_format == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per derender call is too much
    config = uvicorn_config(build_app(settings), settings, host=host, port=port,
                            log_level=settings.server.log_level, access_log=False)
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
