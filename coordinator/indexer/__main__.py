"""``python -m coordinator.indexer [--config PATH] [--listen ADDRESS]``: a KV indexer service that
several coordinator replicas share (``scheduling.prefix.indexer.mode: service``). It reads the same
config tree as the coordinator: ``scheduling.prefix`` says what it indexes, and
``scheduling.prefix.indexer.listen`` where it listens; the replicas tell it their engines' KV-event
endpoints when they connect."""

from __future__ import annotations

import argparse
import asyncio

from coordinator.config import load_settings
from coordinator.indexer.process import serve
from coordinator.runtime.server import configure_logging


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="coordinator.indexer", description=__doc__)
    parser.add_argument("--config", help="YAML config file (also COORD_CONFIG)")
    parser.add_argument("--listen", action="append",
                        help="tcp://host:port or unix:/path (repeatable; default: the config's listen)")
    args = parser.parse_args(argv)
    settings = load_settings(args.config)
    configure_logging(settings, role="indexer")
    addresses = args.listen or [settings.scheduling.prefix.indexer.listen]

    def started(bound: list[str]) -> None:
        print(f"KV indexer listening on {', '.join(bound)}", flush=True)

    asyncio.run(serve(settings, addresses, started))


if __name__ == "__main__":
    main()
