"""The engines: who they are (``engine``, ``registry``, ``capabilities``), how to call them (``client``
for the token route, ``native`` for their own OpenAI API, ``http_errors`` for what their answers
mean) and when to stop calling one (``breaker``). ``obfuscating`` is chosen by ``app.py``.
"""

__all__ = ["breaker", "capabilities", "client", "engine", "http_errors", "native", "registry"]
