"""An engine client for obfuscated engines: physical ids on the wire, semantic ids everywhere else.

It is the plain ``EngineClient`` (same pools, aborts, error mapping) with the two calls that carry
token ids wrapped: ``generate`` and ``stream`` map the request body to physical ids and every answer
(response, chunk) back to semantic ids before anything else in the coordinator sees it. A subclass
rather than a delegate so that the dispatcher, the registry (``http``) and shutdown (``aclose``) take
it wherever they take an ``EngineClient``.

``obfuscator`` is public: code that must see what the engines see (the KV-affinity index hashes the
prompt as the engine caches it) maps with it; a plain ``EngineClient`` has no such attribute.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast

from coordinator.config import EngineClientSettings, Settings
from coordinator.contracts.generate import GenerateRequest, GenerateResponse, StreamChunk
from coordinator.contracts.permutation import (
    KeyedPermutation,
    ObfuscationError,
    Obfuscator,
    config_vocab_size,
)
from coordinator.pipeline.engines.client import EngineClient
from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.errors import BadRequest, UpstreamUnavailable
from coordinator.pipeline.obfuscation import (
    UnmappableField,
    chunk_to_semantic,
    request_to_physical,
    response_to_semantic,
)

log = logging.getLogger(__name__)


def build_engine_client(settings: Settings) -> EngineClient:
    """The plain client, or the obfuscating one when ``obfuscation.enabled`` (built here, at startup,
    so a missing key or an unknown vocabulary stops the coordinator instead of failing requests)."""
    if not settings.obfuscation.enabled:
        return EngineClient(settings.engine_client)
    assert settings.obfuscation.key_file is not None  # the settings validator guarantees it
    obfuscator = KeyedPermutation.from_key_file(permuted_vocab_size(settings), settings.obfuscation.key_file)
    log.info("token obfuscation on: %r", obfuscator)
    return ObfuscatingEngineClient(settings.engine_client, obfuscator)


def permuted_vocab_size(settings: Settings) -> int:
    """The size of the permuted id space: the models' ``config.json`` ``vocab_size`` (the embedding rows
    the model copy permuted), read from ``models[].path``, else ``models[].vocab_size``. Known at
    startup or the coordinator does not start: a wrong size would permute onto other rows. One key
    means one permutation, so every configured model must have the same size."""
    sizes: dict[int, list[str]] = {}
    for model in settings.models:
        size = config_vocab_size(model.path) if model.path else None
        if size is None:
            size = model.vocab_size
        if size is None:
            raise ObfuscationError(
                f"token obfuscation needs the vocabulary size of model {model.name!r}: set models[].path to "
                "its model folder (config.json vocab_size) or models[].vocab_size")
        sizes.setdefault(size, []).append(model.name)
    if len(sizes) != 1:
        raise ObfuscationError(f"token obfuscation uses one permutation, but the models' vocabulary "
                               f"sizes differ: {sizes}")
    return next(iter(sizes))


class ObfuscatingEngineClient(EngineClient):
    def __init__(self, settings: EngineClientSettings, obfuscator: Obfuscator) -> None:
        super().__init__(settings)
        self.obfuscator = obfuscator
        self._keys = obfuscator  # the same, typed as always set

    async def generate(self, engine: Engine, body: GenerateRequest, request_id: str) -> GenerateResponse:
        resp = await super().generate(engine, self._physical(body), request_id)
        return cast(GenerateResponse, self._semantic(engine, resp, response_to_semantic))

    @contextlib.asynccontextmanager
    async def stream(self, engine: Engine, body: GenerateRequest, request_id: str,
                     include_usage: bool) -> AsyncIterator[AsyncIterator[StreamChunk]]:
        async with super().stream(engine, self._physical(body), request_id, include_usage) as chunks:
            yield _SemanticChunks(self, engine, chunks)

    def _physical(self, body: GenerateRequest) -> GenerateRequest:
        """A request id outside the permuted vocabulary, or a field the engine would interpret with its
        own (unobfuscated) tokenizer, is the client's problem: a 400, never an unmapped send."""
        try:
            return cast(GenerateRequest, request_to_physical(body, self._keys))
        except UnmappableField as exc:
            raise BadRequest(str(exc), param=exc.field) from None
        except ObfuscationError as exc:
            raise BadRequest(f"The request cannot be sent to an obfuscated engine: {exc}") from None

    def _semantic(self, engine: Engine, data: Mapping[str, Any], convert: Any) -> dict[str, Any]:
        """An engine answering with an id outside the vocabulary serves another model (or another
        key's copy): an engine failure, not something to pass on."""
        try:
            result: dict[str, Any] = convert(data, self._keys)
        except ObfuscationError as exc:
            raise UpstreamUnavailable(f"engine {engine.url} answered with an unmappable token id: {exc}") \
                from None
        return result


class _SemanticChunks:
    """The engine's chunk iterator, mapped chunk by chunk (a plain iterator, not a generator, so that
    leaving the stream early leaves no generator frame to finalize)."""

    def __init__(self, client: ObfuscatingEngineClient, engine: Engine,
                 chunks: AsyncIterator[StreamChunk]) -> None:
        self._client = client
        self._engine = engine
        self._chunks = chunks

    def __aiter__(self) -> _SemanticChunks:
        return self

    async def __anext__(self) -> StreamChunk:
        chunk = await self._chunks.__anext__()
        return cast(StreamChunk, self._client._semantic(self._engine, chunk, chunk_to_semantic))
