"""Admission: whether a request's tokens may go to an engine now, wait, or be refused.

Face: ``controller`` (admit, wait in fair order, release), ``front`` (the tenant's rate limits and the
early "queue full" refusal, before render), ``tenants`` (who a key is). The ledgers behind them
(``budget``, ``fleet``, ``rate_limits``, ``shares``) are wired by ``app.py`` only.
"""

__all__ = ["controller", "front", "tenants"]
