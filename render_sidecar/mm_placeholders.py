"""Image placeholders that name only the positions the image's embeddings fill.

Why: a placeholder of vLLM's is ``offset``, ``length`` and ``is_embed``, the mask of the positions
inside the range that receive the encoder's output. Many vision models put other tokens inside the
range: Idefics3 / SmolVLM wrap an image's ``<image>`` tokens in ``<fake_token_around_image>`` and
``<global-img>``, Qwen-VL and InternVL mark starts and ends. vLLM 0.32's render writes a placeholder
as offset and length only (``PlaceholderRangeInfo``, whose TODO says so) and its ``/generate``
rebuilds the range without the mask, so such a model is told to place N embeddings on N + k
positions: the step fails and the engine process dies (vLLM pull request 54548, open, carries the
mask). Until a vLLM we support carries it, the sidecar narrows each range to the run of positions
the mask marks. The engine then writes the same embeddings to the same positions as native vLLM;
the tokens around them stay text tokens there too.

A mask with gaps (an image cut into tiles with separators between them) cannot be written as one
range: that image is refused with a clear error instead of an engine that dies.

This is a patch of one method of vLLM's render serving in this process (``ServingRender.
_extract_mm_features``), installed by ``server.install``; a vLLM without that method is left alone
(``install`` reports it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any


class SparsePlaceholder(ValueError):
    """An image whose embedding positions are not one run: /generate of vLLM 0.32 cannot place it."""


def embed_run(offset: int, length: int, is_embed: Sequence[bool] | None) -> tuple[int, int]:
    """``(offset, length)`` of the positions ``is_embed`` marks (the whole range when it is None)."""
    if is_embed is None:
        return offset, length
    marks = [bool(x) for x in is_embed]
    if len(marks) != length or not any(marks):
        return offset, length
    first = marks.index(True)
    last = length - 1 - marks[::-1].index(True)
    if not all(marks[first:last + 1]):
        raise SparsePlaceholder(
            "this model places an image's embeddings at positions with gaps between them (for "
            "example an image split into tiles), which vLLM 0.32's /inference/v1/generate cannot "
            "carry; send a smaller image or disable image splitting in the model's processor")
    return offset + first, last - first + 1


def narrow(features: Any, placeholders: Mapping[str, Sequence[Any]]) -> Any:
    """``features`` (a ``MultiModalFeatures``) with each range narrowed to its embedding run, from
    vLLM's own ``PlaceholderRange`` objects of the rendered prompt (``placeholders``)."""
    for modality, ranges in features.mm_placeholders.items():
        raw = placeholders.get(modality) or ()
        for info, full in zip(ranges, raw, strict=False):
            mask: Any = getattr(full, "is_embed", None)
            if mask is not None and hasattr(mask, "tolist"):
                mask = mask.tolist()  # a torch bool tensor in vLLM
            info.offset, info.length = embed_run(int(full.offset), int(full.length), mask)
    return features


def install() -> bool:
    """Patch vLLM's render serving in this process; False when this vLLM has no such method."""
    try:
        from vllm.entrypoints.scale_out.render.serving import ServingRender
    except ImportError:
        return False
    original: Callable[..., Any] | None = getattr(ServingRender, "_extract_mm_features", None)
    if original is None or getattr(original, "__narrowed__", False):
        return original is not None

    @functools.wraps(original)
    def extract(self: Any, engine_input: Any, **kw: Any) -> Any:
        features = original(self, engine_input, **kw)
        if features is None or engine_input.get("type") != "multimodal":
            return features
        return narrow(features, engine_input["mm_placeholders"])

    extract.__narrowed__ = True  # type: ignore[attr-defined]
    ServingRender._extract_mm_features = extract  # type: ignore[method-assign]
    return True
