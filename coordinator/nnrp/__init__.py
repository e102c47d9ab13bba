"""The NNRP front door: the openai-compatible/1 profile (``profile``); the wire protocol comes later.

Specification: ``docs/nnrp.md``.
"""
