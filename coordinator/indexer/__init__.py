"""The pod's KV index, out of the request loops: one indexer process holds the prefix index and the
engines' KV-event feeds for every worker of the pod (or for several coordinator replicas), and answers
their matches over a local socket (docs/scheduling.md, "The pod's KV index").

``service`` is what it does with each message (HTTP-free, socket-free); ``server`` carries the
messages (``coordinator.contracts.indexer``); ``process`` runs it in a process of its own, started by
the coordinator's supervisor or as its own container (``python -m coordinator.indexer``).
"""

__all__ = ["process", "server", "service"]
