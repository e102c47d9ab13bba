"""The pod's view from one worker (``server.workers > 1``): ``/ready`` and ``/metrics`` answer for
every worker of the pod, whichever one a client reached. Each worker serves its own on a private
unix socket (``PrivateServer``); the one a client reached asks its siblings there (``Pod``) and
merges their answers (``merge_metrics``). The processes themselves: ``runtime/workers.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from coordinator.api.server import QuietServer

log = logging.getLogger(__name__)

_SUMMED = frozenset({"counter", "histogram", "summary", "gaugehistogram"})


# -- merging the workers' /metrics ------------------------------------------------------------------

class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def merge_metrics(texts: Mapping[int, str | None]) -> bytes:
    """One exposition for the pod from each worker's (None: the worker did not answer).

    As prometheus_client's multiprocess mode: counters, histograms and summaries are summed over the
    workers by (sample name, labels); gauges keep one sample per worker with a ``worker`` label. A
    ``<family>_created`` timestamp of a summed family keeps the earliest. ``coordinator_worker_up``
    says which workers answered."""
    families: dict[str, Metric] = {}
    summed: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for index, text in sorted(texts.items()):
        if text is None:
            continue
        for fam in text_string_to_metric_families(text):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            if fam.type in _SUMMED:
                acc = summed.setdefault(fam.name, {})
                for s in fam.samples:
                    key = (s.name, tuple(s.labels.items()))
                    acc[key] = acc.get(key, 0.0) + s.value
            else:
                for s in fam.samples:
                    merged.samples.append(Sample(s.name, {**s.labels, "worker": str(index)}, s.value))
    for name, acc in summed.items():
        families[name].samples = [Sample(n, dict(labels), v) for (n, labels), v in acc.items()]
    for name in list(families):
        base = name.removesuffix("_created")
        if base != name and families.get(base) is not None and families[base].type in _SUMMED:
            earliest: dict[tuple[tuple[str, str], ...], Sample] = {}
            for s in families[name].samples:
                labels = {k: v for k, v in s.labels.items() if k != "worker"}
                series = tuple(labels.items())
                if series not in earliest or s.value < earliest[series].value:
                    earliest[series] = Sample(s.name, labels, s.value)
            families[name].samples = list(earliest.values())
    up = Metric("coordinator_worker_up", "1 for each worker process of this pod that answered this scrape",
                "gauge")
    for index, text in sorted(texts.items()):
        up.add_sample("coordinator_worker_up", {"worker": str(index)}, 0.0 if text is None else 1.0)
    families[up.name] = up
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


# -- one worker's view of the pod -------------------------------------------------------------------

class Pod:
    """What a worker needs to answer for the pod: its index, and its siblings over unix sockets."""

    def __init__(self, index: int, count: int, socket_dir: str, timeout_s: float = 1.0) -> None:
        self.index = index
        self.count = count
        self.socket_dir = socket_dir
        self.timeout_s = timeout_s
        self._clients: dict[int, httpx.AsyncClient] = {}

    def socket_path(self, index: int) -> str:
        return os.path.join(self.socket_dir, f"worker-{index}.sock")

    @property
    def siblings(self) -> list[int]:
        return [i for i in range(self.count) if i != self.index]

    async def _ask(self, index: int, path: str) -> httpx.Response | None:
        """A sibling's answer on its private socket; None when it does not answer in time (dead,
        restarting, or too busy: for /ready that counts as not ready)."""
        client = self._clients.get(index)
        if client is None:
            client = self._clients[index] = httpx.AsyncClient(
                transport=httpx.AsyncHTTPTransport(uds=self.socket_path(index)), base_url="http://worker",
                timeout=self.timeout_s)
        try:
            return await client.get(path)
        except httpx.HTTPError as exc:
            log.debug("worker %d did not answer %s: %r", index, path, exc)
            return None

    async def ready(self, ok: bool, body: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        """Ready when every worker is: this worker's body with each worker's readiness added.

        The pod drains when any worker does. The supervisor passes SIGTERM on to each worker in turn, so
        for a moment the worker that answers may not have its signal yet while a sibling already drains;
        a load balancer reading ``draining`` must still learn that the pod is going away."""
        answers = await asyncio.gather(*(self._ask(i, "/ready") for i in self.siblings))
        workers = {self.index: ok}
        draining = bool(body.get("draining"))
        for i, r in zip(self.siblings, answers, strict=True):
            said = _json(r) if r is not None else {}
            workers[i] = r is not None and r.status_code == 200 and bool(said.get("ready"))
            draining = draining or said.get("draining") is True
        pod_ok = all(workers.values())
        return pod_ok, {**body, "ready": pod_ok, "draining": draining,
                        "workers": {str(i): workers[i] for i in sorted(workers)}}

    async def metrics(self, own: bytes) -> bytes:
        answers = await asyncio.gather(*(self._ask(i, "/metrics") for i in self.siblings))
        texts: dict[int, str | None] = {self.index: own.decode()}
        for i, r in zip(self.siblings, answers, strict=True):
            texts[i] = r.text if r is not None and r.status_code == 200 else None
        return merge_metrics(texts)

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()


def _json(r: httpx.Response) -> dict[str, Any]:
    try:
        body = r.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


class PrivateServer:
    """This worker's own /ready and /metrics on its unix socket, for its siblings to merge."""

    def __init__(self, app: FastAPI, path: str) -> None:
        async def ready(request: Request) -> Response:
            ok, body = await app.state.ready_here()
            return JSONResponse(body, status_code=200 if ok else 503)

        async def metrics(request: Request) -> Response:
            return Response(app.state.metrics_here(), media_type="text/plain; version=0.0.4")

        private = Starlette(routes=[Route("/ready", ready), Route("/metrics", metrics)])
        config = uvicorn.Config(private, uds=path, lifespan="off", access_log=False, log_level="warning")
        self._server = QuietServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(), name="worker-private")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the worker's private server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
