"""Engines found by resolving a DNS name, e.g. a Kubernetes headless Service.

Why DNS: a headless Service answers one A/AAAA record per *ready* pod, so scaling the engine Deployment or
a pod failing its readiness probe changes the engine set without a coordinator restart or an API client
for the cluster.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable

from coordinator.config import DiscoverySettings, EngineSettings

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""``(name, port) -> IP addresses``; raises ``OSError`` when the name does not resolve."""


async def resolve_addresses(name: str, port: int) -> list[str]:
    """All addresses ``name`` resolves to, through the event loop's (threaded) ``getaddrinfo``."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def _host(ip: str) -> str:
    """An address as it appears in a URL host (IPv6 in brackets)."""
    try:
        v6 = isinstance(ipaddress.ip_address(ip.split("%", 1)[0]), ipaddress.IPv6Address)
    except ValueError:
        return ip
    return f"[{ip}]" if v6 else ip


class DnsDiscovery:
    """Turns the records of ``settings.dns_name`` into engine settings.

    A failed resolution keeps the last known set: a DNS hiccup must not empty the fleet (probes still
    take dead engines out of rotation).
    """

    def __init__(self, settings: DiscoverySettings, resolver: Resolver | None = None) -> None:
        if settings.dns_name is None:
            raise ValueError("DnsDiscovery needs discovery.dns_name")
        self._settings = settings
        self._name = settings.dns_name
        self._resolve = resolver or resolve_addresses
        self._last: list[EngineSettings] = []
        self._failing = False

    @property
    def interval_s(self) -> float:
        return self._settings.interval_s

    @property
    def engines(self) -> list[EngineSettings]:
        """The last successfully discovered set (empty before the first success)."""
        return list(self._last)

    def engines_for(self, addresses: list[str]) -> list[EngineSettings]:
        s = self._settings
        out: list[EngineSettings] = []
        for ip in sorted(set(addresses)):
            host = _host(ip)
            out.append(EngineSettings(
                url=f"{s.scheme}://{host}:{s.port}",
                role=s.role,
                model=s.model,
                pd_protocol=s.pd_protocol,
                tokenizer=s.tokenizer,
                native_api=s.native_api,
                api_key=s.api_key,
                max_loras=s.max_loras,
                kv_events=f"tcp://{host}:{s.kv_events_port}" if s.kv_events_port is not None else None,
                kv_events_replay=(f"tcp://{host}:{s.kv_events_replay_port}"
                                  if s.kv_events_replay_port is not None else None),
            ))
        return out

    async def discover(self) -> list[EngineSettings]:
        """Resolve once; on failure log (once per outage) and return the last known set."""
        try:
            addresses = await self._resolve(self._name, self._settings.port)
        except (OSError, TimeoutError) as exc:   # socket.gaierror is an OSError
            if not self._failing:
                log.warning("engine discovery: cannot resolve %s (%s); keeping %d known engine(s)",
                            self._name, exc, len(self._last))
            self._failing = True
            return self.engines
        if self._failing:
            log.info("engine discovery: %s resolves again", self._name)
        self._failing = False
        found = self.engines_for(addresses)
        if [e.url for e in found] != [e.url for e in self._last]:
            log.info("engine discovery: %s → %s", self._name, [e.url for e in found] or "no addresses")
        self._last = found
        return self.engines
