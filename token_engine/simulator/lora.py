"""LoRA adapters as vLLM 0.32 serves them (``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).

What is modelled, from ``entrypoints/openai/models/serving.py`` and ``entrypoints/serve/lora``:
registered names (``--lora-modules`` and ``/v1/load_lora_adapter``) with vLLM's answers (200 text,
400 duplicate / base-name clash, 404 no adapter at the path, 500 an adapter the engine cannot take,
such as a rank above ``--max-lora-rank``); ``/v1/unload_lora_adapter`` forgets the name only; the
weights live in an LRU cache of ``max_cpu_loras`` (a request for an evicted adapter reads them again,
``lora_load_s``); at most ``max_loras`` distinct adapters run at once, the others wait ("deferred").
vLLM reads an adapter inside its engine loop (``add_lora`` runs between steps; a batch that needs an
adapter its cache lacks reads it in ``execute_model``), so reads happen one at a time and every running
request stalls meanwhile (``stalled_until``, which the engine's sleeps honour).

Paths: ``sim:<anything>`` is an adapter of rank 8 (``sim:rank=N`` of rank N) with no files; any other
path must be a folder with an ``adapter_config.json`` (its ``r`` is the rank), as vLLM reads it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from pathlib import Path

from .config import SimConfig
from .errors import SimHTTPError


def _rank(path: str) -> int | None:
    """The adapter's rank, or None when no adapter is found at ``path``."""
    if path.startswith("sim:"):
        rest = path[4:]
        return int(rest.split("=", 1)[1]) if rest.startswith("rank=") else 8
    config = Path(path) / "adapter_config.json"
    try:
        return int(json.loads(config.read_text()).get("r", 8))
    except (OSError, ValueError, AttributeError):
        return None


class SimLoras:
    """Registered adapters, the weight cache and load counts of one simulated engine."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.registered: dict[str, str] = dict(config.lora_modules)
        self.cache: OrderedDict[str, None] = OrderedDict()   # weights read (CPU LoRA cache), LRU order
        self.weight_loads = 0     # adapters read from their path (a load call, or a request after eviction)
        self.load_calls = 0
        self._locks: dict[str, asyncio.Lock] = {}
        self._ids: dict[str, int] = {}
        self._engine_loop = asyncio.Lock()   # one read at a time, as vLLM's engine loop does them
        self.stalled_until = 0.0             # time.monotonic() until which the engine loop is reading

    def adapter_id(self, name: str) -> int:
        """vLLM's ``lora_int_id``: a counter, one per name (a reload keeps it)."""
        return self._ids.setdefault(name, len(self._ids) + 1)

    @property
    def cache_size(self) -> int:
        return self.config.max_cpu_loras or self.config.max_loras

    async def _read(self, name: str) -> None:
        """Read the weights into the cache (the least recently used one leaves when it is full)."""
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            if name in self.cache:
                self.cache.move_to_end(name)
                return
            if self.config.lora_load_s > 0:
                async with self._engine_loop:
                    self.stalled_until = time.monotonic() + self.config.lora_load_s
                    await asyncio.sleep(self.config.lora_load_s)
            self.weight_loads += 1
            self.cache[name] = None
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)

    async def load(self, name: str, path: str, load_inplace: bool = False) -> str:
        """``POST /v1/load_lora_adapter``: the success text, or raises vLLM's error."""
        self.load_calls += 1
        if not name or not path:
            raise SimHTTPError("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name == self.config.model:
            raise SimHTTPError(f"The lora adapter '{name}' conflicts with a served base model.",
                               "InvalidUserInput")
        if not load_inplace and name in self.registered:
            raise SimHTTPError(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                               "adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
        rank = _rank(path)
        if rank is None:
            raise SimHTTPError(f"Loading lora {name} failed: No adapter found for {path}", "Not Found", 404)
        if rank > self.config.max_lora_rank:
            raise SimHTTPError(f"LoRA rank {rank} is greater than max_lora_rank {self.config.max_lora_rank}.",
                               "InternalServerError", 500)
        self.cache.pop(name, None)   # a reload reads the weights again
        await self._read(name)
        self.registered[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> str:
        """``POST /v1/unload_lora_adapter``: forgets the name (vLLM leaves the weights to its cache)."""
        if not name:
            raise SimHTTPError("'lora_name' needs to be provided to unload a LoRA adapter.",
                               "InvalidUserInput")
        if name not in self.registered:
            raise SimHTTPError(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
        del self.registered[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def warm(self, name: str) -> None:
        """A request for ``name`` starts: its weights must be in the cache."""
        await self._read(name)
