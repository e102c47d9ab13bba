"""The HTTP front doors (OpenAI, Anthropic, NNRP over WebSocket, admin, the trigger metaserver), each
thin: authorize, read the body, hand it to the pipeline, write the answer. ``app.py`` mounts them;
the runtime takes from here only the listener's pieces (``server``) and the drain state (``shutdown``).
"""

__all__ = ["server", "shutdown"]
