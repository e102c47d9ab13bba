"""The encode leg of encoder disaggregation (EPD): a prompt's images are encoded on an engine of role
``encode`` before the engine that answers (union, or the prefill leg of P/D) runs the prompt.

vLLM 0.32's contract (``distributed/ec_transfer``): an encode-only engine (``ec_role: ec_producer``)
runs the prompt's vision encoder and puts each image's embedding in the store its EC connector shares
(``ECExampleConnector``: ``<shared_storage_path>/<mm_hash>/``), answering with no tokens and
``ec_transfer_params`` keyed by media hash. A consumer engine (``ec_consumer``) that finds an image's
hash in the store loads the embedding instead of encoding; one that does not encodes it itself from
the ``features`` tensors the request carries. So this leg can only speed a request up, never fail it:
with no encode engine up, or when it errs or is slow, the answering engine encodes (the hybrid rule),
and an image encoded a moment ago is not sent again (the store has it).

Why the answering engine still gets the full tensors and not render's metadata-only ``mm_metadata``
(fewer bytes): on vLLM 0.32 a metadata-only item whose embedding is missing from the store kills the
consumer's engine core (measured, docs/multimodal.md). A store may evict; an engine must never die of it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

from coordinator.config import EncodeSettings
from coordinator.contracts.generate import GenerateRequest
from coordinator.observability.events import event
from coordinator.observability.metrics import Metrics
from coordinator.pipeline.engines.client import EngineClient
from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.engines.registry import EngineRegistry
from coordinator.pipeline.errors import UpstreamTimeout
from coordinator.pipeline.scheduling.request import SchedRequest
from coordinator.pipeline.topology.attempts import Attempts
from coordinator.pipeline.topology.legs import attempt_id

log = logging.getLogger(__name__)


def media_hashes(generate: GenerateRequest) -> list[str]:
    """The hashes of the images whose tensors ``generate`` carries (none: nothing to encode)."""
    features = generate.get("features")
    if not isinstance(features, dict):
        return []
    data = features.get("kwargs_data") or {}
    hashes: list[str] = []
    for modality, items in (features.get("mm_hashes") or {}).items():
        tensors = data.get(modality) or []
        hashes += [str(h) for h, t in zip(items, tensors, strict=False) if t is not None]
    return hashes


def encode_body(generate: GenerateRequest) -> GenerateRequest:
    """What an encode engine needs: the prompt and its images, one step, no stream, nothing to report."""
    sp = generate["sampling_params"].copy()
    sp.update({"max_tokens": 1, "n": 1})
    for dropped in ("min_tokens", "logprobs", "prompt_logprobs", "structured_outputs"):
        sp.pop(dropped, None)  # type: ignore[misc]
    return {**generate, "sampling_params": sp, "stream": False, "stream_options": None,
            "kv_transfer_params": None}


class EncodeLeg:
    """Runs the encode leg of one attempt when the model has encode engines (see the module doc)."""

    def __init__(self, client: EngineClient, registry: EngineRegistry, attempts: Attempts,
                 settings: EncodeSettings, metrics: Metrics | None = None) -> None:
        self._client = client
        self._registry = registry
        self._attempts = attempts
        self._settings = settings
        self._metrics = metrics
        self._encoded: OrderedDict[str, float] = OrderedDict()  # media hash -> when it was encoded
        self._running: dict[str, int] = {}                      # encode engine url -> legs running

    def has_encoders(self, model: str) -> bool:
        return any(e.role == "encode" and e.serves(model) and not e.removed for e in self._registry.engines)

    async def prime(self, generate: GenerateRequest, req: SchedRequest) -> GenerateRequest:
        """``generate`` as the answering engine should get it: with the encode leg's
        ``ec_transfer_params`` when one ran, else unchanged (that engine encodes what the store lacks)."""
        hashes = media_hashes(generate)
        if not hashes or not self.has_encoders(req.model):
            return generate
        if self._fresh(hashes):
            self._count("reused")
            return generate
        engine = self._pick(req.model)
        if engine is None:
            self._count("fallback")
            event(log, "encode", req.request_id, result="no encode engine available")
            return generate
        params = await self._encode(engine, generate, req)
        if params is None:
            self._count("fallback")
            return generate
        now = time.monotonic()
        for h in hashes:
            self._encoded[h] = now
            self._encoded.move_to_end(h)
        while len(self._encoded) > self._settings.reuse_entries:
            self._encoded.popitem(last=False)
        self._count("encoded")
        return {**generate, "ec_transfer_params": params}

    # -- internals --------------------------------------------------------------------------------
    def _fresh(self, hashes: list[str]) -> bool:
        ttl = self._settings.reuse_ttl_s
        now = time.monotonic()
        return ttl > 0 and all(now - self._encoded.get(h, -ttl) < ttl for h in hashes)

    def _pick(self, model: str) -> Engine | None:
        """The least busy encode engine that is healthy and whose breaker allows a call."""
        pool = self._registry.candidates(model, "encode")
        return min(pool, key=lambda e: self._running.get(e.url, 0), default=None)

    async def _encode(self, engine: Engine, generate: GenerateRequest,
                      req: SchedRequest) -> dict[str, Any] | None:
        """One encode call; None when it failed in any way (logged, counted on the engine's breaker)."""
        rid = attempt_id(generate["request_id"], "e")
        engine.breaker.on_pick()  # a half-open breaker lets one trial through, not every waiting leg
        self._running[engine.url] = self._running.get(engine.url, 0) + 1
        try:
            async with asyncio.timeout(self._settings.timeout_s):
                with self._attempts.outcome(engine, req, "encode"):
                    resp = await self._client.generate(engine, encode_body(generate), rid)
        except TimeoutError:
            # The leg was cancelled (the engine client aborted it there); unlike a client's cancel, a
            # deadline missed counts against the encoder, so a hung one opens its breaker and stops
            # costing every image request the whole timeout.
            self._attempts.failed(engine, UpstreamTimeout(f"encode leg on {engine.url} timed out"), req)
            log.warning("encode leg on %s timed out after %.1f s: the answering engine encodes the images",
                        engine.url, self._settings.timeout_s)
            return None
        except Exception as exc:  # any failure: the answering engine encodes instead
            log.warning("encode leg on %s failed (%s): the answering engine encodes the images",
                        engine.url, type(exc).__name__)
            return None
        finally:
            self._running[engine.url] -= 1
        params = resp.get("ec_transfer_params")
        return params if isinstance(params, dict) and params else None

    def _count(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.encode_legs.labels(outcome).inc()


__all__ = ["EncodeLeg", "encode_body", "media_hashes"]
