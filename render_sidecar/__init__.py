"""The render sidecar: vLLM's render server (text <-> tokens, no engine) with our parser-session cache
(``server``, ``stream_cache``, ``sessions``), and a launcher for it (``launch``).

``RenderSidecar`` is imported lazily: the render image ships only the server modules, without the
launcher's dependencies (``token_engine``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from render_sidecar.launch import RenderSidecar

__all__ = ["RenderSidecar"]


def __getattr__(name: str) -> Any:
    if name == "RenderSidecar":
        from render_sidecar.launch import RenderSidecar

        return RenderSidecar
    raise AttributeError(name)
