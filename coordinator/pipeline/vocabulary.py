"""How many token ids a model has, learned from its files: the bound every client token id must respect.

A ``--tokens-only`` engine has no tokenizer, so nothing on the engine side rejects an out-of-vocabulary
id: vLLM's ``validate_token_ids`` is skipped and the id reaches the embedding lookup, which kills the
engine process (``OverflowError`` for ids beyond int32, an index error or a device assert below it).
Native ``vllm serve`` accepts an id when ``0 <= id <= max(tokenizer.max_token_id, vocab_size - 1)``;
this module computes the same bound, as an exclusive size, from the same two sources.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def vocab_size_of(model: str) -> int | None:
    """The exclusive id bound of ``model`` (a local folder, or a hub id already in the local cache).

    ``None`` when neither ``config.json`` nor a tokenizer can be read: callers must then fail closed.
    """
    folder = Path(model)
    if folder.is_dir():
        return _from_folder(folder)
    return _from_hub_cache(model)


def _from_folder(folder: Path) -> int | None:
    sizes: list[int] = []
    config = _read_json(folder / "config.json")
    if isinstance(config, dict):
        size = _config_vocab(config)
        if size is not None:
            sizes.append(size)
    tokenizer = _read_json(folder / "tokenizer.json")
    if isinstance(tokenizer, dict):
        top = _tokenizer_max_id(tokenizer)
        if top is not None:
            sizes.append(top + 1)
    return max(sizes) if sizes else None


def _config_vocab(config: dict[str, Any]) -> int | None:
    """``vocab_size`` at the top, or in the text sub-config of multimodal models."""
    for holder in (config, config.get("text_config"), config.get("llm_config")):
        size = holder.get("vocab_size") if isinstance(holder, dict) else None
        if isinstance(size, int) and size > 0:
            return size
    return None


def _tokenizer_max_id(tokenizer: dict[str, Any]) -> int | None:
    ids: list[int] = []
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        ids.extend(v for v in vocab.values() if isinstance(v, int))
    elif isinstance(vocab, list):  # unigram: [[piece, score], ...], id = position
        ids.append(len(vocab) - 1)
    for added in tokenizer.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("id"), int):
            ids.append(added["id"])
    return max(ids) if ids else None


def _from_hub_cache(name: str) -> int | None:
    """A hub id: ask transformers for what is already cached locally (never downloads)."""
    try:
        from transformers import AutoConfig, AutoTokenizer  # optional dependency of the coordinator
    except ImportError:
        return None
    sizes: list[int] = []
    try:
        size = _config_vocab(AutoConfig.from_pretrained(name, local_files_only=True).to_dict())
        if size is not None:
            sizes.append(size)
    except Exception as exc:  # any failure means "unknown", which fails closed
        log.info("vocabulary: no cached config for %s (%s)", name, exc.__class__.__name__)
    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
        sizes.append(max(len(tok), int(getattr(tok, "vocab_size", 0) or 0)))
    except Exception as exc:
        log.info("vocabulary: no cached tokenizer for %s (%s)", name, exc.__class__.__name__)
    return max(sizes) if sizes else None


def _read_json(path: Path) -> Any:
    try:
        with path.open("rb") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
