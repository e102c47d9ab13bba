"""The NNRP front door's FastAPI binding (the session itself is ``coordinator.nnrp.session``)."""

__all__ = ["routes"]
