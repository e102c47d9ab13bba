"""The NNRP front door: the openai-compatible/1 profile (``profile``, with ``responses`` for the
``responses.create`` and ``models.list`` results), the wire protocol (``frames``, ``session``), the
client library (``client``) and the conformance runner (``conformance``).

Specification: ``docs/nnrp.md``.
"""

__all__ = ["profile", "session"]
