"""Launcher for vLLM's render server (text <-> tokens, no engine), used as the coordinator's sidecar."""

from render_sidecar.launch import RenderSidecar

__all__ = ["RenderSidecar"]
