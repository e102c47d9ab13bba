"""Trigger P/D as vLLM-Ascend's ``MooncakeLayerwiseConnector`` does it (docs/trigger-protocol.md, part A).

Why a second connector: in the Trigger topology the coordinator calls the **decode** engine first,
with ``kv_transfer_params = {do_remote_decode: false, do_remote_prefill: true, metaserver: URL}``.
The decode side's connector then POSTs its own transfer parameters to that URL (the coordinator
answers by running the prefill), and the decode request waits until the prefill engine has pushed
the KV. What is byte for byte the connector's:

* the callback goes out once per request, when blocks are allocated (the request starts running),
  in the background, to the URL verbatim (its query kept), as ``json=`` with the connector's keys in
  its order (A4); ``request_id`` is the engine's external id (``generate-tokens-<X-Request-Id>``);
* the answer is never read: any HTTP status counts as delivered; only transport errors are retried,
  at most 3 tries with no delay between them, no timeout (A6);
* what unblocks the decode request is the prefill engine's "done sending" message, not the
  callback's answer (A7); a "failed sending" message marks the KV invalid, so the decode engine
  computes the prompt itself (vLLM's default ``kv_load_failure_policy``: recompute);
* the prefill side answers with no ``kv_transfer_params`` (A9).

What stands in for the wire the simulator does not have: the prefill engine pushes KV to the decode
engine's ZMQ side channel (``remote_host:remote_port`` from the callback body). Here the decode
simulator advertises the HTTP address the request reached it on as ``remote_host``/``remote_port``,
and the "done" message is ``POST /sim/kv_transfer/layerwise_done {"request_id", "status"}`` there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx

logger = logging.getLogger(__name__)

DONE_PATH = "/sim/kv_transfer/layerwise_done"
_TRIES = 3  # _access_metaserver: `while retry < 3 and success is False`


def callback_body(*, request_id: str, block_ids: list[int], block_size: int, engine_id: str,
                  host: str, port: int, tp_size: int, cached_tokens: int) -> dict[str, Any]:
    """The connector's ``kv_transfer_params`` for the metaserver, keys in its order (A4)."""
    return dict(
        token_ids=[], request_id=request_id, do_remote_prefill=False, do_remote_decode=True,
        remote_block_ids=[block_ids], remote_block_size=[block_size], remote_engine_id=engine_id,
        remote_host=host, remote_port=port, remote_tp_size=tp_size, remote_pcp_size=1,
        remote_dcp_size=1, remote_cached_tokens=cached_tokens)


def side_channel(peer_url: str | None) -> tuple[str, int]:
    """The decode simulator's stand-in side channel: the HTTP address the request came in on."""
    parts = urlsplit(peer_url or "http://127.0.0.1:80")
    return parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)


class LayerwiseConnector:
    """Both sides of the trigger protocol for one simulated engine; runs on the server's event loop."""

    def __init__(self, client: Callable[[], httpx.AsyncClient] | None = None) -> None:
        self._make_client = client or (lambda: httpx.AsyncClient(timeout=None))
        self._http: httpx.AsyncClient | None = None  # one pool, as the connector's one httpx.Client
        self._arrivals: dict[str, asyncio.Future[bool]] = {}  # decode side: external id -> KV ok?
        self._tasks: set[asyncio.Task[None]] = set()
        self.callbacks_sent = 0       # decode side: callbacks delivered (any HTTP status)
        self.callbacks_failed = 0     # decode side: 3 transport failures in a row
        self.callback_statuses: list[int] = []
        self.pushed: dict[str, int] = {"done": 0, "failed": 0}  # prefill side: messages sent

    # -- decode side ------------------------------------------------------------------------------
    def expect(self, request_id: str) -> asyncio.Future[bool]:
        """Register a decode request waiting for its KV (before the callback goes out)."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._arrivals[request_id] = fut
        return fut

    def forget(self, request_id: str) -> None:
        fut = self._arrivals.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.cancel()

    def call_metaserver(self, url: str, body: dict[str, Any]) -> None:
        """Fire the callback in the background, as the connector's thread pool does."""
        self._spawn(self._access_metaserver(url, body))

    def _client(self) -> httpx.AsyncClient:
        """Made on first use, on the server's event loop (a client per call costs a TLS context)."""
        if self._http is None:
            self._http = self._make_client()
        return self._http

    async def _access_metaserver(self, url: str, body: dict[str, Any]) -> None:
        client = self._client()
        for attempt in range(1, _TRIES + 1):
            try:
                resp = await client.post(url, json=body)
            except httpx.HTTPError as exc:
                logger.error("Failed to connect to metaserver. url=%s, retry=%d. %s", url, attempt, exc)
                continue
            self.callbacks_sent += 1
            self.callback_statuses.append(resp.status_code)
            return
        self.callbacks_failed += 1
        logger.error("Access metaserver fail. url=%s", url)

    def arrived(self, request_id: str, ok: bool) -> bool:
        """The prefill engine's done/failed message; False when no decode request waits for it."""
        fut = self._arrivals.get(request_id)
        if fut is None or fut.done():
            return False
        fut.set_result(ok)
        return True

    # -- prefill side -----------------------------------------------------------------------------
    async def push(self, params: dict[str, Any], request_id: str, ok: bool) -> None:
        """Tell the decode engine its KV is there (or is not coming), tagged with our own external id."""
        host, port = params.get("remote_host"), params.get("remote_port")
        if not isinstance(host, str) or not isinstance(port, int):
            return
        status = "done" if ok else "failed"
        try:
            await self._client().post(f"http://{host}:{port}{DONE_PATH}",
                                      json={"request_id": request_id, "status": status}, timeout=5.0)
            self.pushed[status] += 1
        except httpx.HTTPError as exc:
            logger.warning("layer-wise KV %s message to %s:%s failed: %s", status, host, port, exc)

    def push_soon(self, params: dict[str, Any], request_id: str, ok: bool) -> None:
        self._spawn(self.push(params, request_id, ok))

    # -- housekeeping -----------------------------------------------------------------------------
    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def waiting(self) -> list[str]:
        return [rid for rid, f in self._arrivals.items() if not f.done()]

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
