"""Model registry: client-facing names and aliases → the served name render and engines know."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from coordinator.config import ModelSettings
from coordinator.pipeline.errors import ModelNotFound, UpstreamUnavailable
from coordinator.pipeline.sidecar import SidecarClient

log = logging.getLogger(__name__)


@dataclass
class ModelEntry:
    name: str
    aliases: list[str]
    max_model_len: int | None
    root: str | None = None
    created: int = 0


class ModelCatalog:
    """Resolves names (404 for unknown ones) and learns ``max_model_len``/``root`` from the sidecar."""

    def __init__(self, models: list[ModelSettings], sidecar: SidecarClient) -> None:
        now = int(time.time())
        self._entries = {m.name: ModelEntry(m.name, list(m.aliases), m.max_model_len, None, now)
                         for m in models}
        self._by_name: dict[str, ModelEntry] = {}
        for e in self._entries.values():
            for n in (e.name, *e.aliases):
                self._by_name[n] = e
        self._sidecar = sidecar
        self._synced = False

    def entries(self) -> list[ModelEntry]:
        return list(self._entries.values())

    def resolve(self, name: Any) -> ModelEntry:
        if not isinstance(name, str) or name not in self._by_name:
            known = ", ".join(sorted(self._by_name))
            raise ModelNotFound(f"The model `{name}` does not exist. Known models: {known}.", param="model")
        return self._by_name[name]

    async def sync(self) -> bool:
        """Read ``max_model_len`` and ``root`` from the sidecar's ``/v1/models``; True when done."""
        try:
            served = {m.get("id"): m for m in await self._sidecar.models()}
        except Exception as exc:  # the sidecar may still be starting; callers retry
            log.info("model catalog: sidecar not ready (%s)", exc.__class__.__name__)
            return False
        for e in self._entries.values():
            card = served.get(e.name)
            if card is None:
                log.warning("model %s is configured but the render sidecar does not serve it", e.name)
                continue
            if e.max_model_len is None and isinstance(card.get("max_model_len"), int):
                e.max_model_len = card["max_model_len"]
            e.root = card.get("root") or e.root
        self._synced = True
        return True

    async def max_model_len(self, entry: ModelEntry) -> int:
        if entry.max_model_len is None and not self._synced:
            await self.sync()
        if entry.max_model_len is None:
            raise UpstreamUnavailable(f"max_model_len of {entry.name} is unknown (render sidecar not ready)")
        return entry.max_model_len
