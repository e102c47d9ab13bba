"""The rules both sides of a wire must share, so the render sidecar, the token engine and the coordinator
cannot drift apart: the prefix block hash (``hashing``), the keyed vocabulary permutation
(``permutation``), vLLM's KV-event structs (``kv_events``), the render sidecar's own routes and
capability document (``sidecar``) and the pod's KV indexer protocol (``indexer``).

The package is the bottom of the house: it imports nothing else of ``coordinator`` (only the standard
library, msgspec and NumPy), and ``render_sidecar`` and ``token_engine`` import nothing of ``coordinator`` but
it, so the render image copies this folder alone (``deploy/docker/render.Dockerfile``). A layering
test keeps both facts. It lives under ``coordinator/`` because the repository's top level is fixed.
"""

__all__ = ["generate", "hashing", "indexer", "kv_events", "permutation", "sidecar"]
