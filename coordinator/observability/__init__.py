"""What the coordinator tells its operators: structured log events (``events``), metrics
(``metrics``), one record per request (``record``), traces (``tracing``); ``accounting`` is wired by
``app.py``.
"""

__all__ = ["events", "metrics", "record", "tracing"]
