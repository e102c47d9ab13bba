"""Lifetime of a P/D prefill's KV blocks, modelled on vLLM 0.32's NixlConnector (pull mode).

Why: a coordinator that splits prefill and decode must know that a finished prefill leg still holds KV
memory on the prefill engine until the decode engine pulls it or a lease runs out; a prefill whose
decode leg never comes wastes capacity for the whole lease. What vLLM does (read from the installed
source, see docs/simulator.md "P/D transfer lifetime"):

* `request_finished` on the P side of a leg that stopped or hit its length returns
  `delay_free_blocks=True`: the blocks stay allocated (and count as used KV cache) under a lease of
  `kv_lease_duration` seconds (30 by default).
* They are freed when the decode side notifies that it has read them (or that its request ended before
  reading them), or when the lease expires (`_reap_expired_send_leases`).
* Aborting the finished prefill request frees nothing: `Scheduler.finish_requests` skips requests that
  are already finished, and the API server no longer maps the external id to it.

The simulator has no NIXL side channel, so "the decode side notifies" is an HTTP call a decode simulator
makes to `POST {sim_peer_url}/sim/kv_transfer/consume` when the prefill advertised `sim_peer_url`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

logger = logging.getLogger(__name__)

ReleaseReason = Literal["consumed", "expired"]
CONSUME_PATH = "/sim/kv_transfer/consume"


@dataclass
class PinnedTransfer:
    """A finished prefill's blocks, held for a decode engine to pull."""

    remote_request_id: str
    """The prefill's internal request id, as sent in `kv_transfer_params.remote_request_id`."""
    request_id: str
    """The prefill's engine (external) request id."""
    blocks: int
    expires_at: float


@dataclass
class TransferPins:
    """Pinned prefill blocks by `remote_request_id`, released on consume or lease expiry.

    Expiry is applied lazily, whenever the pins are read, which is indistinguishable from a timer for
    anything that observes them (state, metrics, KV usage).
    """

    lease_s: float
    clock: Callable[[], float] = time.monotonic
    released: dict[ReleaseReason, int] = field(default_factory=lambda: {"consumed": 0, "expired": 0})
    _pins: dict[str, PinnedTransfer] = field(default_factory=dict)

    def pin(self, remote_request_id: str, request_id: str, blocks: int) -> None:
        self._pins[remote_request_id] = PinnedTransfer(
            remote_request_id, request_id, blocks, self.clock() + self.lease_s
        )

    def consume(self, remote_request_id: str) -> PinnedTransfer | None:
        """The decode side has pulled the blocks (or gave up on them); None if not pinned (any more)."""
        self._expire()
        pinned = self._pins.pop(remote_request_id, None)
        if pinned is not None:
            self.released["consumed"] += 1
        return pinned

    def _expire(self) -> None:
        now = self.clock()
        for rid in [rid for rid, p in self._pins.items() if now >= p.expires_at]:
            del self._pins[rid]
            self.released["expired"] += 1

    @property
    def pinned(self) -> list[PinnedTransfer]:
        self._expire()
        return list(self._pins.values())

    @property
    def pinned_blocks(self) -> int:
        return sum(p.blocks for p in self.pinned)

    def snapshot(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [
            {
                "remote_request_id": p.remote_request_id,
                "request_id": p.request_id,
                "blocks": p.blocks,
                "expires_in_s": round(max(0.0, p.expires_at - now), 3),
            }
            for p in self.pinned
        ]


class PeerNotifier:
    """Decode side: tells a prefill simulator that its blocks were pulled, best effort, in the background.

    Failures are logged and forgotten, as a lost NIXL notification would be: the prefill's lease still
    frees the blocks.
    """

    def __init__(self, timeout_s: float = 2.0) -> None:
        self._timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()
        self.sent = 0
        self.failed = 0

    def notify(self, peer_url: str, remote_request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._post(peer_url, remote_request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, peer_url: str, remote_request_id: str) -> None:
        url = peer_url.rstrip("/") + CONSUME_PATH
        try:
            async with httpx.AsyncClient(timeout=self._timeout_s) as client:
                r = await client.post(url, json={"remote_request_id": remote_request_id})
                r.raise_for_status()
            self.sent += 1
        except httpx.HTTPError as e:
            self.failed += 1
            logger.warning("kv_transfer consume notification to %s failed: %s", url, e)

    async def drain(self) -> None:
        """Wait for notifications in flight (tests, shutdown)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
