"""Which engine holds which prompt prefix: the index (``index``), what routing decisions teach it
(``memory``), the engines' own KV events mirrored into it (``kv_events``) by their feeds (``feeds``,
wired by ``app.py``), and the pod's indexer process that can hold all of it for every worker
(``remote``: its client).
"""

__all__ = ["feeds", "index", "kv_events", "memory", "remote"]
