"""Model registry: client-facing names, aliases and LoRA adapters → the served name render and engines
know (an adapter renders as its base model; engines run it under its own name)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.config import ModelSettings
from coordinator.pipeline.engines.adapters import Adapter
from coordinator.pipeline.errors import BadRequest, ModelNotFound, UpstreamUnavailable
from coordinator.pipeline.sidecar import SidecarClient
from coordinator.pipeline.vocabulary import vocab_size_of

log = logging.getLogger(__name__)


@dataclass
class ModelEntry:
    name: str
    aliases: list[str]
    max_model_len: int | None
    root: str | None = None
    created: int = 0
    vocab_size: int | None = None     # exclusive bound of token ids (see vocabulary.py)
    path: str | None = None           # where to learn vocab_size from (else ``root``)
    adapters: dict[str, Adapter] = field(default_factory=dict)


def model_cards(e: ModelEntry) -> list[dict[str, Any]]:
    """The OpenAI model cards of one entry: its name, each alias (``parent``: the name), then each
    adapter as vLLM lists one (``root``: its path, ``parent``: the base model). Every door that lists
    models (``GET /v1/models``, NNRP ``models.list``) uses these, so they cannot differ."""
    card = {"object": "model", "created": e.created, "owned_by": "vllm", "root": e.root,
            "parent": None, "max_model_len": e.max_model_len}
    return [{"id": e.name, **card}, *({"id": a, **card, "parent": e.name} for a in e.aliases),
            *({"id": a.name, **card, "created": a.created, "root": a.path, "parent": e.name,
               "max_model_len": None} for a in e.adapters.values())]


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _warn_own_tokenizer(adapter: Adapter) -> None:
    """vLLM 0.32 runs every adapter with the base model's tokenizer (a per-adapter tokenizer is
    deprecated: ``v1/engine/input_processor.py`` warns and ignores it), and so does render here. An
    adapter folder that ships its own tokenizer is served the same way, with this warning; the
    coordinator can only look when the folder is visible to it (engines may see another filesystem)."""
    with contextlib.suppress(OSError):
        found = [f for f in _TOKENIZER_FILES if (Path(adapter.path) / f).is_file()]
        if found:
            log.warning("adapter %s ships its own tokenizer (%s): it is rendered with the base model %s's "
                        "tokenizer and chat template, as vLLM runs it", adapter.name, ", ".join(found),
                        adapter.base)


class ModelCatalog:
    """Resolves names (400/404) and learns ``max_model_len``/``root`` from the sidecar and ``vocab_size``
    from the model's files."""

    def __init__(self, models: list[ModelSettings], sidecar: SidecarClient | None) -> None:
        """``sidecar`` None: render is off; what the configuration says is all there is to learn."""
        now = int(time.time())
        self._entries = {
            m.name: ModelEntry(m.name, list(m.aliases), m.max_model_len, None, now, vocab_size=m.vocab_size,
                               path=m.path,
                               adapters={a.name: Adapter(a.name, m.name, a.path, tuple(a.engines), now)
                                         for a in m.adapters})
            for m in models}
        self._by_name: dict[str, ModelEntry] = {}
        for e in self._entries.values():
            for n in (e.name, *e.aliases, *e.adapters):
                self._by_name[n] = e
            for a in e.adapters.values():
                _warn_own_tokenizer(a)
        self._sidecar = sidecar
        self._synced = False
        self._sync_lock = asyncio.Lock()  # concurrent first requests share one sync

    def entries(self) -> list[ModelEntry]:
        return list(self._entries.values())

    def model_list(self, may_use: Callable[[str], bool] = lambda adapter: True) -> dict[str, Any]:
        """OpenAI's model list (``GET /v1/models``): every entry's cards, in configuration order; an
        adapter only when ``may_use`` it (the caller's tenant may be held to some adapters)."""
        return {"object": "list", "data": [card for e in self.entries() for card in model_cards(e)
                                           if card["id"] not in e.adapters or may_use(card["id"])]}

    def get(self, name: str) -> ModelEntry | None:
        """The entry a name, alias or adapter points at, or None."""
        return self._by_name.get(name)

    def resolve_named(self, name: Any) -> tuple[ModelEntry, str | None]:
        """``resolve``, and the adapter the name names (None for a base model or an alias)."""
        entry = self.resolve(name)
        return entry, name if name in entry.adapters else None

    def adapter(self, name: Any) -> Adapter | None:
        """The adapter ``name`` names, or None (a base model, an alias, or unknown)."""
        entry = self._by_name.get(name) if isinstance(name, str) else None
        return entry.adapters.get(name) if entry is not None else None

    def adapters(self) -> list[Adapter]:
        return [a for e in self._entries.values() for a in e.adapters.values()]

    def new_adapter(self, base: str, name: str, path: str) -> Adapter:
        """An adapter an operator may register at run time (``/admin``), not served yet (``add``
        serves it); the one already served when it is the same. Raises ``BadRequest`` when the name is
        taken or the base model unknown."""
        if base not in self._entries:
            raise BadRequest(f"The base model `{base}` is not configured", param="model")
        known = self._by_name.get(name)
        if known is not None:
            existing = known.adapters.get(name)
            if existing is not None and existing.base == base and existing.path == path:
                return existing
            raise BadRequest(f"The name `{name}` is already served", param="name")
        return Adapter(name, base, path, (), int(time.time()))

    def add(self, adapter: Adapter) -> Adapter:
        """Serve ``adapter`` (from ``new_adapter``) from now on."""
        entry = self._entries[adapter.base]
        entry.adapters.setdefault(adapter.name, adapter)
        self._by_name[adapter.name] = entry
        return entry.adapters[adapter.name]

    def add_adapter(self, base: str, name: str, path: str) -> Adapter:
        return self.add(self.new_adapter(base, name, path))

    def resolve(self, name: Any) -> ModelEntry:
        if not isinstance(name, str):
            raise BadRequest("'model' must be a string naming a served model", param="model")
        if name not in self._by_name:
            known = ", ".join(sorted(self._by_name))
            raise ModelNotFound(f"The model `{name}` does not exist. Known models: {known}.", param="model")
        return self._by_name[name]

    async def sync(self) -> bool:
        """Read ``max_model_len`` and ``root`` from the sidecar's ``/v1/models``; True when done."""
        async with self._sync_lock:
            return self._synced or await self._sync()

    async def _sync(self) -> bool:
        try:
            served = {m.get("id"): m for m in await self._sidecar.models()} if self._sidecar else {}
        except Exception as exc:  # the sidecar may still be starting; callers retry
            log.info("model catalog: sidecar not ready (%s)", exc.__class__.__name__)
            return False
        for e in self._entries.values():
            card = served.get(e.name)
            if card is None:
                if self._sidecar is None:
                    continue
                log.warning("model %s is configured but the render sidecar does not serve it", e.name)
                continue
            if e.max_model_len is None and isinstance(card.get("max_model_len"), int):
                e.max_model_len = card["max_model_len"]
            e.root = card.get("root") or e.root
        for e in self._entries.values():
            source = e.path or e.root
            if e.vocab_size is None and source:
                e.vocab_size = await asyncio.to_thread(vocab_size_of, source)
                if e.vocab_size is None:
                    log.error("model %s: vocabulary size unknown (no readable config.json or tokenizer at "
                              "%s); requests with token ids are refused until models[].vocab_size is set",
                              e.name, source)
                else:
                    log.info("model %s: token ids must be below %d", e.name, e.vocab_size)
        self._synced = True
        return True

    async def vocab_size(self, entry: ModelEntry) -> int | None:
        if entry.vocab_size is None and not self._synced:
            await self.sync()
        return entry.vocab_size

    async def max_model_len(self, entry: ModelEntry) -> int:
        if entry.max_model_len is None and not self._synced:
            await self.sync()
        if entry.max_model_len is None:
            raise UpstreamUnavailable(f"max_model_len of {entry.name} is unknown (render sidecar not ready)")
        return entry.max_model_len
