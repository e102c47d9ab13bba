"""The processes that run the app: worker processes and their supervisor (``server.workers``),
above ``app.py`` because they build it."""

__all__ = ["server", "workers"]
