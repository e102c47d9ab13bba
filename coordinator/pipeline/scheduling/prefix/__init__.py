"""Which engine holds which prompt prefix: the index (``index``), what routing decisions teach it
(``memory``) and the engines' own KV events mirrored into it (``kv_events``, wired by ``app.py``).
"""

__all__ = ["index", "memory"]
