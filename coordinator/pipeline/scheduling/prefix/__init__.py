"""Which engine holds which prompt prefix: the index (``index``), what routing decisions teach it
(``memory``), the engines' own KV events mirrored into it (``kv_events``) by one feed per engine
(``feeds``), kept in step with the fleet by ``source`` (wired by ``app.py``), and the pod's indexer
process that can hold all of it for every worker (``remote``: its client).
"""

__all__ = ["index", "kv_events", "memory", "remote", "source"]
